#!/usr/bin/env bash
# Retrain the five shipped AHA explainers with the tracked recipe (references drawn per step, validation and the
# choice of the shipped checkpoint on the four-reference matrix). Each run resumes (--resume) where it stopped, so the
# script can be rerun after a crash or a session end; the weights, metadata and card land in runs/aha-<model>/ and are
# copied into src/vitlens/aha/weights/ by hand after review.
#   bash scripts/train_aha_explainers.sh [a|b|all]   (a and b are two halves that can run side by side, one core each)
set -euo pipefail
cd "$(dirname "$0")/.."
VITLENS=${VITLENS:-.venv/bin/vitlens}
OUT=${OUT:-runs}
train() {  # model data steps pool
  local out="$OUT/aha-$1" resume=()
  [ -f "$out/checkpoint.pt" ] && resume=(--resume)  # --resume refuses a folder with nothing to continue
  "$VITLENS" train-aha --model "$1" --data "$2" --out "$out" --name "$1-aha" --steps "$3" \
    --batch-size 8 --n-val 96 --val-every 50 --ckpt-every 10 --seed 0 --threads 1 --pool "$4" --no-progress \
    "${resume[@]}"
}
part=${1:-all}
if [ "$part" = a ] || [ "$part" = all ]; then
  train shapes-vit scenes 200 tokens
  train planted-vit planted 120 tokens
fi
if [ "$part" = b ] || [ "$part" = all ]; then
  train digits-vit digits 200 none
  train shapes-deit scenes 150 tokens
  train shapes-vit-gap-reg scenes 150 tokens
fi
