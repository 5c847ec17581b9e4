"""The adapter interface: the one place that knows model families.

An adapter wraps a model and knows (1) its token layout (prefix tokens, readout tokens, token grid for an input size)
and (2) how to *capture*, during one forward pass, the tensors that relevance methods need, block by block:

- ``attn``  (B, heads, T, T_k): attention probabilities, part of the autograd graph (explicit attention);
- ``value`` (B, heads, T_k, d_head): the value vectors (detached);
- ``u``     (B, T, D): the block's residual input;
- ``h``     (B, T, D): the residual stream after the attention add, ``h = u + attention_branch(u)``;
- ``final`` (B, T, D): the residual stream after the last block (before the final norm).

Everything an adapter changes on the model (hooks, fused/eager attention switches, train/eval mode, parameter
``requires_grad``) is undone when the :meth:`Adapter.session` context exits, also when an exception is raised inside.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import Tensor, nn

from ..errors import InputError

__all__ = ["Adapter", "BlockRecord", "Recording", "conservative_layernorm_hook"]


@dataclass
class BlockRecord:
    """What was captured in one transformer block (see module docstring for shapes)."""

    u: Tensor | None = None
    h: Tensor | None = None
    attn: Tensor | None = None
    value: Tensor | None = None


@dataclass
class Recording:
    """Tensors captured during one forward pass, in block order."""

    blocks: list[BlockRecord] = field(default_factory=list)
    final: Tensor | None = None

    def graph_tensors(self) -> list[Tensor]:
        """All captured tensors that are part of the autograd graph (for :func:`torch.autograd.grad`)."""
        out: list[Tensor] = []
        for b in self.blocks:
            out += [t for t in (b.u, b.h, b.attn) if t is not None]
        if self.final is not None:
            out.append(self.final)
        return out


def conservative_layernorm_hook(module: nn.LayerNorm, inputs: tuple, output: Tensor) -> Tensor:
    """Forward hook that recomputes a LayerNorm with its standard deviation detached from the graph.

    The forward value is unchanged (up to float rounding); in the backward pass the normalisation acts as a linear map
    (centering, then division by a constant), so gradient × input is conserved through it (Ali et al., ICML 2022).
    """
    from ._conservative_ln import constant_std_layer_norm  # one fused forward; only 1/std kept for the backward

    y = constant_std_layer_norm(inputs[0], module.weight, module.bias, module.normalized_shape, module.eps)
    return y.to(output.dtype)


class Adapter:
    """Base adapter. Subclasses fill in the family-specific parts.

    Attributes set by subclasses:
        model: the wrapped ``nn.Module``.
        family: short name of the model family (e.g. ``"timm-vit"``).
        num_prefix_tokens: tokens before the patch tokens (CLS, DIST, registers).
        readout_tokens: indices of the tokens the classifier reads, or ``None`` for pooled readouts.
        num_classes: size of the model's output.
    """

    family: str = "base"
    #: capabilities this adapter offers to explainers (e.g. "attention" for relevance propagation).
    capabilities: frozenset[str] = frozenset()

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.num_prefix_tokens: int = 0
        self.readout_tokens: tuple[int, ...] | None = None
        self.num_classes: int = 0

    # -- layout --------------------------------------------------------------------------------------------------
    def grid(self, input_hw: tuple[int, int]) -> tuple[int, int]:
        """Token grid ``(gh, gw)`` for an input of spatial size ``input_hw``."""
        raise NotImplementedError

    def check_input(self, x: Tensor) -> None:
        """Raise :class:`InputError` if ``x`` cannot be fed to the model (size, channels)."""

    # -- running -------------------------------------------------------------------------------------------------
    def forward(self, x: Tensor) -> Tensor:
        """Logits ``(B, K)`` of the model for input ``x``."""
        out = self.model(x)
        return _logits_of(out)

    def blocks(self) -> Sequence[nn.Module]:
        """The transformer blocks, in order."""
        raise NotImplementedError

    def feature_layers(self) -> Sequence[nn.Module]:
        """The layers whose features (``BlockRecord.u``, ``(B, T, D)``) feature methods such as Grad-CAM may read;
        for transformers the blocks (layer ``l``: the residual stream entering block ``l``)."""
        return self.blocks()

    def layernorms(self) -> list[nn.LayerNorm]:
        """LayerNorms treated as linear in the backward pass in conservative mode (blocks and final norms)."""
        return [m for m in self.model.modules() if isinstance(m, nn.LayerNorm)]

    def _install_capture(self, rec: Recording, hooks: list) -> None:
        """Register the family-specific capture hooks, appending their handles to ``hooks``."""
        raise NotImplementedError

    def _new_recording(self) -> Any:
        """The object the capture hooks fill: a :class:`Recording` (one token sequence); families with another
        layout (hierarchical stages) return their own."""
        return Recording()

    @contextlib.contextmanager
    def _explicit_attention(self) -> Iterator[None]:
        """Switch attention to the explicit (attention-matrix computing) path for the duration of the context."""
        yield

    @contextlib.contextmanager
    def session(self, capture: bool = True, conservative: bool = False) -> Iterator[Recording]:
        """Context in which :meth:`forward` records a :class:`Recording`.

        Puts the model in eval mode, switches on explicit attention (if ``capture``), makes the residual stream at the
        first block a fresh leaf that requires grad (so the backward stops there and works with frozen parameters),
        and optionally makes LayerNorms conservative. Parameters are frozen for the duration (activation gradients
        only). Everything is restored on exit, also after an exception.
        """
        model = self.model
        modes = {m: m.training for m in model.modules()}
        grads = {p: p.requires_grad for p in model.parameters()}
        hooks: list[Any] = []
        rec = self._new_recording()
        try:
            model.eval()
            for p in grads:
                p.requires_grad_(False)
            with contextlib.ExitStack() as stack:
                if capture:
                    stack.enter_context(self._explicit_attention())
                    self._install_capture(rec, hooks)
                if conservative:
                    for ln in self.layernorms():
                        hooks.append(ln.register_forward_hook(conservative_layernorm_hook))
                yield rec
        finally:
            for hnd in hooks:
                hnd.remove()
            for p, flag in grads.items():
                p.requires_grad_(flag)
            for m, flag in modes.items():
                m.training = flag

    def _embedding_module(self) -> nn.Module:
        """The module whose output is the token sequence with position embeddings added (before the blocks)."""
        raise NotImplementedError

    @contextlib.contextmanager
    def keep_tokens(self, keep: Tensor) -> Iterator[None]:
        """Run the model on a subset of patch tokens (each with its own position embedding) within the context.

        ``keep``: ``(B, k)`` long indices into the patch tokens (row-major on the token grid) for each image of the
        batch that :meth:`forward` will receive. Prefix tokens are always kept. Tokens are dropped after the
        embeddings: no replacement value is used (as TIS and MUTEX require). Needs the ``"tokens"`` capability.
        """
        if keep.ndim != 2 or keep.dtype != torch.long:
            raise InputError(f"keep must be a (B, k) long tensor, got {tuple(keep.shape)} {keep.dtype}")
        p = self.num_prefix_tokens

        def hook(module: nn.Module, args: tuple, out: Tensor) -> Tensor:
            if out.shape[0] != keep.shape[0]:
                raise InputError(f"keep has {keep.shape[0]} rows for a batch of {out.shape[0]}")
            n_patch = out.shape[1] - p
            if int(keep.max()) >= n_patch or int(keep.min()) < 0:
                raise InputError(f"keep indices must be in [0, {n_patch}) patch tokens")
            idx = keep.to(out.device)[:, :, None].expand(-1, -1, out.shape[-1])
            return torch.cat([out[:, :p], out[:, p:].gather(1, idx)], dim=1)

        handle = self._embedding_module().register_forward_hook(hook)
        try:
            yield
        finally:
            handle.remove()

    # -- helpers for subclasses ------------------------------------------------------------------------------------
    @staticmethod
    def _leaf_first_block_hook(rec: Recording, index: int) -> Callable:
        """Pre-hook for block ``index``: records ``u``; for block 0, replaces it by a leaf that requires grad."""

        def hook(module: nn.Module, args: tuple, kwargs: dict):
            if args:
                u = args[0]
            else:
                key = next(iter(kwargs))
                u = kwargs[key]
            replaced = False
            if index == 0:
                u = u.detach().requires_grad_(True)
                replaced = True
            while len(rec.blocks) <= index:
                rec.blocks.append(BlockRecord())
            rec.blocks[index].u = u
            if not replaced:
                return None
            if args:
                return (u, *args[1:]), kwargs
            kwargs = dict(kwargs)
            kwargs[key] = u
            return args, kwargs

        return hook

    @staticmethod
    def _record_h_hook(rec: Recording, index: int) -> Callable:
        def hook(module: nn.Module, args: tuple):
            rec.blocks[index].h = args[0]

        return hook


def _logits_of(out: Any) -> Tensor:
    """Extract logits from a model output (tensor, tuple or HuggingFace output object)."""
    if isinstance(out, Tensor):
        return out
    logits = getattr(out, "logits", None)
    if isinstance(logits, Tensor):
        return logits
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], Tensor):
        return out[0]
    raise InputError(f"cannot find logits in the model output of type {type(out).__name__}")
