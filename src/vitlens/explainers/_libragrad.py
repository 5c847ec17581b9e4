"""LibraGrad's backward rules (CVPR 2025, "LibraGrad: Balancing Gradient Flow for Universally Better Vision
Transformer Attributions"), and the driver that runs a gradient method under them. Package-internal; the methods are
:mod:`.libragrad_inputxgradient`, :mod:`.libragrad_ig` and :mod:`.libragrad_gradcam`.

The rules change the backward pass only (every forward value is the model's own), as the authors' code does for its
``LibraGrad`` preset (gradient brand ``LX1``, gated products ``DU``):

- **attention**: queries and keys pass no gradient, so the attention probabilities are constants of the backward
  pass and the gradient reaches the tokens through the values only (installed on the declared query/key/value
  projections: a separate query or key map's output is detached, a fused ``qkv`` output passes gradient to its
  value third only);
- **LayerNorm / RMSNorm**: the standard deviation (RMS) is a constant of the backward pass; the centering stays
  (the adapter's conservative normalisation, :func:`vitlens.models.base.conservative_layernorm_hook`);
- **activations** ``act(p) = p·gate(p)`` (GELU, SiLU, ReLU, QuickGELU): the gate is a constant, i.e. the gradient to
  ``p`` is ``act(p)/p`` (the identity rule of :func:`._gradient_input_lrp.identity_rule`);
- **gated MLPs** ``fc2(act(g) ⊙ x)`` (SwiGLU): the product passes half of its gradient·input to each factor
  (``DU``), with the identity rule on ``act``.

With these rules every operation of a pre-norm ViT is linear in the backward sense, so a gradient method becomes
FullGrad-complete: ``y = Σ input ⊙ ∂̃y/∂input + Σ_bias b ⊙ ∂̃y/∂b`` for the target logit (tested in
``tests/test_libragrad.py``). All hooks are removed on exit, also after an exception; nothing is patched globally.
Equations, what differs from the authors' code and the cross-check: ``docs/methods/libragrad.md``.
"""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar, Iterator

import torch
from torch import Tensor, nn

from ..models import Adapter
from ..models.base import conservative_layernorm_hook
from ..models.capabilities import LRP_LINEARS, LRP_VARIANT_LINEARS
from ..targets import Target
from ._gradient_input_lrp import identity_rule
from ._lrp import Rerouted
from ._lrp_variants import VariantRules
from .base import Attribution, Explainer
from .registry import method_classes

__all__ = ["libra_rules", "LibraGradMethod", "GATE_SHARE", "LIBRA_NEEDS"]

#: what the rules need of an adapter: the declared query/key/value projections and MLP maps of every block
LIBRA_NEEDS = (LRP_LINEARS, LRP_VARIANT_LINEARS)

#: the share of a gated product's gradient·input that goes to the gate (``DU``: half to each factor)
GATE_SHARE = 0.5


def _value_only(width: int, out: Tensor) -> Tensor:
    """A fused ``qkv`` output ``(…, 3·width)`` whose query and key thirds pass no gradient."""
    mask = torch.zeros(out.shape[-1], dtype=out.dtype, device=out.device)
    mask[2 * width:] = 1.0
    return Rerouted.apply(out.detach(), out, mask)


@contextlib.contextmanager
def libra_rules(adapter: Adapter) -> Iterator[None]:
    """Install LibraGrad's backward rules on ``adapter``'s model for the duration of the context (see the module
    docstring). Forward values are unchanged; hooks are removed on exit, also after an exception."""
    handles: list[Any] = []
    try:
        for ln in adapter.layernorms():
            handles.append(ln.register_forward_hook(conservative_layernorm_hook))
        variants = VariantRules(GATE_SHARE, identity_rule)
        for i, lin in enumerate(adapter.lrp_linears()):
            if len(lin.qkv) == 1:
                width = lin.qkv[0].out_features // 3
                handles.append(lin.qkv[0].register_forward_hook(
                    lambda m, a, out, w=width: _value_only(w, out)))
            else:  # declared in the order query, key(, value): the first two pass no gradient
                for m in lin.qkv[:2]:
                    handles.append(m.register_forward_hook(lambda m, a, out: out.detach()))
            for norm in (lin.q_norm, lin.k_norm):  # queries/keys normed before the softmax: detached after the norm
                if norm is not None:
                    handles.append(norm.register_forward_hook(lambda m, a, out: out.detach()))
            if not lin.plain:
                variants.install(i, lin, handles)
                continue
            _identity_at_mlp(lin.fc1, lin.fc2, handles)
        yield
    finally:
        for h in handles:
            h.remove()


def _identity_at_mlp(fc1: nn.Module, fc2: nn.Module, handles: list) -> None:
    """The identity rule on a plain MLP's activation: ``fc2``'s input ``z = act(p)`` keeps its value and passes
    ``(z/p)·grad`` to ``p = fc1(…)``."""
    seen: dict[str, Tensor] = {}

    def after_fc1(module: nn.Module, args: tuple, out: Tensor) -> None:
        seen["p"] = out

    def before_fc2(module: nn.Module, args: tuple) -> tuple | None:
        p = seen.pop("p", None)
        z = args[0]
        if p is None or p.shape != z.shape:
            return None  # not act(fc1(·)) as declared: the plain gradient (the completeness test would show it)
        return (identity_rule(p, z), *args[1:])

    handles.append(fc1.register_forward_hook(after_fc1))
    handles.append(fc2.register_forward_pre_hook(before_fc2))


class LibraGradMethod(Explainer):
    """A gradient method (``base_method``, a registered name) run with LibraGrad's backward rules.

    Subclasses set ``name``, ``base_method``, ``level`` and ``defaults`` equal to the base method's (a test holds them
    equal) and ``needs``: the base method's and :data:`LIBRA_NEEDS` (the declared linear maps the rules hook); options
    are validated by the base method, the cost is the base method's. The readout fast path is not used
    (it computes the last block's projections its own way, outside the hooks that carry the rules).
    """

    base_method: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """The base method's declared option ranges (``option_specs``) are this method's: the package imports its
        method modules in name order, so the base (``gradcam``, ``inputxgradient``, ``integrated_gradients``) is
        registered before a ``libragrad_*`` module runs; otherwise its module is imported here by name."""
        super().__init_subclass__(**kwargs)
        base = method_classes().get(cls.base_method)
        if base is None and cls.base_method:
            import importlib

            importlib.import_module(f"{__package__}.{cls.base_method}")
            base = method_classes().get(cls.base_method)
        if base is not None:
            cls.option_specs = dict(getattr(base, "option_specs", {}))

    def _base(self) -> Explainer:
        cls = method_classes()[self.base_method]
        return cls(**self.options)  # type: ignore[return-value]

    def check_options(self) -> None:
        self._base()  # the base method's own checks

    def declared_cost(self) -> dict[str, float]:
        return self._base().declared_cost()

    def attribute(self, adapter: Adapter, x: Tensor, target: Target) -> tuple[Attribution, Tensor, Target]:
        with libra_rules(adapter):
            return self._base().attribute(adapter, x, target)
