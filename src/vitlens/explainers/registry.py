"""Registry of explanation methods by name."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, ClassVar, Mapping

from ..errors import InputError

__all__ = ["Method", "register", "unregister", "get_method", "methods", "method_classes", "requirements",
           "display_label", "display_parts", "is_baseline", "VALUE_KINDS", "value_kind"]

#: What a method's map values mean (:attr:`Method.value_kind`), which fixes how every figure draws them:
#: ``"signed"`` — relevance for (> 0) and against (< 0) the class, 0 = none: a diverging scale centred at 0;
#: ``"nonnegative"`` — importance >= 0 (a ReLU'd CAM, a gradient's magnitude, attention): a sequential scale from 0;
#: ``"probability"`` — an expected class probability (RISE's mean score over masks): sequential, lowest to highest;
#: ``"score"`` — a score whose 0 means nothing (a mean logit, a learned ranking score): sequential, lowest to highest.
VALUE_KINDS: tuple[str, ...] = ("signed", "nonnegative", "probability", "score")


class Method:
    """The root of the explanation-method classes: :class:`~vitlens.explainers.base.Explainer` derives from it. It
    lets the registry (a module the rest of vitlens may import without importing any method, and which imports no
    method module itself, not even for type checking) tell a method instance from a method name, and holds what
    every method declares about itself:

    - ``name``: the registered name;
    - ``needs``: the adapter capabilities (:mod:`vitlens.models.capabilities`) the method needs with its default
      options; an entry that is a tuple needs any one of its names. ``()``: model-agnostic;
    - ``description``: one plain line (``vitlens methods`` and the catalogue print it).
    """

    name: ClassVar[str] = ""
    needs: ClassVar[tuple[str | tuple[str, ...], ...]] = ()
    description: ClassVar[str] = ""
    #: ``"token"`` or ``"pixel"``: what the map is made of (pixel maps are drawn in the blend style by default)
    level: ClassVar[str] = "token"
    #: option name → default value (``Explainer`` validates options against it)
    defaults: dict[str, Any] = {}

    def explain(self, model: Any, x: Any, target: Any = None, batch_size: int | None = None) -> Any:
        """Explain a batch (``Explainer.explain``: the typed driver, returning an ``Explanation``)."""
        raise NotImplementedError

    def declared_cost(self) -> dict[str, float]:
        """Cost per image with the current options, in passes of the target model (``Explainer.declared_cost``)."""
        raise NotImplementedError

    def required(self) -> tuple[str | tuple[str, ...], ...]:
        """What this instance needs with its options (default: :attr:`needs`); a method whose needs depend on an
        option (e.g. a softmax score needs class logits) overrides it."""
        return self.needs
    #: the name people write in papers (``"Grad-CAM"``); figures, reports and tables show it, files and JSON keep
    #: ``name``. Empty: ``name`` is shown.
    display_name: ClassVar[str] = ""
    #: option name → the symbol a paper uses for it in a display label (AHA: ``{"refine_steps": "T"}``).
    option_symbols: ClassVar[dict[str, str]] = {}
    #: a reference point rather than a method (the random map): never marked best, e.g. for its cost.
    baseline: ClassVar[bool] = False
    #: what the map's values mean with the default options, one of :data:`VALUE_KINDS` (every registered method
    #: declares it; a test enforces it). Figures draw a method by it, the same way on every image.
    value_kind: ClassVar[str] = ""

    @classmethod
    def value_kind_for(cls, options: Mapping[str, Any]) -> str:
        """:attr:`value_kind` with these options (a method whose meaning depends on an option overrides it:
        ``gradient`` with ``reduce='sum'`` is signed, RISE with ``score='target'`` is a mean logit)."""
        return cls.value_kind


_METHODS: dict[str, type[Method]] = {}


def register(cls: type[Method]) -> type[Method]:
    """Class decorator: register an :class:`~vitlens.explainers.base.Explainer` subclass under its ``name``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    _METHODS[cls.name] = cls
    return cls


