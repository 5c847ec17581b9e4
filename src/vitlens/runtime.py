"""What the long-running commands share — the training commands (:mod:`vitlens.training`), the benchmark harness
(:mod:`vitlens.bench`) and, as it moves over, AHA's training (:mod:`vitlens.aha`): one copy of each.

* ``KEY=VALUE`` settings: :func:`parse_value`, :func:`parse_key_value`, :func:`split_top`.
* The learning-rate schedule (linear warm-up, then cosine decay): :func:`warmup_cosine` (by fraction of training)
  and :func:`warmup_cosine_steps` (by optimiser step).
* ``torch.distributed`` under ``torchrun``: :func:`distributed_env`, :func:`init_distributed`.
* Files that are never seen half-written: :func:`atomic_write`, :func:`atomic_write_text`, :func:`atomic_torch_save`
  (write to ``<name>.tmp`` beside the target, then ``os.replace``), and :func:`write_model_card`.
* The Gini coefficient used to describe attention: :func:`gini`.
"""

from __future__ import annotations

import ast
import math
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from .atomic import atomic_path, save_torch, write_text
from .errors import InputError

__all__ = [
    "add_run_folder_arguments", "add_process_arguments",
    "parse_value", "parse_key_value", "split_top",
    "warmup_cosine", "warmup_cosine_steps",
    "DistributedRun", "distributed_env", "init_distributed", "rng_state", "set_rng_state",
    "atomic_write", "atomic_write_text", "atomic_torch_save", "write_model_card",
    "gini",
]


# -- KEY=VALUE settings -------------------------------------------------------------------------------------------
def parse_value(raw: str) -> Any:
    """A setting's value: a Python literal (``0.5``, ``'fixed'``, ``('top', 0.25)``, ``None``), else the string."""
    try:
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return raw


def parse_key_value(pair: str, what: str = "setting") -> tuple[str, Any]:
    """``"key=value"`` → ``(key, value)`` with :func:`parse_value`, both stripped; :class:`InputError` if the pair
    has no ``=`` or an empty key (``what`` names the pair in the message)."""
    key, sep, raw = pair.partition("=")
    if not sep or not key.strip():
        raise InputError(f"{what} {pair!r} is not KEY=VALUE")
    return key.strip(), parse_value(raw.strip())


def split_top(text: str, sep: str) -> list[str]:
    """Split on ``sep`` outside brackets and quotes; parts are stripped and empty parts dropped."""
    parts: list[str] = []
    cur: list[str] = []
    depth, quote = 0, ""
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
            continue
        cur.append(ch)
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


# -- the learning-rate schedule -----------------------------------------------------------------------------------
def warmup_cosine(progress: float, warmup: float, min_frac: float) -> float:
    """Learning-rate factor at ``progress`` ∈ [0, 1] of training: linear warm-up from 0 to 1 over the first
    ``warmup`` (a fraction of training), then cosine decay from 1 to ``min_frac`` at the end."""
    progress = min(max(progress, 0.0), 1.0)
    if warmup > 0 and progress < warmup:
        return progress / warmup
    t = (progress - warmup) / max(1.0 - warmup, 1e-8)
    return min_frac + (1.0 - min_frac) * 0.5 * (1.0 + math.cos(math.pi * t))


def warmup_cosine_steps(step: int, steps: int, warmup_steps: int, min_frac: float = 0.0) -> float:
    """The same schedule by optimiser step ``step`` (0-based) of ``steps``: ``(step + 1) / warmup_steps`` during the
    first ``warmup_steps`` steps, then cosine decay from 1 to ``min_frac``, reached at step ``steps`` (held after).

    The caller fixes ``warmup_steps`` from its warm-up fraction (and so its own rounding: the digits command rounds
    ``warmup_frac·steps`` to the nearest step, AHA's training takes the ceiling and at least one step)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    t = (step - warmup_steps) / max(steps - warmup_steps, 1)
    return min_frac + (1.0 - min_frac) * 0.5 * (1.0 + math.cos(math.pi * min(t, 1.0)))


# -- torch.distributed ----------------------------------------------------------------------------------------------
@dataclass
class DistributedRun:
    """This process's place in a ``torchrun`` job (``world == 1``: a single process, nothing initialised)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    initialised_here: bool = False

    @property
    def active(self) -> bool:
        return self.world > 1

    def barrier(self) -> None:
        """Wait for every process (no-op for a single process)."""
        if self.active:
            import torch.distributed as dist

            dist.barrier()

    def finish(self) -> None:
        """At the end of a run: wait for every process, then end the process group if this run started it."""
        if self.active:
            import torch.distributed as dist

            dist.barrier()
            if self.initialised_here:
                dist.destroy_process_group()


