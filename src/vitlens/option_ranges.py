"""Declared option ranges: what a method states about each of its options (re-exported by :mod:`vitlens.options`).

A method declares ``option_specs = {"eps": number(0, low_open=True), "grid_size": grid_cells(), ...}``, one spec per
option of its ``defaults``. ``Explainer.__init__`` checks every given value against its spec (one line naming the
method, the option, the value and the allowed range), and ``Explainer.explain`` checks the specs that depend on the
input (a grid of cells must fit the image) when the batch arrives. Each spec also lists values it must refuse and
boundary values it must accept, which ``tests/test_option_ranges.py`` feeds to every option of every method.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable, Iterable

from .errors import InputError

__all__ = ["OptionSpec", "integer", "number", "flag", "choice", "subset", "any_of", "seed", "grid_cells", "tensor",
           "custom", "check_option", "check_option_for_input", "brief", "is_real"]


def is_real(v: Any) -> bool:
    """A real number that is not a bool (``True`` is not a number of anything)."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def brief(value: Any, limit: int = 60) -> str:
    """``repr(value)`` on one short line (a tensor is named by its shape, long reprs are cut)."""
    import numpy as np
    import torch

    if isinstance(value, (torch.Tensor, np.ndarray)):
        return f"a {type(value).__name__} of shape {tuple(value.shape)}"
    text = " ".join(repr(value).split())
    return text if len(text) <= limit else text[:limit - 1] + "…"


class OptionSpec:
    """The declared type and range of one option: ``allowed`` says it in words (``"a finite number >= 0"``);
    ``none``: ``None`` is accepted too (a documented meaning, e.g. "the model's own grid")."""

    allowed = ""

    def __init__(self, *, none: bool = False) -> None:
        self.none = none

    def describe(self) -> str:
        """The allowed values in words, as an error message says them."""
        return f"None or {self.allowed}" if self.none else self.allowed

    def accepts(self, value: Any) -> bool:
        """Whether ``value`` is in the declared range (what does not depend on the input)."""
        if value is None:
            return self.none
        try:
            return bool(self._accepts(value))
        except Exception:  # a value whose comparisons fail (a tensor, an odd object) is not in the range
            return False

    def _accepts(self, value: Any) -> bool:
        raise NotImplementedError

    def normalize(self, value: Any) -> Any:
        """The accepted value as the method reads it (e.g. a list as a tuple); the value itself by default."""
        return value

    def input_problem(self, value: Any, shape: tuple[int, ...]) -> str | None:
        """Why ``value`` does not fit an input batch of ``shape`` ``(B, C, H, W)`` (``None``: it fits)."""
        return None

    def invalid(self) -> list[Any]:
        """Values out of the range or of the wrong type: each must be refused."""
        return [object(), b"\x00"] + ([] if self.none else [None]) + self._invalid()

    def _invalid(self) -> list[Any]:
        return []

    def valid(self) -> list[Any]:
        """Boundary values the range includes: each must be accepted."""
        return ([None] if self.none else []) + self._valid()

    def _valid(self) -> list[Any]:
        return []

    def invalid_for_input(self, shape: tuple[int, ...]) -> list[Any]:
        """Values accepted when the method is made but out of range for an input of ``shape``."""
        return []


def _either(parts: list[str]) -> str:
    """``a``, ``a or b``, ``a, b or c``."""
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " or " + parts[-1]


def _interval(low: Any, high: Any, low_open: bool, high_open: bool) -> str:
    if low is None and high is None:
        return ""
    if high is None:
        return f" {'>' if low_open else '>='} {low}"
    if low is None:
        return f" {'<' if high_open else '<='} {high}"
    return f" in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"


class _Integer(OptionSpec):
    def __init__(self, low: int | None, high: int | None, none: bool, unit: str) -> None:
        super().__init__(none=none)
        self.low, self.high = low, high
        self.allowed = "an integer" + _interval(low, high, False, False) + (f" ({unit})" if unit else "")

    def _accepts(self, v: Any) -> bool:
        if not isinstance(v, numbers.Integral) or isinstance(v, bool):
            return False
        n = int(v)
        return (self.low is None or n >= self.low) and (self.high is None or n <= self.high)

    def normalize(self, v: Any) -> Any:
        return v if v is None else int(v)

    def _invalid(self) -> list[Any]:
        out: list[Any] = [1.5, "1", True, float("nan")]
        if self.low is not None:
            out += [self.low - 1, self.low - 10 ** 6]
        if self.high is not None:
            out += [self.high + 1]
        return out

    def _valid(self) -> list[Any]:
        return [b for b in (self.low, self.high) if b is not None] or [0]


