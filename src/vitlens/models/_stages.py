"""The recording of hierarchical transformers with spatial-reduction attention (HF SegFormer, timm and HF PVTv2):
stages with their own token grids, blocks whose keys and values come from a reduced grid, overlapping
patch-embedding convolutions between stages. Package-internal: the adapters of those families fill it
(:mod:`.hf_segformer`, :mod:`.pvt_v2`), the hierarchical GradSkip path reads it.

Per block (:class:`StageBlockRecord`): ``u``/``h`` ``(B, T_s, D_s)`` (residual input, stream after the attention
add), ``attn`` ``(B, heads, T_s, T_k)`` (probabilities over the ``T_k`` reduced keys, in the graph), ``value``
``(B, heads, T_k, d)`` (detached), and ``reduction`` (a :class:`ConvRecord` of the key/value reduction convolution,
``None`` when the stage does not reduce). Per stage (:class:`StageRecord`): ``grid`` ``(h_s, w_s)``, ``merge`` (the
patch-embedding convolution that made this stage's tokens from the previous stage's output; ``None`` for stage 1,
whose input is the image) and ``readout`` (this stage's output as the model's head reads it, its own graph node so
its gradient is the head's *direct* gradient; ``None`` for a stage the head does not read).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NoReturn, Sequence

from torch import Tensor, nn

from ..errors import InputError, UnsupportedModelError
from .base import BlockRecord, int_pair

__all__ = ["ConvRecord", "StageBlockRecord", "StageRecord", "StageRecording", "conv_output_size", "conv_hook",
           "residual_input_hook", "stage_grids", "check_stage_input"]


@dataclass
class ConvRecord:
    """A convolution seen in the forward pass: the module, its input (detached) and its output (in the graph)."""

    conv: nn.Conv2d
    input: Tensor
    output: Tensor


@dataclass
class StageBlockRecord(BlockRecord):
    """A block of a stage: the :class:`BlockRecord` tensors plus the key/value reduction (``None`` when ``r = 1``)."""

    reduction: ConvRecord | None = None


@dataclass
class StageRecord:
    """One encoder stage: blocks, token grid, the patch embedding into it, its output as the head reads it."""

    blocks: list[StageBlockRecord] = field(default_factory=list)
    grid: tuple[int, int] | None = None
    merge: ConvRecord | None = None
    readout: Tensor | None = None


class StageRecording:
    """What a capture session of a hierarchical family records: ``stages`` in forward order (module docstring).

    ``model``: the family's name, ``why``: why it has no single token sequence (both quoted when a method reads
    ``blocks`` or ``final``, which a single-sequence recording has)."""

    def __init__(self, model: str, why: str) -> None:
        self.stages: list[StageRecord] = []
        #: the feature layers' tensors ``(B, T, C)`` in token layout, in the order of ``feature_layers()``
        self.features: list[Tensor] = []
        self._model, self._why = model, why

    def _no_single_sequence(self) -> NoReturn:
        raise UnsupportedModelError(f"{self._model} has hierarchical stages, not one token sequence: {self._why}")

    @property
    def blocks(self) -> list[BlockRecord]:
        self._no_single_sequence()

    @property
    def final(self) -> Tensor:
        self._no_single_sequence()  # there is no single final stream

    def graph_tensors(self) -> list[Tensor]:
        """All captured encoder tensors that are part of the autograd graph, stage by stage (what GradSkip
        differentiates; ``features`` that are not a stage readout are not included)."""
        out: list[Tensor] = []
        for st in self.stages:
            if st.readout is not None:
                out.append(st.readout)
            if st.merge is not None:
                out.append(st.merge.output)
            for b in st.blocks:
                out += [t for t in (b.attn, b.h) if t is not None]
                if b.reduction is not None:
                    out.append(b.reduction.output)
        return out


def conv_output_size(conv: nn.Conv2d, hw: tuple[int, int]) -> tuple[int, int]:
    """Spatial output size of ``conv`` for an input of size ``hw`` (PyTorch's formula)."""
    if isinstance(conv.padding, str):
        raise UnsupportedModelError(f"convolution with padding={conv.padding!r}: vitlens needs explicit padding sizes")
    out = []
    for i in range(2):
        k, s, p, d = conv.kernel_size[i], conv.stride[i], conv.padding[i], conv.dilation[i]
        out.append((hw[i] + 2 * p - d * (k - 1) - 1) // s + 1)
    return out[0], out[1]


def stage_grids(embeds: Sequence[nn.Conv2d], input_hw: tuple[int, int]) -> list[tuple[int, int]]:
    """Token grid ``(h_s, w_s)`` of every stage for an input of size ``input_hw``, from the convolutions that embed
    each stage's tokens (input side first)."""
    grids, hw = [], int_pair(input_hw)
    for conv in embeds:
        hw = conv_output_size(conv, hw)
        grids.append(hw)
    return grids


def check_stage_input(x: Tensor, in_chans: int | None, model: str, grids: Sequence[tuple[int, int]],
                      reductions: Sequence[nn.Conv2d | None]) -> None:
    """Raise :class:`InputError` when ``x`` has other than ``in_chans`` channels, or its size leaves a stage's grid
    (``grids``, for ``x``'s size) empty or smaller than that stage's key-reduction window (``reductions``: per stage,
    the first block's reduction convolution or ``None``). ``model``: the family, as the message names it."""
    if in_chans is not None and x.shape[1] != in_chans:
        raise InputError(f"model expects {in_chans} input channels; got a batch with {x.shape[1]}")
    hw = int_pair(x.shape[-2:])
    for s, ((gh, gw), red) in enumerate(zip(grids, reductions)):
        if gh < 1 or gw < 1:
            raise InputError(f"input size {hw[0]}x{hw[1]} is too small for this {model} (stage {s + 1} is empty)")
        if red is not None and (gh < red.kernel_size[0] or gw < red.kernel_size[1]):
            raise InputError(
                f"input size {hw[0]}x{hw[1]} is too small for this {model}: stage {s + 1}'s {gh}x{gw} token "
                f"grid holds no {red.kernel_size[0]}x{red.kernel_size[1]} key-reduction window")


def conv_hook(record: Any, attr: str):
    """Forward hook of a convolution that sets ``record.<attr>`` to its :class:`ConvRecord`."""

    def hook(module: nn.Conv2d, args: tuple, output: Tensor) -> None:
        setattr(record, attr, ConvRecord(conv=module, input=args[0].detach(), output=output))

    return hook


def residual_input_hook(brec: StageBlockRecord, leaf: bool):
    """Pre-hook of a block (``with_kwargs=True``): records ``u``; for the first block of stage 1 (``leaf``), replaces
    it by a leaf that requires grad (the backward stops there)."""

    def hook(module: nn.Module, args: tuple, kwargs: dict):
        key = None
        if args:
            u = args[0]
        else:
            key = "hidden_states" if "hidden_states" in kwargs else next(iter(kwargs))
            u = kwargs[key]
        if leaf:
            u = u.detach().requires_grad_(True)
        brec.u = u
        if not leaf:
            return None
        if key is None:
            return (u, *args[1:]), kwargs
        return args, {**kwargs, key: u}

    return hook
