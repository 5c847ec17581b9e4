"""Every option of every registered method has one declared type and range (``Explainer.option_specs``, built from
:mod:`vitlens.options`), and every value outside it is refused in one line that names the method, the option, the
value and what is allowed — when the method is made, or (grid sizes, baseline tensors, segment counts) when an input
arrives whose size it does not fit.

The cases are enumerated from the registry, so a method added later without a declared range for each of its
options fails ``test_every_option_has_a_declared_range`` (and gets its out-of-range values fed here once it has).
"""

from __future__ import annotations

import re

import pytest
import torch

import vitlens
from vitlens.errors import InputError
from vitlens.explainers.registry import get_method, method_classes
from vitlens.options import OptionSpec, check_option, grid_cells, integer

from conftest import tiny_vit

#: values no option of any method may accept (the wrong type for every range)
NEVER = [object(), b"\x00", float("nan"), {"k": 1}]


def undeclared(cls: type) -> list[str]:
    """The options of ``cls.defaults`` without a declared :class:`OptionSpec` (and declared names it has not)."""
    specs = getattr(cls, "option_specs", {})
    missing = [f"{k} (no spec)" for k in cls.defaults if not isinstance(specs.get(k), OptionSpec)]
    return missing + [f"{k} (not an option)" for k in specs if k not in cls.defaults]


def one_line(err: pytest.ExceptionInfo) -> str:
    msg = str(err.value)
    assert "\n" not in msg and 0 < len(msg) < 400, msg
    return msg


def _cases() -> list[tuple[str, str]]:
    return [(name, key) for name, cls in sorted(method_classes().items()) for key in sorted(cls.defaults)]


CASES = _cases()


def test_the_registry_is_enumerated():
    """The enumeration sees every registered method (the methods of this package, at least these)."""
    names = set(method_classes())
    assert {"gradskip", "integrated_gradients", "rise", "aha", "mda", "mutex", "random"} <= names
    assert len({n for n, _ in CASES}) == len([n for n, c in method_classes().items() if c.defaults])


@pytest.mark.parametrize("name", sorted(method_classes()))
def test_every_option_has_a_declared_range(name):
    cls = method_classes()[name]
    assert not undeclared(cls), (
        f"method {name!r} declares no range for: {', '.join(undeclared(cls))} — add option_specs "
        "(docs/architecture.md, 'A new method')")
    for key, spec in cls.option_specs.items():
        assert spec.accepts(cls.defaults[key]), f"{name}.{key}: the default {cls.defaults[key]!r} is out of its range"
        assert spec.invalid(), f"{name}.{key}: the spec lists no value it refuses"


def test_a_method_without_declared_ranges_fails_the_check():
    """What a later method without ranges meets: the completeness check names each undeclared option."""

    class Later(vitlens.explainers.Explainer):
        name = "later"
        defaults = {"steps": 3, "mode": "a"}
        option_specs = {"steps": integer(1)}

    assert undeclared(Later) == ["mode (no spec)"]


@pytest.mark.parametrize("name,key", CASES, ids=[f"{n}-{k}" for n, k in CASES])
def test_out_of_range_and_wrong_type_values_are_refused(name, key):
    cls = method_classes()[name]
    spec = cls.option_specs.get(key)
    assert spec is not None, f"{name}.{key} has no declared range"
    for value in [*NEVER, *spec.invalid()]:
        with pytest.raises(InputError) as err:
            get_method(name, **{key: value})
        msg = one_line(err)
        assert f"option {key} of method '{name}'" in msg, msg
        assert spec.describe() in msg, msg  # the allowed range, in words
        assert "; got " in msg, msg


@pytest.mark.parametrize("name,key", CASES, ids=[f"{n}-{k}" for n, k in CASES])
def test_in_range_values_are_accepted(name, key):
    """The range is not narrower than declared: its boundary values pass the option's check, and the default
    makes the method."""
    cls = method_classes()[name]
    spec = cls.option_specs[key]
    for value in spec.valid():
        check_option(f"method '{name}'", key, spec, value)
    get_method(name, **{key: cls.defaults[key]})


def _input_cases() -> list[tuple[str, str]]:
    shape = (1, 3, 32, 32)
    return [(n, k) for n, k in CASES if method_classes()[n].option_specs.get(k) is not None
            and method_classes()[n].option_specs[k].invalid_for_input(shape)]


INPUT_CASES = _input_cases()


def test_input_dependent_options_are_enumerated():
    assert {("rise", "grid_size"), ("aha", "grid"), ("integrated_gradients", "baseline")} <= set(INPUT_CASES)


@pytest.fixture(scope="module")
def model():
    return tiny_vit()