class _Number(OptionSpec):
    def __init__(self, low: float | None, high: float | None, low_open: bool, high_open: bool, none: bool) -> None:
        super().__init__(none=none)
        self.low, self.high, self.low_open, self.high_open = low, high, low_open, high_open
        self.allowed = "a finite number" + _interval(low, high, low_open, high_open)

    def _accepts(self, v: Any) -> bool:
        if not is_real(v) or not math.isfinite(float(v)):
            return False
        x = float(v)
        if self.low is not None and (x <= self.low if self.low_open else x < self.low):
            return False
        return self.high is None or (x < self.high if self.high_open else x <= self.high)

    def _invalid(self) -> list[Any]:
        out: list[Any] = [float("nan"), float("inf"), float("-inf"), "0.5", True, [0.5]]
        if self.low is not None:
            out += [self.low if self.low_open else self.low - 1e-3, self.low - 1e9]
        if self.high is not None:
            out += [self.high if self.high_open else self.high + 1e-3, self.high + 1e9]
        return out

    def _valid(self) -> list[Any]:
        out = [b for b, open_ in ((self.low, self.low_open), (self.high, self.high_open))
               if b is not None and not open_]
        if out:
            return out
        return [self.low + 1e-3] if self.low is not None else [0.0]


class _Flag(OptionSpec):
    allowed = "True or False"

    def _accepts(self, v: Any) -> bool:
        return isinstance(v, bool)

    def _invalid(self) -> list[Any]:
        return [1, 0, "True", "yes"]

    def _valid(self) -> list[Any]:
        return [True, False]


class _Choice(OptionSpec):
    def __init__(self, values: tuple[Any, ...], none: bool) -> None:
        super().__init__(none=none)
        self.values = values
        self.allowed = "one of " + ", ".join(repr(v) for v in values)

    def _accepts(self, v: Any) -> bool:
        return isinstance(v, str) and v in self.values

    def _invalid(self) -> list[Any]:
        return ["no-such-choice", 1, (self.values[0],), str(self.values[0]).upper() + "!"]

    def _valid(self) -> list[Any]:
        return list(self.values)


class _Subset(OptionSpec):
    def __init__(self, values: tuple[str, ...]) -> None:
        super().__init__()
        self.values = values
        self.allowed = "a non-empty list of " + ", ".join(repr(v) for v in values)

    def _accepts(self, v: Any) -> bool:
        return (isinstance(v, (tuple, list)) and len(v) > 0
                and all(isinstance(e, str) and e in self.values for e in v))

    def normalize(self, v: Any) -> Any:
        return tuple(v)

    def _invalid(self) -> list[Any]:
        return [self.values[0], (), ["no-such-choice"], [self.values[0], 1], 3]

    def _valid(self) -> list[Any]:
        return [tuple(self.values), [self.values[0]]]


class _AnyOf(OptionSpec):
    def __init__(self, specs: tuple[OptionSpec, ...]) -> None:
        super().__init__(none=any(s.none for s in specs))
        self.specs = specs
        self.allowed = _either([s.allowed for s in specs])

    def describe(self) -> str:
        return _either((["None"] if self.none else []) + [s.allowed for s in self.specs])

    def _accepts(self, v: Any) -> bool:
        return any(s.accepts(v) for s in self.specs)

    def _first(self, v: Any) -> OptionSpec | None:
        return next((s for s in self.specs if s.accepts(v)), None)

    def normalize(self, v: Any) -> Any:
        s = self._first(v)
        return v if s is None else s.normalize(v)

    def input_problem(self, v: Any, shape: tuple[int, ...]) -> str | None:
        s = self._first(v)
        return None if s is None else s.input_problem(v, shape)

    def _invalid(self) -> list[Any]:
        return [v for s in self.specs for v in s._invalid() if not self.accepts(v)]

    def _valid(self) -> list[Any]:
        return [v for s in self.specs for v in s._valid()]

    def invalid_for_input(self, shape: tuple[int, ...]) -> list[Any]:
        return [v for s in self.specs for v in s.invalid_for_input(shape)]


