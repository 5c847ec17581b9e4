"""The one device check: a device string or object must exist on this machine before anything is loaded or
written (a leaf module, so that model loading and the option layer share it without an import cycle)."""

from __future__ import annotations

from typing import Any

from .errors import InputError

__all__ = ["check_device"]


def check_device(device: Any) -> Any:
    """A device string/object that exists on this machine: ``cpu``, ``cuda``/``cuda:N`` with a GPU, ``mps``."""
    import torch

    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise InputError(f"unknown device {device!r}; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise InputError(f"device {device!r} asked for, but no CUDA GPU is available here; use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise InputError(f"device {device!r} does not exist: this machine has {torch.cuda.device_count()} GPU(s)")
    elif dev.type == "mps":
        if not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
            raise InputError(f"device {device!r} is not available here; use --device cpu")
    elif dev.type != "cpu":
        raise InputError(f"device {device!r} is not supported; use cpu, cuda or cuda:N")
    elif dev.index not in (None, 0):
        raise InputError(f"device {device!r} does not exist: the CPU is one device ('cpu'); torch runs it on every core")
    return device


def option_device(name: str) -> Any:
    """A command's ``--device`` value as a ``torch.device``: ``auto`` is CUDA when there is a GPU, else the CPU; any
    other name must exist here (:func:`check_device`); a bad one is an :class:`InputError` naming the option."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(check_device(name))
    except InputError as e:
        raise InputError(f"--device: {e}") from None

