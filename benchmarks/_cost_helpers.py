"""Helpers of ``benchmarks/gradskip_cost.py`` (and the scripts that import it): the attention-path switch, FLOP
formulas for the CPU fused-attention kernels, and the process's resident-memory readings."""

from __future__ import annotations

import contextlib
import os
import resource
import sys
from typing import Any

import torch
from torch import nn

__all__ = ["FOOTNOTES", "attention_path", "custom_flops", "_peak_rss_bytes", "_reset_peak_rss", "_rss_bytes"]


@contextlib.contextmanager
def attention_path(model: nn.Module, fused: bool | None):
    """Every attention module of ``model`` on timm's fused (``True``) or explicit (``False``) path for the duration;
    ``None``: each module on the path it has (as ``timm.create_model`` built it: fused for ViT/EVA02, explicit for
    Swin, whose fused path timm marks experimental)."""
    if fused is None:
        yield
        return
    mods = [m for m in model.modules() if hasattr(m, "fused_attn")]
    saved = [m.fused_attn for m in mods]
    try:
        for m in mods:
            m.fused_attn = fused
        yield
    finally:
        for m, f in zip(mods, saved):
            m.fused_attn = f


def _sdpa_flops(q: Any, k: Any, v: Any, *args: Any, **kwargs: Any) -> int:
    """CPU fused attention forward: ``q·kᵀ`` and ``A·v``, 2 FLOPs per multiply-add (as the explicit path's two
    ``bmm``)."""
    b, h, tq, d = q
    return 2 * b * h * tq * k[-2] * (d + v[-1])


def _sdpa_backward_flops(g: Any, q: Any, k: Any, v: Any, *args: Any, **kwargs: Any) -> int:
    """CPU fused attention backward: the explicit path's four ``bmm`` (``∂A``, ``∂v``, ``∂q``, ``∂k``); the kernel's
    recomputation of ``q·kᵀ`` is not counted."""
    b, h, tq, d = q
    return 2 * b * h * tq * k[-2] * (2 * v[-1] + 2 * d)


def custom_flops() -> dict:
    """FLOP formulas for the CPU fused-attention kernels, which ``FlopCounterMode`` does not count by itself."""
    aten = torch.ops.aten
    out = {}
    for name, fn in (("_scaled_dot_product_flash_attention_for_cpu", _sdpa_flops),
                     ("_scaled_dot_product_flash_attention_for_cpu_backward", _sdpa_backward_flops)):
        if hasattr(aten, name):
            out[getattr(aten, name)] = fn
    return out


def _peak_rss_bytes() -> int:
    """Peak resident set size of this process.

    Linux: ``VmHWM`` from ``/proc/self/status``, the address space's high-water mark, which ``clear_refs`` can reset.
    ``getrusage(RUSAGE_SELF).ru_maxrss`` reports the same high-water mark but also keeps the maximum of the address
    space replaced at ``exec`` -- in a subprocess that is the *parent's* resident size at fork time, which would
    hide the call's peak. Elsewhere: ``ru_maxrss``.
    """
    with contextlib.suppress(OSError):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    ru = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return ru if sys.platform == "darwin" else ru * 1024  # kilobytes on Linux


def _reset_peak_rss() -> bool:
    """Reset this process's peak RSS (``VmHWM``) to its current RSS; Linux only (``clear_refs``)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _rss_bytes() -> int:
    """Current resident set size of this process (Linux ``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


#: the notes under ``gradskip_cost.py``'s report: how time ratios, FLOPs and peak memory are measured
FOOTNOTES = [
    "Time ratios are medians of the per-repeat ratios (all rows run back to back in every repeat; \"floor\" is "
    "(b′) for the default-attention rows, (b″) for the forced-fused ones and (b) for the explicit ones; \"time × user "
    "floor\": against (b′), the floor of the model as timm builds it, or (b″) where only that was run); absolute "
    "times depend on the machine and are not the claim. FLOPs are counted by "
    "`torch.utils.flop_counter.FlopCounterMode` (matmul-class ops and convolutions, 2 FLOPs per multiply-add; "
    "elementwise ops, softmax, LayerNorm and sorting are not counted) at batch 1, in forward and backward.",
    "¹ CPU peak memory: each (model, row) runs once in a fresh subprocess. After model creation, input creation and a "
    "batch-1 warm-up forward, the process's peak RSS is reset to its current RSS (`echo 5 > /proc/self/clear_refs`); "
    "reported is the peak RSS after the call minus that RSS, i.e. the peak extra resident "
    "memory of the call at the given batch (activations, autograd buffers, GradSkip's captures; weights and input "
    "excluded; memory the allocator kept from the warm-up and reuses is not counted). The peak RSS is read as "
    "`VmHWM` from `/proc/self/status`, the high-water mark that `getrusage(RUSAGE_SELF).ru_maxrss` also reports, "
    "because in a subprocess `ru_maxrss` additionally keeps the parent's resident size from before `exec`, which "
    "hides the call's peak.",
    "² CUDA peak memory: `torch.cuda.max_memory_allocated` after `reset_peak_memory_stats` minus the memory allocated "
    "before the call (weights and input excluded), in a fresh subprocess per (model, row).",
]
