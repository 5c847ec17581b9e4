"""Which methods run on which model: computed from what each method needs (``Explainer.needs``, or
:meth:`~vitlens.explainers.base.Explainer.required` for its options) and what the model's adapter provides
(``Adapter.capabilities``). This is the one place that decides, and :func:`check` the one refusal path: the error
names the missing capability, why the adapter lacks it, and the methods that do work on the model.

Not a method file (it registers nothing); it sits above both the adapters (``models/``) and the registry.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..errors import UnsupportedModelError
from ..models import Adapter, get_adapter, refusal
from ..models.capabilities import DESCRIPTIONS
from .registry import Method, method_classes

__all__ = ["missing", "check", "working_methods", "why_not", "conformance", "way_out"]

Need = str | tuple[str, ...]


def _needs(method: str | Method | type[Method]) -> tuple[str, Method | type[Method]]:
    if isinstance(method, str):
        cls = method_classes().get(method)
        if cls is None:
            raise UnsupportedModelError(f"unknown method {method!r}")
        return method, cls
    return method.name, method


def missing(adapter: Adapter, method: str | Method | type[Method]) -> list[Need]:
    """The needs of ``method`` (a name, class or instance with its options) that ``adapter`` does not provide."""
    _, m = _needs(method)
    if isinstance(m, Method):
        needs = m.required()
    else:
        try:
            needs = m().required()  # with its default options
        except Exception:  # noqa: BLE001 - defaults that need external input: the class-level needs apply
            needs = m.needs
    out: list[Need] = []
    for need in needs:
        alternatives = need if isinstance(need, tuple) else (need,)
        if not any(adapter.provides(n) for n in alternatives):
            out.append(need)
    return out


def working_methods(model: nn.Module | Adapter) -> list[str]:
    """The registered methods that run on ``model`` with their default options, sorted."""
    adapter = get_adapter(model)
    return sorted(name for name in method_classes() if not missing(adapter, name))


def way_out(adapter: Adapter, method: str | Method | type[Method]) -> str | None:
    """An option setting under which ``method`` no longer lacks anything on ``adapter`` (``"score='target'"``: RISE
    scores the explained target itself and needs no class logits), or ``None``. Only the method's choice options are
    tried, one at a time, keeping its other options."""
    _, m = _needs(method)
    cls = type(m) if isinstance(m, Method) else m
    given = dict(getattr(m, "options", {})) if isinstance(m, Method) else {}
    for option, spec in getattr(cls, "option_specs", {}).items():
        values = getattr(spec, "values", ())
        if not isinstance(values, tuple) or not all(isinstance(v, str) for v in values):
            continue
        for value in values:
            if given.get(option, cls.defaults.get(option)) == value:
                continue
            try:
                candidate = cls(**{**given, option: value})
            except Exception:  # noqa: BLE001 - a value this combination does not accept is simply no way out
                continue
            if not missing(adapter, candidate):
                return f"{option}={value!r}"
    return None


def check(adapter: Adapter, method: str | Method | type[Method]) -> None:
    """Raise :class:`UnsupportedModelError` if ``method`` needs a capability ``adapter`` lacks: the first missing
    one, why, the option setting that would let it run (:func:`way_out`) and the methods that do work on the
    model."""
    name, _ = _needs(method)
    lacking = missing(adapter, method)
    if lacking:
        option = way_out(adapter, method)
        hint = f"; method {name!r} runs on it with {option}" if option else ""
        raise UnsupportedModelError(f"{refusal(adapter, lacking[0], f'method {name!r}')}{hint} "
                                    f"(families: 'vitlens models'); methods that work on this model: "
                                    f"{', '.join(working_methods(adapter))}")


def why_not(model: nn.Module | Adapter, method: str) -> str | None:
    """``None`` if ``method`` runs on ``model`` with its default options, else the refusal (without the list of
    methods that work), with the option setting under which it runs where one exists."""
    adapter = get_adapter(model)
    lacking = missing(adapter, method)
    if not lacking:
        return None
    option = way_out(adapter, method)
    return refusal(adapter, lacking[0], "it") + (f"; it runs with {option}" if option else "")


def conformance(model: nn.Module | Adapter) -> dict[str, Any]:
    """What ``model``'s adapter provides and lacks (with why), and which methods that enables: ``{"adapter",
    "family", "fallback_reason", "provides", "lacks": {capability: why}, "methods": [...], "refused": {method:
    refusal}}``. ``vitlens conformance`` prints it."""
    adapter = get_adapter(model)
    provides = sorted(c for c in DESCRIPTIONS if adapter.provides(c))
    lacks = {c: adapter.lacking(c) for c in DESCRIPTIONS if not adapter.provides(c)}
    refused = {n: str(why_not(adapter, n)) for n in sorted(method_classes()) if missing(adapter, n)}
    return {"adapter": type(adapter).__name__, "family": adapter.family, "fallback_reason": adapter.fallback_reason,
            "provides": provides, "lacks": lacks, "methods": working_methods(adapter), "refused": refused}
