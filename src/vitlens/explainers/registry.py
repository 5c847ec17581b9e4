"""Registry of explanation methods by name."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, ClassVar, Mapping

from ..errors import InputError

__all__ = ["Method", "register", "unregister", "get_method", "methods", "method_classes", "requirements"]


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
        raise InputError(f"unknown method {name!r}; available: {', '.join(methods())}") from None
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
