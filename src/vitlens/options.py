"""One validation layer for options: methods, metrics, data sources and command-line values.

Every check raises :class:`~vitlens.errors.InputError` with one line that names the option, the value given and
what is allowed, e.g. ``option alpha of method 'gradskip' must be a number; got 'x'``. The same checks back the
command line's ``type=`` converters (:func:`positive_int`, :func:`positive_float`, ...), so ``--batch 0`` is refused
by argparse with exit code 2 before anything runs.
"""

from __future__ import annotations

import argparse
import inspect
import math
import numbers
from typing import Any, Callable, Iterable, Mapping

from .devices import check_device
from .errors import InputError
from .option_ranges import (OptionSpec, any_of, brief, check_option, check_option_for_input, choice, custom, flag,
                            grid_cells, integer, is_real, number, seed, subset, tensor)

__all__ = [
    "check_known",
    "check_like_default",
    "check_number",
    "check_int",
    "check_device",
    "check_file_name",
    "signature_settings",
    "positive_int",
    "nonnegative_int",
    "positive_float",
    "nonnegative_float",
    "finite_float",
    "parse_key_values",
    "load_model_with_options",
    "OptionSpec",
    "integer",
    "number",
    "flag",
    "choice",
    "subset",
    "any_of",
    "seed",
    "grid_cells",
    "tensor",
    "custom",
    "check_option",
    "check_option_for_input",
    "brief",
]


def check_known(kind: str, owner: str, given: Iterable[str], allowed: Iterable[str]) -> None:
    """Unknown option names are an error: ``unknown setting foo for metric 'pointing_game'; settings: tolerance``."""
    allowed = sorted(allowed)
    unknown = sorted(set(given) - set(allowed))
    if unknown:
        plural = "s" if len(unknown) > 1 else ""
        raise InputError(f"unknown {kind}{plural} {', '.join(unknown)} for {owner}; "
                         f"{kind}s: {', '.join(allowed) or 'none'}")


def check_number(name: str, value: Any, *, low: float | None = None, high: float | None = None,
                 low_open: bool = False, owner: str = "") -> float:
    """``value`` as a finite float in ``[low, high]`` (``(low, high]`` with ``low_open``); else one-line error."""
    where = f" of {owner}" if owner else ""
    lo = "" if low is None else (f"> {low}" if low_open else f">= {low}")
    hi = "" if high is None else f"<= {high}"
    allowed = " and ".join(s for s in (lo, hi) if s)
    want = f"a number {allowed}".strip()
    if not is_real(value) or not math.isfinite(float(value)):
        raise InputError(f"option {name}{where} must be {want}; got {value!r}")
    v = float(value)
    if (low is not None and (v <= low if low_open else v < low)) or (high is not None and v > high):
        raise InputError(f"option {name}{where} must be {want}; got {value!r}")
    return v


def check_int(name: str, value: Any, *, low: int | None = None, high: int | None = None, owner: str = "") -> int:
    """``value`` as an int in ``[low, high]`` (bools and non-integral floats refused)."""
    where = f" of {owner}" if owner else ""
    want = "an integer" + ("" if low is None else f" >= {low}") if high is None else \
        f"an integer in [{'-inf' if low is None else low}, {high}]"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not (
            (low is None or int(value) >= low) and (high is None or int(value) <= high)):
        raise InputError(f"option {name}{where} must be {want}; got {value!r}")
    return int(value)


def check_like_default(owner: str, options: Mapping[str, Any], defaults: Mapping[str, Any],
                       nullable: Iterable[str] = ()) -> None:
    """Type check each option against the type of its default: a float default needs a finite number, an int
    default an integer, a bool default ``True``/``False``. ``None`` is refused for those unless named in
    ``nullable``. Options whose default is ``None``, a string or a container are left to the owner's own checks."""
    nullable = set(nullable)
    for key, default in defaults.items():
        if key not in options:
            continue
        v = options[key]
        if v is None and key in nullable:
            continue
        if isinstance(default, bool):
            if not isinstance(v, bool):
                raise InputError(f"option {key} of {owner} must be True or False; got {v!r}")
        elif isinstance(default, numbers.Integral):
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise InputError(f"option {key} of {owner} must be an integer; got {v!r}")
        elif isinstance(default, numbers.Real):
            if not is_real(v) or not math.isfinite(float(v)):
                raise InputError(f"option {key} of {owner} must be a finite number; got {v!r}")


