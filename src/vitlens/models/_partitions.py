"""The recording of MaxViT (timm ``MaxxVit`` built of ``MaxxVitBlock``\\ s): per block an MBConv block, then block
attention over windows and grid attention over a dilated grid of the 2-d feature map. Package-internal: the MaxViT
adapter (:mod:`.timm_maxxvit`) fills it in a ``session(partitions=True)``, the MaxViT GradSkip path reads it.

Per block (:class:`MaxVitBlockRecord`), in forward order:

* ``conv`` (:class:`MBConvRecord`): the MBConv block's output ``out`` ``(B, C, H, W)`` (in the graph), its shortcut
  ``shortcut`` ``(B, C, H, W)`` (detached; the block input itself when the shortcut is the identity), the k×k
  depthwise convolution ``dw`` (a :class:`WindowOpRecord`: module, input detached, output in the graph) and, at a
  stage's strided first block, the shortcut's average pool ``pool`` (same record; ``None`` for the identity).
* ``attns``: the block attention, then the grid attention (:class:`PartitionRecord`): ``u`` ``(B, H·W, C)`` (the
  sub-block's input, detached), ``h`` (after the attention residual, in the graph, in the block's own layout
  ``(B, H, W, C)`` or ``(B, C, H, W)``: :meth:`PartitionRecord.tokens` gives ``(B, H·W, C)``), ``attn``
  ``(B·nP, heads, N, N)`` (the softmax probabilities over the ``N`` cells of each of the ``nP`` partitions of every
  image, in the graph), ``vnorm`` ``(B·nP, heads, N)`` (value norms), the partition kind and size, and the grid.

``final``: the last stage's output ``(B, C, h, w)`` as the head reads it (in the graph); ``start``: the first block's
input grid ``(H, W)``, where the maps live.

The partitions (timm's ``window_partition`` / ``grid_partition``, read for the layout only):
a *block* partition of size ``(p, q)`` cuts ``(H, W)`` into ``H/p × W/q`` windows of ``p × q`` neighbouring cells
(cell ``(i, j)`` is in window ``(i // p, j // q)`` at ``(i % p, j % q)``); a *grid* partition of size ``(g, k)``
makes ``H/g × W/k`` groups of ``g × k`` cells spaced ``H/g`` and ``W/k`` apart (cell ``(i, j)`` is in group
``(i % (H/g), j % (W/k))`` at ``(i // (H/g), j // (W/k))``); partitions run row-major per image, images first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor, nn

__all__ = ["MBConvRecord", "MaxVitBlockRecord", "PartitionRecord", "PartitionRecording", "WindowOpRecord",
           "from_partitions", "to_partitions"]


@dataclass
class WindowOpRecord:
    """A windowed linear map seen in the forward pass (a depthwise convolution or an average pool): the module, its
    input (detached) and its output (in the graph)."""

    module: nn.Module
    input: Tensor
    output: Tensor


@dataclass
class MBConvRecord:
    """One MBConv block (see the module docstring)."""

    out: Tensor | None = None
    shortcut: Tensor | None = None
    dw: WindowOpRecord | None = None
    pool: WindowOpRecord | None = None


@dataclass
class PartitionRecord:
    """One partition attention (block or grid) with its MLP (see the module docstring)."""

    kind: str  # "block" | "grid"
    size: tuple[int, int]
    grid: tuple[int, int] = (0, 0)
    channels_last: bool = True  # h's layout: (B, H, W, C), else (B, C, H, W)
    u: Tensor | None = None
    h: Tensor | None = None
    attn: Tensor | None = None
    vnorm: Tensor | None = None

    def tokens(self, t: Tensor) -> Tensor:
        """``t`` (``h`` or its gradient) in token layout ``(B, H·W, C)``."""
        return t.reshape(t.shape[0], -1, t.shape[-1]) if self.channels_last else t.flatten(2).transpose(1, 2)


@dataclass
class MaxVitBlockRecord:
    """One ``MaxxVitBlock``: the MBConv record and its (one or two) partition attentions, in forward order."""

    stage: int
    conv: MBConvRecord = field(default_factory=MBConvRecord)
    attns: list[PartitionRecord] = field(default_factory=list)


@dataclass
class PartitionRecording:
    """What a ``session(partitions=True)`` of the MaxViT adapter records (module docstring)."""

    blocks: list[MaxVitBlockRecord] = field(default_factory=list)
    final: Tensor | None = None
    start: tuple[int, int] | None = None

    def graph_tensors(self) -> list[Tensor]:
        """Every recorded tensor in the autograd graph (what the propagation differentiates)."""
        out: list[Tensor] = [] if self.final is None else [self.final]
        for b in self.blocks:
            c = b.conv
            out += [t for t in (c.out, None if c.dw is None else c.dw.output,
                                None if c.pool is None else c.pool.output) if t is not None]
            for a in b.attns:
                out += [t for t in (a.attn, a.h) if t is not None]
        return out


def to_partitions(r: Tensor, kind: str, size: tuple[int, int]) -> Tensor:
    """Per-cell values ``(B, H, W)`` → ``(B·nP, N)`` in the order the partition attention sees its cells."""
    b, h, w = r.shape
    p, q = size
    if kind == "block":
        return r.reshape(b, h // p, p, w // q, q).permute(0, 1, 3, 2, 4).reshape(-1, p * q)
    return r.reshape(b, p, h // p, q, w // q).permute(0, 2, 4, 1, 3).reshape(-1, p * q)


def from_partitions(rp: Tensor, batch: int, grid: tuple[int, int], kind: str, size: tuple[int, int]) -> Tensor:
    """Inverse of :func:`to_partitions`: ``(B·nP, N)`` → ``(B, H, W)``."""
    h, w = grid
    p, q = size
    if kind == "block":
        return rp.reshape(batch, h // p, w // q, p, q).permute(0, 1, 3, 2, 4).reshape(batch, h, w)
    return rp.reshape(batch, h // p, w // q, p, q).permute(0, 3, 1, 4, 2).reshape(batch, h, w)