class _Custom(OptionSpec):
    def __init__(self, check: Callable[[Any], bool], allowed: str, invalid: Iterable[Any], valid: Iterable[Any],
                 normalize: Callable[[Any], Any] | None, none: bool) -> None:
        super().__init__(none=none)
        self.check, self.allowed = check, allowed
        self._bad, self._good, self._norm = list(invalid), list(valid), normalize

    def _accepts(self, v: Any) -> bool:
        return self.check(v)

    def normalize(self, v: Any) -> Any:
        return v if (self._norm is None or v is None) else self._norm(v)

    def _invalid(self) -> list[Any]:
        return list(self._bad)

    def _valid(self) -> list[Any]:
        return list(self._good)


class _GridCells(OptionSpec):
    """``s`` or ``(gy, gx)`` cells per side, each >= 1 and at most the input's side in pixels."""

    def __init__(self, pair: bool, none: bool) -> None:
        super().__init__(none=none)
        self.pair = pair
        self.allowed = ("an integer >= 1 or a pair (gy, gx) of them" if pair else "an integer >= 1") + \
            " (cells per side, at most the image's side in pixels)"

    def describe(self) -> str:
        return f"None, {self.allowed}" if self.none and self.pair else super().describe()

    @staticmethod
    def _int(v: Any) -> bool:
        return isinstance(v, numbers.Integral) and not isinstance(v, bool) and int(v) >= 1

    def _accepts(self, v: Any) -> bool:
        if self.pair and isinstance(v, (tuple, list)):
            return len(v) == 2 and all(self._int(e) for e in v)
        return self._int(v)

    def normalize(self, v: Any) -> Any:
        if v is None:
            return v
        return (int(v[0]), int(v[1])) if isinstance(v, (tuple, list)) else int(v)

    def input_problem(self, v: Any, shape: tuple[int, ...]) -> str | None:
        if v is None:
            return None
        gy, gx = (v[0], v[1]) if isinstance(v, (tuple, list)) else (v, v)
        h, w = int(shape[-2]), int(shape[-1])
        if gy > h or gx > w:
            return f"a {gy}x{gx} grid of cells does not fit a {h}x{w} image (at most {h}x{w}: one pixel per cell)"
        return None

    def _invalid(self) -> list[Any]:
        out: list[Any] = [0, -1, 1.5, "7", True]
        if self.pair:
            out += [(0, 0), (1, 0), (2, 2, 2), (2.0, 2), [2]]
        return out

    def _valid(self) -> list[Any]:
        return [1, 2] + ([(1, 2), [3, 1]] if self.pair else [])

    def invalid_for_input(self, shape: tuple[int, ...]) -> list[Any]:
        h, w = int(shape[-2]), int(shape[-1])
        return [max(h, w) + 1] + ([(h + 1, 1), (1, w + 1)] if self.pair else [])


class _Tensor(OptionSpec):
    """A torch tensor or numpy array of finite numbers, broadcastable to an input image ``(C, H, W)``."""

    allowed = "a tensor broadcastable to (C, H, W)"

    def _accepts(self, v: Any) -> bool:
        import numpy as np
        import torch

        if isinstance(v, np.ndarray):
            if v.dtype.kind not in "biuf":
                return False
            v = torch.from_numpy(np.asarray(v, dtype=np.float64))
        return (isinstance(v, torch.Tensor) and v.dim() <= 3 and v.device.type != "meta" and not v.is_complex()
                and bool(torch.isfinite(v.double()).all()))

    def input_problem(self, v: Any, shape: tuple[int, ...]) -> str | None:
        import numpy as np

        dims = tuple(int(d) for d in shape[1:])
        have = tuple(v.shape)
        try:
            np.broadcast_shapes(have, dims)
            if len(have) > len(dims):
                raise ValueError
        except ValueError:
            return f"a tensor of shape {have} does not broadcast to the input's (C, H, W) = {dims}"
        return None

    def _invalid(self) -> list[Any]:
        import numpy as np
        import torch

        return [5, 0.0, [0.0, 0.0, 0.0], "white", torch.tensor([float("nan")]), np.array(["a"]),
                torch.zeros(1, 3, 1, 1), torch.zeros(3, device="meta")]

    def _valid(self) -> list[Any]:
        import torch

        return [torch.zeros(3, 1, 1), torch.tensor(0.0)]

    def invalid_for_input(self, shape: tuple[int, ...]) -> list[Any]:
        import torch

        return [torch.zeros(int(shape[1]) + 1, 1, 1), torch.zeros(int(shape[1]), int(shape[2]) + 1, 1)]


