#!/usr/bin/env bash
# Set up a development checkout from scratch (offline apart from the package registry):
#   .venv      vitlens with timm, transformers, the perturbation extras, test tools and the peer libraries
#   .venv-lxt  a second environment for the LXT cross-check (LXT needs transformers<5; kept apart on purpose)
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/pip install -q -e ".[dev,peers]"
if [ "${VITLENS_SKIP_LXT:-0}" != "1" ]; then
  python3 -m venv .venv-lxt
  .venv-lxt/bin/pip install -q -e . lxt "transformers<5" timm torchvision
fi
echo "vitlens set up in .venv (and .venv-lxt for the LXT cross-check)"
