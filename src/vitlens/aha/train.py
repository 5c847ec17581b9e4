"""Training an AHA explainer for a frozen target model: Python API :func:`train_aha` and the ``train-aha`` command.

One step (global batch of ``b`` images; every random choice is drawn from generators keyed by ``(seed, step)`` or
``(seed, step, image index)``, never from a global RNG, so a run is reproducible, resumable and equal under any
number of processes):

1. Backbone features and the target's logits on the clean images (one no-grad forward of the target when the backbone
   is the target). Two classes per image: the top-1 prediction and the runner-up when top-1 is correct, otherwise the
   ground-truth label (the runner-up when there is no label).
2. Per step: grid size ``g`` uniform in the grid range, a random grid offset, the reference (black / mean colour /
   blur, uniform), the curve fractions (``fixed`` or ``random``); per image: Gumbel noise.
3. The decoder maps ``S`` for every (image, class); soft deletion/insertion curves at the inner fractions (the
   endpoints are the exact probabilities on ``x`` and on the reference, from no-grad passes); loss
   ``w_del·AUC_desc + w_ins·(1 − AUC_asc) + w_peak·P_peak`` averaged over images and classes.
4. AdamW (lr 3e-4, weight decay 1e-3), gradient clipping 1.0, linear warm-up over 6 % of the steps then cosine decay;
   the sorter temperature is annealed linearly from 1.0 to 0.3.

The target model is frozen for the whole run (``adapter.session``: eval mode, ``requires_grad=False``, restored at the
end); gradients flow through it into the decoder only.

Distributed: launched with ``torchrun --nproc_per_node N``, the run initialises a process group (nccl on CUDA, gloo
on CPU), wraps the decoder in :class:`torch.nn.parallel.DistributedDataParallel` and shards every global batch with a
:class:`torch.utils.data.DistributedSampler` (rank ``r`` gets positions ``r, r+N, …`` of the shuffled order, so the N
local batches of ``b/N`` images together are exactly the single-process batch of ``b``; each rank averages its loss
over its images and DDP averages gradients over ranks, which equals the global mean).

Checkpoints (``checkpoint.pt`` in the output folder, every ``ckpt_every`` steps, at the end, and on Ctrl-C after the
last whole step; written atomically): decoder weights, optimiser, scheduler, step, RNG states (torch, numpy, python;
CUDA when used), config, history. ``resume=True`` continues from it; a folder holding an earlier run is otherwise
refused unless ``overwrite=True`` (:mod:`vitlens.run_folders`). Outputs: ``<name>.safetensors`` + ``<name>.json``
(metadata: config, command, seed, time, validation) + ``<name>.md`` (model card).

Validation (every ``val_every`` steps and at the end): :func:`vitlens.aha.evaluation.deletion_insertion` on held-out
images with the explainer's maps for the predicted class (the authors' protocol: hard pixel ranking, 21 points,
mean reference, softmax probability, trapezoid).

Modules: :mod:`.config` (:class:`AHATrainConfig`, :data:`RECIPES`, :class:`TrainResult`), :mod:`.data` (the training
and validation sets), :mod:`.plan` (the keyed random choices of a step, the schedules), :mod:`.loop` (the loss, the
loop, validation, checkpoints, the written files), :mod:`.card` (the model card), :mod:`.cli` (the command). This
module gathers their public names (the API documented above) and runs the command as ``python -m vitlens.aha.train``.
"""

from __future__ import annotations

import sys

from .card import curve_lines, model_card, model_name, versions
from .cli import add_train_aha_parser, cmd_train_aha, main
from .config import RECIPES, RESUMABLE_CHANGES, AHATrainConfig, TrainResult
from .data import (TRAIN_SEED_OFFSET, VAL_SEED_OFFSET, FolderData, ScenesData, TensorData, data_config, datasets,
                   mean_std)
from .loop import soft_validate, target_probs, train_aha, training_loss, validate
from .plan import StepPlan, choose_classes, image_noise, lr_factor, plan_step, temperature

# earlier private names, kept for the benchmarks that import them (benchmarks/aha_train_cost.py)
_ScenesData = ScenesData
_mean_std = mean_std

__all__ = ["AHATrainConfig", "TrainResult", "add_train_aha_parser", "main", "train_aha", "training_loss"]

__all__ += ["FolderData", "RECIPES", "RESUMABLE_CHANGES", "ScenesData", "StepPlan", "TRAIN_SEED_OFFSET", "TensorData",
            "VAL_SEED_OFFSET", "choose_classes", "cmd_train_aha", "curve_lines", "data_config", "datasets",
            "image_noise", "lr_factor", "mean_std", "model_card", "model_name", "plan_step", "soft_validate",
            "target_probs", "temperature", "validate", "versions"]

if __name__ == "__main__":  # pragma: no cover
    # through the command line's wrapper: a bad option or Ctrl-C is one line and an exit code, never a traceback
    import importlib

    sys.exit(importlib.import_module("vitlens.cli").main(["train-aha", *sys.argv[1:]]))
