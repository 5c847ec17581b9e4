"""Registry of explanation methods by name."""

from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar, Mapping

from ..errors import InputError

if TYPE_CHECKING:
    from .base import Explainer

__all__ = ["Method", "register", "get_method", "methods", "method_classes", "requirements", "display_label",
           "display_parts", "is_baseline"]


class Method:
    """The root of the explanation-method classes: :class:`~vitlens.explainers.base.Explainer` derives from it. It
    lets the registry (a module the rest of vitlens may import without importing any method) tell a method instance
    from a method name."""

    name: ClassVar[str] = ""
    #: the name people write in papers (``"Grad-CAM"``); figures, reports and tables show it, files and JSON keep
    #: ``name``. Empty: ``name`` is shown.
    display_name: ClassVar[str] = ""
    #: option name → the symbol a paper uses for it in a display label (AHA: ``{"refine_steps": "T"}``).
    option_symbols: ClassVar[dict[str, str]] = {}
    #: a reference point rather than a method (the random map): never marked best, e.g. for its cost.
    baseline: ClassVar[bool] = False


_METHODS: dict[str, type["Explainer"]] = {}


def register(cls: type["Explainer"]) -> type["Explainer"]:
    """Class decorator: register an :class:`~vitlens.explainers.base.Explainer` subclass under its ``name``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    _METHODS[cls.name] = cls
    return cls


def get_method(name: str | "Explainer", **options: Any) -> "Explainer":
    """Instantiate the method ``name`` with ``options`` (an Explainer instance is returned as is)."""
    if isinstance(name, Method):
        if options:
            raise InputError("options cannot be passed together with an Explainer instance")
        return name
    try:
        cls = _METHODS[name]
    except KeyError:
        raise InputError(f"unknown method {name!r}; available: {', '.join(methods())}") from None
    return cls(**options)


def methods() -> list[str]:
    """Names of the registered methods, sorted."""
    return sorted(_METHODS)


def method_classes() -> Mapping[str, type["Explainer"]]:
    """Method name → its registered :class:`~vitlens.explainers.base.Explainer` class (a read-only live view;
    register new methods with :func:`register`)."""
    return MappingProxyType(_METHODS)


def requirements() -> dict[str, str | None]:
    """Method name → the adapter capability it requires (``None``: model-agnostic), for every registered method."""
    # every method file is registered once vitlens is imported (its package imports them all)
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


def is_baseline(label: str) -> bool:
    """Whether a method label (``'random[seed=1]'``) names a baseline (:attr:`Method.baseline`)."""
    cls = _METHODS.get(str(label).partition("[")[0])
    return bool(cls is not None and cls.baseline)
