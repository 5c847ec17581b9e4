"""Errors raised by vitlens.

Every error a user can trigger with bad input is a :class:`VitlensError` subclass with a one-line message that names
the problem (and, where possible, what to do about it). Callers can catch ``VitlensError`` to handle all of them.
"""

from __future__ import annotations

__all__ = [
    "VitlensError",
    "InputError",
    "TargetError",
    "UnsupportedModelError",
    "WeightsUnavailableError",
    "ImageLoadError",
    "DamagedFileError",
]


class VitlensError(Exception):
    """Base class of every error vitlens raises on purpose."""


class InputError(VitlensError, ValueError):
    """The input batch is malformed: wrong rank, channel count, dtype, non-finite values, empty batch."""


class TargetError(VitlensError, ValueError):
    """The explanation target is invalid (class index out of range, wrong batch size, unknown target kind)."""


class UnsupportedModelError(VitlensError, TypeError):
    """The model is not of a family any adapter supports."""


class WeightsUnavailableError(VitlensError, RuntimeError):
    """Requested weights cannot be found locally (and the network is not used)."""


class ImageLoadError(VitlensError, ValueError):
    """An image file or object cannot be read as an image."""


class DamagedFileError(VitlensError, RuntimeError):
    """A file vitlens wrote earlier (result store, shard, run configuration, checkpoint) cannot be read back; the
    message names the file and what to do."""