def distributed_env() -> tuple[int, int]:
    """``(rank, world size)`` from ``torchrun``'s environment (``RANK``, ``WORLD_SIZE``; ``(0, 1)`` without)."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(device: torch.device | None = None) -> DistributedRun:
    """Join the ``torchrun`` process group when ``WORLD_SIZE > 1`` (gloo on CPU, nccl on CUDA, where this process's
    GPU is ``LOCAL_RANK``); an already initialised group is used as it is. A single process returns the default."""
    rank, world = distributed_env()
    if world <= 1:
        return DistributedRun()
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", rank))
    here = False
    if not dist.is_initialized():
        use_cuda = torch.cuda.is_available() and (device is None or device.type == "cuda")
        if use_cuda:
            torch.cuda.set_device(local)
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
        here = True
    return DistributedRun(rank=dist.get_rank(), world=dist.get_world_size(), local_rank=local, initialised_here=here)


# -- atomic files ---------------------------------------------------------------------------------------------------
def atomic_write(path: str | os.PathLike, write: Callable[[Path], Any], mode: int | None = None) -> Path:
    """Call ``write(tmp)`` on a temporary file beside ``path``, then replace ``path`` by it (readers see the old file
    or the new one, never a partial one); the one mechanism is :func:`vitlens.atomic.atomic_path`. ``mode``:
    permissions of the result (e.g. ``0o644`` for package data; safetensors creates owner-only files)."""
    with atomic_path(path) as tmp:
        write(tmp)
        if mode is not None:
            os.chmod(tmp, mode)
    return Path(path)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write UTF-8 ``text`` to ``path`` atomically (:func:`vitlens.atomic.write_text`)."""
    return write_text(path, text)


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> Path:
    """``torch.save(obj, path)`` atomically (:func:`vitlens.atomic.save_torch`): a checkpoint is complete or absent."""
    return save_torch(obj, path)


def write_model_card(path: str | os.PathLike, lines: Sequence[str]) -> Path:
    """Write a model card (Markdown lines joined by newlines) atomically, UTF-8."""
    return atomic_write_text(path, "\n".join(lines))


# -- Gini ---------------------------------------------------------------------------------------------------------
def gini(p: torch.Tensor) -> torch.Tensor:
    """Gini coefficient over the last dimension of non-negative values ``(..., n)``: 0 for uniform, ``(n−1)/n`` for a
    single spike; a row that sums to zero gets 0 (GradSkip's head sparsity, the models' head statistics).

    For values sorted ascending ``p(1) ≤ … ≤ p(n)``: ``G = 2·Σ_i i·p(i) / (n·Σ_i p(i)) − (n+1)/n``.
    """
    n = p.shape[-1]
    out_dtype = p.dtype
    if p.dtype in (torch.float16, torch.bfloat16):  # ranks up to n and their weighted sum need float32
        p = p.float()
    if p.device.type == "cpu" and not p.requires_grad:
        # numpy's sort is ~20x faster than torch.sort on CPU for many short rows (same values; measured in
        # docs/benchmarks/gradskip_cost.md); the Gini values do not need gradients.
        srt = torch.from_numpy(np.sort(p.contiguous().numpy(), axis=-1))
    else:
        srt = p.sort(dim=-1).values
    ranks = torch.arange(1, n + 1, device=p.device, dtype=p.dtype)
    total = srt.sum(dim=-1)
    g = 2.0 * (srt @ ranks) / (n * total.clamp_min(torch.finfo(p.dtype).tiny)) - (n + 1) / n
    return torch.where(total > 0, g, torch.zeros_like(g)).to(out_dtype)


def rng_state() -> dict[str, Any]:
    """The torch, NumPy and Python (and initialised CUDA) random states, for :func:`set_rng_state` (a checkpoint).

    Tensors and plain values only (NumPy's key array as an int64 tensor), so that a checkpoint holding it loads with
    ``torch.load(weights_only=True)``."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": (str(name), torch.from_numpy(np.asarray(keys, dtype=np.int64)), int(pos), int(has_gauss),
                       float(cached))}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore the random states :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    name, keys, *rest = state["numpy"]
    keys = keys.numpy() if isinstance(keys, torch.Tensor) else np.asarray(keys)  # (an array in older checkpoints)
    np.random.set_state((name, keys.astype(np.uint32), *rest))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def add_run_folder_arguments(p: Any, *, models: str, suffix: str) -> None:
    """The arguments every training command shares (``train-aha``, ``train-shapley``): the model and its options, the
    data, the run folder and how an earlier run in it is treated. ``models`` says which models the command takes,
    ``suffix`` ends the default output name (``<model>-<suffix>``)."""
    p.add_argument("--model", required=True, help=models)
    p.add_argument("--model-option", action="append", default=[], metavar="KEY=VALUE",
                   help="argument for vitlens.load_model (e.g. pretrained=False), repeatable")
    p.add_argument("--data", default="scenes", help="'scenes' (synthetic scenes), 'planted' / 'cues' (the scenes of "
                                                    "vitlens.data.evidence), 'digits' (MNIST-5k) or an image folder")
    p.add_argument("--out", required=True, help="output folder (checkpoint.pt, <name>.safetensors/.json/.md)")
    p.add_argument("--name", default=None, help=f"stem of the output files (default: <model>-{suffix})")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier run in OUT (default: refuse it)")


def add_process_arguments(p: Any, positive_int: Callable[[str], int]) -> None:
    """The per-process arguments every training command shares: torch threads (read by ``positive_int``, the
    command line's converter), device, progress bar."""
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads per process (default: cores/processes)")
    p.add_argument("--device", default=None, help="cpu, cuda (default: cuda if available)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