def unregister(name: str) -> None:
    """Remove the method registered as ``name`` (a plugin's or a test's method; unknown names are ignored)."""
    _METHODS.pop(name, None)


def get_method(name: "str | Method", **options: Any) -> Method:
    """Instantiate the method ``name`` with ``options`` (an Explainer instance is returned as is)."""
    if isinstance(name, Method):
        if options:
            raise InputError("options cannot be passed together with an Explainer instance")
        return name
    try:
        cls = _METHODS[name]
    except KeyError:
        import difflib

        close = difflib.get_close_matches(str(name).lower(), methods(), n=3, cutoff=0.6)
        hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        raise InputError(f"unknown method {name!r}; available: {', '.join(methods())}{hint}") from None
    return cls(**options)


def methods() -> list[str]:
    """Names of the registered methods, sorted."""
    return sorted(_METHODS)


def method_classes() -> Mapping[str, type[Method]]:
    """Method name → its registered :class:`~vitlens.explainers.base.Explainer` class (a read-only live view;
    register new methods with :func:`register`)."""
    return MappingProxyType(_METHODS)


def requirements() -> dict[str, tuple[str | tuple[str, ...], ...]]:
    """Method name → the capabilities it needs (``Method.needs``), for every registered method."""
    # every method file is registered once vitlens is imported (its package imports them all)
    return {name: cls.needs for name, cls in _METHODS.items()}
    return {name: cls.requires for name, cls in _METHODS.items()}
def display_parts(label: str) -> tuple[str, str]:
    """A method label (``'aha[refine_steps=0]'``, as :func:`vitlens.bench.specs.spec_label` writes it) → its display
    name and settings in words: ``('AHA', 'T = 0')``. Unknown methods keep their code name; labels that are not
    ``name[k=v,...]`` are returned whole with no settings."""
    name, sep, rest = str(label).partition("[")
    cls = _METHODS.get(name)
    shown = (cls.display_name or name) if cls is not None else name
    if not sep:
        return shown, ""
    if not rest.endswith("]"):
        return str(label), ""
    symbols = cls.option_symbols if cls is not None else {}
    pairs = []
    for part in rest[:-1].split(","):
        key, eq, value = part.partition("=")
        pairs.append(f"{symbols.get(key, key)} = {value}" if eq else part)
    return shown, ", ".join(pairs)
def display_label(label: str) -> str:
    """A method label as a paper writes it, on one line: ``'aha[refine_steps=0]'`` → ``'AHA (T = 0)'``,
    ``'gradcam'`` → ``'Grad-CAM'`` (see :func:`display_parts`)."""
    shown, settings = display_parts(label)
    return f"{shown} ({settings})" if settings else shown
def value_kind(label: str) -> str | None:
    """What the values of a method label's maps mean (:data:`VALUE_KINDS`): ``'rise'`` → ``'probability'``,
    ``'gradient[reduce=sum]'`` → ``'signed'``; ``None`` for a label of no registered method or one that declares
    nothing (figures then judge the map itself)."""
    name, sep, rest = str(label).partition("[")
    cls = _METHODS.get(name)
    if cls is None:
        return None
    options: dict[str, Any] = {}
    if sep and rest.endswith("]"):
        import ast

        for part in rest[:-1].split(","):
            key, eq, value = part.partition("=")
            if eq:
                try:
                    options[key.strip()] = ast.literal_eval(value.strip())
                except (ValueError, SyntaxError):
                    options[key.strip()] = value.strip()
    kind = cls.value_kind_for(options)
    return kind if kind in VALUE_KINDS else None
def is_baseline(label: str) -> bool:
    """Whether a method label (``'random[seed=1]'``) names a baseline (:attr:`Method.baseline`)."""
    cls = _METHODS.get(str(label).partition("[")[0])
    return bool(cls is not None and cls.baseline)