def signature_settings(cls: type) -> tuple[set[str], bool]:
    """Names ``cls.__init__`` accepts (besides ``self``), and whether it also takes ``**kwargs``."""
    params = list(inspect.signature(getattr(cls, "__init__")).parameters.values())[1:]
    names = {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    return names, any(p.kind == p.VAR_KEYWORD for p in params)


def check_file_name(what: str, name: Any) -> str:
    """A plain file name (no folder part, not ``.``/``..``, not empty): ``--name ../x`` cannot escape ``--out``."""
    s = str(name)
    if not s or s in (".", "..") or "/" in s or "\\" in s or "\0" in s or s != s.strip():
        raise InputError(f"{what} must be a plain file name (no folders, no '..'); got {name!r}")
    return s


# --- argparse converters: a bad value is a usage error (exit code 2) naming the option and the value -------------


def _converter(parse: Callable[[str], Any], ok: Callable[[Any], bool], want: str) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            v = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}") from None
        if not ok(v):
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}")
        return v

    convert.__name__ = want  # argparse names the type in some messages
    return convert


positive_int = _converter(int, lambda v: v >= 1, "an integer >= 1")
nonnegative_int = _converter(int, lambda v: v >= 0, "an integer >= 0")
positive_float = _converter(float, lambda v: math.isfinite(v) and v > 0, "a finite number > 0")
nonnegative_float = _converter(float, lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0")
finite_float = _converter(float, math.isfinite, "a finite number")
seed_int = _converter(int, lambda v: 0 <= v <= 2 ** 63 - 1, "an integer in [0, 2**63 - 1]")  # torch.manual_seed's


def parse_key_values(pairs: Iterable[str], flag: str) -> dict[str, Any]:
    """``["alpha=0.3", "skip=fixed"]`` → ``{"alpha": 0.3, "skip": "fixed"}`` (Python literals, else strings);
    a pair without ``=`` is an error naming ``flag``."""
    from .runtime import parse_value  # the one literal-else-string rule (also bench specs' settings)

    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise InputError(f"{flag} expects KEY=VALUE, got {pair!r}")
        out[key.strip()] = parse_value(raw)
    return out


def load_model_with_options(name: str, options: Mapping[str, Any]) -> Any:
    """:func:`vitlens.load_model` for ``--model NAME --model-option K=V``: options a model does not take are an
    error (bundled models take none; a timm/HF constructor's unexpected keyword is named), never ignored."""
    from .models import load_model

    if options and not (name.startswith("timm:") or name.startswith("hf:")):
        raise InputError(f"--model-option {', '.join(sorted(options))}: model {name!r} takes no options "
                         "(they apply to timm:<arch> and hf:<dir> models)")
    from .pause import pause_point

    try:
        model = load_model(name, **options)
    except (TypeError, ValueError, AssertionError, ArithmeticError) as e:
        if options and isinstance(e, InputError) and (" cannot be built with " in str(e) or " does not take " in str(e)
                                                      or "num_classes must be" in str(e)):
            raise InputError(f"--model-option: {e}") from None
        if not options or isinstance(e, InputError):
            raise
        if "unexpected keyword argument" in str(e):
            raise InputError(f"--model-option: {name} does not take {str(e).split('argument')[-1].strip()} "
                             f"(given: {', '.join(sorted(options))})") from None
        given = ", ".join(f"{k}={v!r}" for k, v in sorted(options.items()))
        why = (str(e).splitlines() or [type(e).__name__])[0][:160]
        raise InputError(f"--model-option: {name} cannot be built with {given} ({type(e).__name__}: {why})") from None
    pause_point("model-loaded")
    return model