@pytest.mark.parametrize("name,key", INPUT_CASES, ids=[f"{n}-{k}" for n, k in INPUT_CASES])
def test_options_that_do_not_fit_the_input_are_refused_when_it_arrives(model, name, key):
    """A 32x32 input: a grid of more cells than pixels (RISE's grid_size=1000 on a small image, AHA's grid), a
    baseline tensor of the wrong shape — one line, before any work."""
    cls = method_classes()[name]
    x = torch.randn(1, 3, 32, 32)
    for value in cls.option_specs[key].invalid_for_input(tuple(x.shape)):
        method = get_method(name, **{**cls.fast_options, key: value})  # fits the range: refused with the input
        with pytest.raises(InputError) as err:
            method.explain(model, x)
        msg = one_line(err)
        assert re.search(rf"option {key}=.* of method '{name}' does not fit the 32x32 input", msg), msg


def test_rise_grid_of_1000_on_a_64px_image():
    """The reported case: accepted before, silently one cell per pixel or less."""
    with pytest.raises(InputError, match=r"grid_size=1000 of method 'rise' does not fit the 64x64 input: a "
                                         r"1000x1000 grid of cells does not fit a 64x64 image") as err:
        vitlens.explain(tiny_vit(img_size=64), torch.randn(1, 3, 64, 64), method="rise", grid_size=1000)
    one_line(err)
    exp = vitlens.explain(tiny_vit(img_size=64), torch.randn(1, 3, 64, 64), method="rise", grid_size=64, n_masks=4)
    assert torch.isfinite(exp.maps).all()  # one pixel per cell is the largest grid


def test_mda_segments_beyond_the_pixels_are_refused(model):
    with pytest.raises(InputError, match=r"option n_regions=2000 of method 'mda' does not fit the 32x32 input: at "
                                         r"most 1024 segments") as err:
        get_method("mda", n_regions=2000).explain(model, torch.randn(1, 3, 32, 32))
    one_line(err)


@pytest.mark.parametrize("name,opts,msg", [
    ("gradskip", {"eps": -1}, r"option eps of method 'gradskip' must be a finite number >= 1e-30; got -1"),
    ("gradskip", {"eps": 1e-300}, r"option eps of method 'gradskip' must be a finite number >= 1e-30; got 1e-300"),
    ("integrated_gradients", {"baseline": 5},
     r"option baseline of method 'integrated_gradients' must be one of 'black', 'zero' or a tensor broadcastable "
     r"to \(C, H, W\); got 5"),
    ("integrated_gradients", {"baseline": [0.0, 0.0, 0.0]}, r"or a tensor broadcastable .*; got \[0.0, 0.0, 0.0\]"),
    ("integrated_gradients", {"baseline": torch.full((3, 32, 32), float("nan"))},
     r"got a Tensor of shape \(3, 32, 32\)"),
    ("aha", {"grid": (0, 0)}, r"option grid of method 'aha' must be None, an integer >= 1 or a pair \(gy, gx\) of "
                              r"them .*; got \(0, 0\)"),
    ("aha", {"m": 2}, r"option m of method 'aha' must be >= 3 when refine_steps > 0"),
    ("rise", {"n_masks": 10 ** 7}, r"n_masks of method 'rise' must be an integer in \[1, 1000000\]"),
    ("mutex", {"edge_cut": 2}, r"edge_cut .* must be None, one of 'mean' or a finite number in \[0, 1\); got 2"),
    ("mda", {"reference": "mda"}, r"reference of method 'mda' must be 'none' or a registered method other than"),
    ("integrated_gradients", {"n_steps": 1, "rule": "riemann_trapezoid"}, r"trapezoid rule needs n_steps >= 2"),
])
def test_reported_values(name, opts, msg):
    with pytest.raises(InputError, match=msg) as err:
        get_method(name, **opts)
    one_line(err)


def test_accepted_values_are_read_as_the_method_reads_them():
    assert get_method("gradskip", head_subset="top25").options["head_subset"] == ("top", 0.25)
    assert get_method("mutex", statistics=["mean", "std"]).options["statistics"] == ("mean", "std")
    assert get_method("aha", grid=[2, 3]).options["grid"] == (2, 3)
    assert get_method("integrated_gradients", internal_batch_size=None).options["internal_batch_size"] is None


def test_gradskip_eps_zero_would_divide_zero_by_zero(model):
    """Why eps >= 1e-30 (not >= 0): tokens whose gradient is zero (the last block's non-readout tokens) get the gate
    0 / (0 + 0 + eps), in float32; with eps = 0 or 1e-300 (which underflows to 0 there; both set past the check) that
    is NaN on every pixel. The smallest eps allowed gives finite maps."""
    x = torch.randn(1, 3, 32, 32)
    for eps in (0.0, 1e-300):
        forced = get_method("gradskip", readout_path=False)
        forced.options["eps"] = eps
        assert forced.explain(model, x).maps.isnan().all()
    assert torch.isfinite(get_method("gradskip", readout_path=False, eps=1e-30).explain(model, x).maps).all()


def test_grid_cells_spec_alone():
    spec = grid_cells(pair=False)
    assert spec.accepts(7) and not spec.accepts((7, 7)) and not spec.accepts(0)
    assert spec.input_problem(33, (1, 3, 32, 32)) and spec.input_problem(32, (1, 3, 32, 32)) is None
