"""The hooks on the linear maps of each pre-norm block, shared by the LRP methods (:mod:`.transformer_attribution`,
:mod:`.attnlrp`): query/key/value projection(s), output projection, MLP in, MLP out — as the adapter declares them
(:meth:`vitlens.models.Adapter.lrp_linears`) — and the classifier head(s) after the last block. Package-internal.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import Tensor, nn

from ..errors import UnsupportedModelError
from ..models import Adapter
from ..models.base import Recording
from ._lrp_variants import normed

__all__ = ["BlockLinears", "LinearTaps", "Rerouted"]

#: query rows on which the q/k/v identification recomputes the attention output
_CHECK_ROWS = 8


class Rerouted(torch.autograd.Function):
    """Value of ``value`` (no gradient), gradient ``factor · g`` to ``t`` (``factor``: a number or a tensor that
    broadcasts against ``t``; ``None``: ``g`` itself). One autograd node instead of the detach arithmetic
    ``d + factor·(t − d)``, which costs three elementwise passes in the forward and three nodes in the backward;
    the value is the same (``t − d`` is exactly zero) and so is the gradient."""

    @staticmethod
    def forward(ctx: Any, value: Tensor, t: Tensor, factor: Any) -> Tensor:
        ctx.factor = factor
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[None, Tensor, None]:
        return None, g if ctx.factor is None else g * ctx.factor, None


@functools.lru_cache(maxsize=64)
def _check_rows(t: int, device: torch.device) -> Tensor:
    """The query rows (up to :data:`_CHECK_ROWS`, spread over the ``t`` tokens) the q/k/v identification checks."""
    return torch.linspace(0, t - 1, steps=min(t, _CHECK_ROWS), device=device).round().long().unique()


def _same_values(p: Tensor, value: Tensor) -> bool:
    """Whether the projected tensor ``p`` holds the adapter's captured values: the same view of the same memory
    (no comparison needed), else equal element by element."""
    if p.shape != value.shape:
        return False
    if (p.device == value.device and p.dtype == value.dtype and p.data_ptr() == value.data_ptr()
            and p.stride() == value.stride()):
        return True
    return torch.equal(p.detach(), value)


# -- the hooks that find a block's linear maps ------------------------------------------------------------------
@dataclass
class BlockLinears:
    """The linear maps of one pre-norm block (as its adapter declares them) and what they saw in the forward pass.

    ``q``, ``k``, ``v`` are ``(B, heads, T, d_head)`` and stay in the autograd graph; ``qkv_weights`` holds the rows
    of the projection weight(s) that produce ``q``, ``k`` and ``v`` (in that order).
    """

    stage: str = "start"
    n1: Tensor | None = None  # input of the query/key/value projection(s) (the LN₁ output)
    group: list[nn.Linear] = field(default_factory=list)
    group_out: list[Tensor] = field(default_factory=list)
    q: Tensor | None = None
    k: Tensor | None = None
    v: Tensor | None = None
    qkv_weights: tuple[Tensor, Tensor, Tensor] | None = None
    proj: nn.Linear | None = None
    ctx: Tensor | None = None  # input of the output projection, (B, T, heads·d_head)
    fc1: nn.Linear | None = None
    fc1_in: Tensor | None = None
    fc1_out: Tensor | None = None
    fc2: nn.Linear | None = None
    fc2_in: Tensor | None = None
    fc1_in_raw: Tensor | None = None  # the MLP input as passed (a gated MLP's two input maps read the same tensor)
    order: tuple[int, int, int] = (0, 1, 2)  # which projected tensor is query, key, value (in projection order)


class LinearTaps:
    """Hooks that record the ``nn.Linear`` calls of every block of a pre-norm ViT and of the head(s) after it.

    The roles of a block's linear maps are the adapter's declaration (:meth:`~vitlens.models.Adapter.lrp_linears`):
    the query/key/value projection(s) (one fused ``qkv`` or three separate ones, all fed the same tensor), the output
    projection, the MLP's first and second maps, called in that order. Which projection output is query, key and
    value is checked numerically: value is the tensor the adapter captured as the values, and query/key are the
    assignment for which ``softmax(q·kᵀ/√d)·v`` reproduces the output projection's input. Anything else (gates, q/k
    norms, a linear map the adapter does not declare, another call order) raises :class:`UnsupportedModelError`.

    ``rewrite_ctx(block_linears, ctx) -> ctx'`` and ``rewrite_act(fc1_out, fc2_in) -> fc2_in'`` may replace the
    inputs of the output projection and of the second MLP map (used by :mod:`.attnlrp` to impose LRP rules on the
    backward pass). ``keep=False`` (for methods that need nothing of a block after its rewrites, as :mod:`.attnlrp`)
    drops a block's recorded tensors as soon as its rewrites are done, so they are not all held to the end of the
    forward pass (``q``, ``k``, ``v`` are then cleared too; the rewrites' autograd graph keeps what it needs).
    ``qkv_grad=(f_q, f_k, f_v)`` multiplies the gradient of the projected queries, keys and values by these factors
    (the model's own attention then carries a rule's gradient, see :mod:`.attnlrp`); the projections are taken in
    the declared order query, key, value, which the numerical check must confirm (else
    :class:`UnsupportedModelError`).
    Linear calls outside the blocks that happen after the last block are the classifier head(s): ``heads`` holds
    ``(module, input, output)`` for each, detached.
    """

    def __init__(self, adapter: Adapter, rec: Recording,
                 rewrite_ctx: Callable[["BlockLinears", Tensor], Tensor] | None = None,
                 rewrite_act: Callable[[Tensor, Tensor], Tensor] | None = None, keep: bool = True,
                 qkv_grad: tuple[float, float, float] | None = None, variants: Any = None) -> None:
        self.adapter = adapter
        #: the rules for the declared variants of the plain block (q/k norms, scale norms, gated MLPs): an object
        #: with ``install(index, lrp_linears, handles)`` (:class:`._lrp_variants.VariantRules`); ``None``: a block
        #: that is not plain is refused
        self.variants = variants
        self._declared_maps: list[Any] = []
        self.keep = keep
        self.qkv_grad = qkv_grad
        self.rec = rec
        self.rewrite_ctx = rewrite_ctx
        self.rewrite_act = rewrite_act
        self.blocks: list[BlockLinears] = []
        self.heads: list[tuple[nn.Linear, Tensor, Tensor]] = []
        self._after_blocks = False
        self._roles: dict[int, str] = {}  # id(linear) → "qkv" | "proj" | "fc1" | "fc2"
        self._qkv_width: list[int] = []
        self._qkv_start: dict[int, int] = {}

    @contextlib.contextmanager
    def installed(self) -> Iterator["LinearTaps"]:
        """Register the hooks for the duration of the context (removed on exit, also after an exception)."""
        handles: list[Any] = []
        try:
            blocks = list(self.adapter.blocks())
            declared = self.adapter.lrp_linears()
            self._declared_maps = list(declared)
            for i, maps in enumerate(declared):
                if not getattr(maps, "plain", True):
                    if self.variants is None:
                        raise UnsupportedModelError(
                            f"block {i} is not the plain ViT block (q/k norms, scale norms or a gated MLP); this "
                            "method's LRP rules are written for the plain block")
                    self.variants.install(i, maps, handles)
            # width of one of q, k, v per block (heads · d_head): a third of the declared projections' outputs
            self._qkv_width = [sum(m.out_features for m in maps.qkv) // 3 for maps in declared]
            # where each projection's output starts among (query, key, value) in the declared order (a model may
            # call them in another order, e.g. key, value, query)
            self._qkv_start = {}
            for maps, width in zip(declared, self._qkv_width):
                start = 0
                for m in maps.qkv:
                    self._qkv_start[id(m)] = start
                    start += m.out_features // max(width, 1)
            self._roles = {id(m): role for maps in declared for role, ms in
                           (("qkv", maps.qkv), ("proj", (maps.proj,)),
                            ("fc1", (maps.fc1,) + ((maps.gate,) if getattr(maps, "gate", None) is not None else ())),
                            ("fc2", (maps.fc2,)))
                           for m in ms}
            inside: set[int] = set()
            self.blocks = [BlockLinears() for _ in blocks]
            for i, blk in enumerate(blocks):
                for mod in blk.modules():
                    inside.add(id(mod))
                    if isinstance(mod, nn.Linear):
                        handles.append(mod.register_forward_pre_hook(self._pre_hook(i)))
                        handles.append(mod.register_forward_hook(self._post_hook(i)))
            for mod in self.adapter.model.modules():
                if isinstance(mod, nn.Linear) and id(mod) not in inside:
                    handles.append(mod.register_forward_hook(self._head_hook))
            handles.append(blocks[0].register_forward_pre_hook(self._reset))
            handles.append(blocks[-1].register_forward_hook(self._last_block_done))
            yield self
        finally:
            for h in handles:
                h.remove()

    # -- hooks ---------------------------------------------------------------------------------------------------
    def _reset(self, module: nn.Module, args: tuple) -> None:
        self._after_blocks = False
        self.heads = []
        self.blocks = [BlockLinears() for _ in self.blocks]

    def _last_block_done(self, module: nn.Module, args: tuple, output: Any) -> None:
        self._after_blocks = True

    def _head_hook(self, module: nn.Linear, args: tuple, output: Tensor) -> None:
        if self._after_blocks:
            self.heads.append((module, args[0].detach(), output.detach()))

    def _pre_hook(self, index: int) -> Callable:
        before = {"qkv": ("start", "qkv"), "proj": ("qkv",), "fc1": ("proj",), "fc2": ("fc1",)}  # roles in call order

        def hook(module: nn.Linear, args: tuple):
            st = self.blocks[index]
            x = args[0]
            role = self._roles.get(id(module))
            if role is None:
                raise UnsupportedModelError(
                    f"block {index} calls a linear map ({type(module).__name__} {module.in_features}→"
                    f"{module.out_features}) that is not one of the q/k/v, output-projection and MLP maps its adapter "
                    "declares; vitlens cannot apply LRP rules to it")
            variant = self.variant(index)
            again = role == "fc1" and variant is not None and variant.gate is not None and st.stage == "fc1"
            if (st.stage not in before[role] and not again) or (role == "qkv" and st.stage == "qkv" and x is not st.n1) \
                    or (again and x is not st.fc1_in_raw):
                raise UnsupportedModelError(
                    f"block {index}: its linear maps are not called as in a pre-norm ViT block (q/k/v on one input, "
                    "then the output projection, then the two MLP maps); vitlens cannot apply LRP rules to it")
            if role == "qkv":
                st.stage, st.n1 = "qkv", x
                st.group.append(module)
                return None
            if role == "proj":
                st.stage, st.proj, st.ctx = "proj", module, x.detach()
                self._resolve_qkv(index, st)
                self._check_order(index, st)
                new = None if self.rewrite_ctx is None else self.rewrite_ctx(st, x)
                if not self.keep:
                    st.n1, st.group_out, st.ctx, st.q, st.k, st.v = None, [], None, None, None, None
                return None if new is None else (new, *args[1:])
            if role == "fc1":
                st.stage, st.fc1, st.fc1_in, st.fc1_in_raw = "fc1", module, x.detach(), x
                return None
            st.stage, st.fc2, st.fc2_in, st.fc1_in_raw = "fc2", module, x.detach(), None
            if variant is not None:  # the variant rules (installed on its activation and product) did the rewrite
                if not self.keep:
                    st.fc1_in, st.fc1_out, st.fc2_in = None, None, None
                return None
            if st.fc1_out is None or st.fc1_out.shape != x.shape:
                raise UnsupportedModelError(
                    f"block {index}: the second MLP map's input is not an elementwise function of the first's "
                    "output (gated MLPs are not supported); vitlens supports pre-norm blocks with a two-layer MLP")
            new = None if self.rewrite_act is None else self.rewrite_act(st.fc1_out, x)
            if not self.keep:
                st.fc1_in, st.fc1_out, st.fc2_in = None, None, None
            return None if new is None else (new, *args[1:])

        return hook

    def _post_hook(self, index: int) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Tensor) -> Tensor | None:
            st = self.blocks[index]
            if st.stage == "qkv":
                st.group_out.append(output)
                if self.qkv_grad is not None:
                    return self._scaled_projection(index, st, output)
            elif st.stage == "fc1" and module is st.fc1:
                st.fc1_out = output
            return None

        return hook

    def _resolve_qkv(self, index: int, st: BlockLinears) -> None:
        value = self.rec.blocks[index].value if index < len(self.rec.blocks) else None
        if value is None:
            raise UnsupportedModelError(f"block {index}: the adapter captured no value vectors")
        b, heads, t, dh = value.shape
        width = heads * dh
        parts: list[tuple[Tensor, Tensor]] = []  # (tensor (B, H, T, dh), weight rows (width, D))
        for mod, out in zip(st.group, st.group_out):
            if out.shape[-1] % width:
                raise UnsupportedModelError(
                    f"block {index}: a projection with {out.shape[-1]} outputs does not fit {heads} heads of {dh}")
            m = out.shape[-1] // width
            split = out.reshape(b, t, m, heads, dh)
            for j in range(m):
                parts.append((split[:, :, j].transpose(1, 2), mod.weight[j * width:(j + 1) * width]))
        if len(parts) != 3:
            raise UnsupportedModelError(
                f"block {index}: expected query, key and value projections, found {len(parts)} projected tensors")
        vi = [i for i, (p, _) in enumerate(parts) if _same_values(p, value)]
        if len(vi) != 1:
            raise UnsupportedModelError(f"block {index}: cannot tell which projection gives the values")
        rest = [i for i in range(3) if i != vi[0]]
        ctx = st.ctx
        assert ctx is not None  # the output-projection hook sets it before calling this
        scale = dh ** -0.5
        v = parts[vi[0]][0]
        # checked on the first image (a variant — q/k norms, gates, biases — changes every image alike; the check
        # is then a quarter of the work at batch 4, with no copy of the batch's keys and values)
        ctx0, v0 = ctx[:1], v[:1]
        # tolerances at least the model's rounding: a half-precision fused kernel rounds differently from this check
        # (which runs in float32)
        top, eps = float(ctx0.abs().max()), float(torch.finfo(ctx.dtype).eps)
        exact = max(1e-5, eps) * top + 1e-7
        loose = max(1e-3, 4 * eps) * top + 1e-6
        # checked on a few query rows spread over the sequence (every key and value): enough to tell query from key
        # and to catch variants that change every row (q/k norms, gates, biases), at a fraction of a full attention
        rows = _check_rows(t, ctx.device)
        tried: list[tuple[float, tuple[int, int]]] = []
        variant = self.variant(index)
        norms = (None, None, None) if variant is None else (variant.q_norm, variant.k_norm, variant.ctx_norm)
        with torch.no_grad():
            for qi, ki in (rest, rest[::-1]):  # call order first; the swap only if that is not exact
                wide = torch.promote_types(ctx.dtype, torch.float32)
                q, k = parts[qi][0][:1, :, rows], parts[ki][0][:1]
                q, k = normed(norms[0], q).to(wide), normed(norms[1], k).to(wide)
                attn = ((q * scale) @ k.transpose(-2, -1)).softmax(dim=-1)
                got = normed(norms[2], (attn @ v0.to(wide)).transpose(1, 2).reshape(1, len(rows), width).to(ctx.dtype))
                got = got.to(wide)
                err = float((got - ctx0[:, rows].to(wide)).abs().max())
                tried.append((err, (qi, ki)))
                if err <= exact:
                    break
        err, (qi, ki) = min(tried, key=lambda e: e[0])
        if err > loose:
            raise UnsupportedModelError(
                f"block {index}: softmax(q·kᵀ/√d)·v does not reproduce the attention output (max error "
                f"{err:.2e}); attention variants (q/k norms, gates, biases) are not supported")
        st.q, st.k, st.v = parts[qi][0], parts[ki][0], v
        st.order = (qi, ki, vi[0])
        st.qkv_weights = (parts[qi][1], parts[ki][1], parts[vi[0]][1])

    def variant(self, index: int) -> Any:
        """Block ``index``'s declared maps (:class:`~vitlens.models.base.LRPLinears`) if it is a variant of the plain
        block (its rules are then installed), else ``None``."""
        maps = self._declared_maps[index] if index < len(self._declared_maps) else None
        return None if maps is None or getattr(maps, "plain", True) or self.variants is None else maps

    def _declared(self, index: int, st: BlockLinears) -> list[int]:
        """For each projected tensor in call order (as :meth:`_resolve_qkv` lists them), its place among (query,
        key, value) in the adapter's declared order."""
        width = self._qkv_width[index] if index < len(self._qkv_width) else 0
        return [self._qkv_start.get(id(m), 0) + j for m, o in zip(st.group, st.group_out)
                for j in range(o.shape[-1] // width if width > 0 else 0)]

    def _scaled_projection(self, index: int, st: BlockLinears, out: Tensor) -> Tensor | None:
        """``out`` (one query/key/value projection's output) with the gradient of each of its parts scaled by
        ``qkv_grad`` (parts in the declared order query, key, value; ``None``: left to the check)."""
        width = self._qkv_width[index] if index < len(self._qkv_width) else 0
        if self.qkv_grad is None or width <= 0 or out.shape[-1] % width:
            return None  # _resolve_qkv refuses the block with a clear message
        first = self._qkv_start.get(id(st.group[-1]), 0)
        factors = [self.qkv_grad[j] if j < 3 else 1.0 for j in range(first, first + out.shape[-1] // width)]
        factor: Any = factors[0] if len(factors) == 1 else out.new_tensor(factors).repeat_interleave(width)
        return Rerouted.apply(out.detach(), out, factor)

    def _check_order(self, index: int, st: BlockLinears) -> None:
        if self.qkv_grad is None:
            return
        declared = self._declared(index, st)
        qi, ki, vi = (declared[i] if i < len(declared) else -1 for i in st.order)
        fq, fk, _ = self.qkv_grad
        if vi != 2 or ((qi, ki) != (0, 1) and fq != fk):
            raise UnsupportedModelError(
                f"block {index}: the projections are not query, key, value in the declared order (found "
                f"{st.order}); vitlens cannot scale their gradients for the LRP rule")