def integer(low: int | None = None, high: int | None = None, *, none: bool = False, unit: str = "") -> OptionSpec:
    """An integer in ``[low, high]`` (bools and floats refused); ``unit`` says what it counts (in the message)."""
    return _Integer(low, high, none, unit)


def number(low: float | None = None, high: float | None = None, *, low_open: bool = False,
           high_open: bool = False, none: bool = False) -> OptionSpec:
    """A finite number (int or float, not a bool) in ``[low, high]``; ``low_open``/``high_open`` exclude an end."""
    return _Number(low, high, low_open, high_open, none)


def flag() -> OptionSpec:
    """``True`` or ``False`` (not 0/1, not a string)."""
    return _Flag()


def choice(*values: str, none: bool = False) -> OptionSpec:
    """One of the strings ``values``."""
    return _Choice(tuple(values), none)


def subset(*values: str) -> OptionSpec:
    """A non-empty list or tuple of strings from ``values`` (read as a tuple)."""
    return _Subset(tuple(values))


def any_of(*specs: OptionSpec) -> OptionSpec:
    """A value any one of ``specs`` accepts (read and checked against the input by the first that does)."""
    return _AnyOf(tuple(specs))


def seed() -> OptionSpec:
    """A random seed: an integer in ``[0, 2**63 - 1]`` (``torch.manual_seed``'s range)."""
    spec = _Integer(0, 2 ** 63 - 1, False, "")
    spec.allowed = "an integer in [0, 2**63 - 1] (a random seed)"
    return spec


def grid_cells(*, pair: bool = True, none: bool = False) -> OptionSpec:
    """Cells per side of a grid over the image: an integer ``>= 1`` (or, with ``pair``, ``(gy, gx)``); checked
    against the image when the input arrives (at most one cell per pixel)."""
    return _GridCells(pair, none)


def tensor() -> OptionSpec:
    """A tensor (or numpy array) of finite numbers, checked against the input when it arrives: it must broadcast to
    ``(C, H, W)``. A plain number or list is refused (it would broadcast along the wrong axis)."""
    return _Tensor()


def custom(check: Callable[[Any], bool], allowed: str, *, invalid: Iterable[Any], valid: Iterable[Any] = (),
           normalize: Callable[[Any], Any] | None = None, none: bool = False) -> OptionSpec:
    """A range no helper says: ``check(value)`` decides, ``allowed`` says it in words, ``invalid``/``valid`` are the
    examples the option-range test feeds (at least one of each is expected)."""
    return _Custom(check, allowed, invalid, valid, normalize, none)


def check_option(owner: str, name: str, spec: OptionSpec, value: Any) -> Any:
    """``value`` as the method reads it, or :class:`InputError`: ``option eps of method 'gradskip' must be a finite
    number >= 0; got -1``."""
    if not spec.accepts(value):
        raise InputError(f"option {name} of {owner} must be {spec.describe()}; got {brief(value)}")
    return spec.normalize(value)


def check_option_for_input(owner: str, name: str, spec: OptionSpec, value: Any, shape: tuple[int, ...]) -> None:
    """:class:`InputError` if an option's value does not fit the input batch of ``shape`` (e.g. a grid of more cells
    than pixels)."""
    why = spec.input_problem(value, shape)
    if why:
        raise InputError(f"option {name}={brief(value)} of {owner} does not fit the {int(shape[-2])}x"
                         f"{int(shape[-1])} input: {why}")
