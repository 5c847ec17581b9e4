"""Structure of the package (issue #11): no private name imported across modules, no import cycle (counting the
imports inside functions too), and the shared helpers that replaced the private imports and the duplicated code behave
as the code they replaced."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import vitlens
from vitlens.errors import InputError
from vitlens.models import Adapter, register_adapter
from vitlens.models._hf import eager_attention
from vitlens.models.base import _logits_of, int_pair, logits_of

SRC = Path(vitlens.__file__).parent


def _private_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            found += [f"{node.lineno}: from {'.' * node.level}{node.module or ''} import {a.name}"
                      for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
    return found


def test_no_private_name_is_imported_across_modules():
    offenders = {}
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if _private_imports(path):
            offenders[rel] = _private_imports(path)
    assert offenders == {}


def test_the_scan_sees_private_imports(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("from .a import _hidden, public\nfrom b import __version__\n")
    assert _private_imports(f) == ["1: from .a import _hidden"]


def _imports(path: Path, module: str, package: list[str], known: set[str]) -> set[str]:
    """The vitlens modules ``module`` imports anywhere in its file (also inside functions and ``if TYPE_CHECKING:``
    blocks: a type-only import is an edge too), without its own submodules (a package's ``__init__`` re-exporting
    them)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1] + [node.module or ""]) if node.level else node.module
            base = (base or "").rstrip(".")
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        found |= {n for n in names if n in known and n != module and not n.startswith(module + ".")}
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module → the modules of the same tree it imports."""
    files = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":  # a package: relative imports start from the package itself
            parts = parts[:-1]
            files[".".join(parts)] = (path, parts)
        else:
            files[".".join(parts)] = (path, parts[:-1])
    return {m: _imports(p, m, pkg, set(files)) for m, (p, pkg) in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_no_import_cycle_even_through_imports_inside_functions():
    graph = import_graph(SRC)
    assert len(graph) > 100 and "vitlens.models.base" in graph["vitlens.explainers.base"]
    assert cycles(graph) == []


def test_models_import_nothing_from_the_layers_above():
    """Adapters declare capabilities; which method runs is decided above them (vitlens.explainers.support)."""
    graph = import_graph(SRC)
    above = ("vitlens.explainers", "vitlens.aha", "vitlens.metrics", "vitlens.bench", "vitlens.catalog")
    up = {m: sorted(d for d in deps if d.startswith(above)) for m, deps in graph.items()
          if m.startswith("vitlens.models")}
    assert {m: d for m, d in up.items() if d} == {}


def test_no_registered_method_name_in_the_adapters():
    """No method name is a string of models/ code (a refusal list, a limits dict; docstrings' usage examples
    aside): what a family cannot do is a capability it lacks."""
    from vitlens.explainers.registry import methods

    for path in (SRC / "models").glob("*.py"):
        tree = ast.parse(path.read_text())
        strings = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
        named = sorted(set(methods()) & set(strings))
        assert named == [], f"{path.name} names methods {named}"


#: explainers/ modules that are the framework, not a method (docs/architecture.md, "One file per method").
EXPLAINER_FRAMEWORK = ("__init__", "base", "registry", "support")


def _registered(tree: ast.Module) -> list[str]:
    """The ``name`` of every ``@register``-ed class at the top of a module (``"?"`` if it sets none itself)."""
    found = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and any(isinstance(d, ast.Name) and d.id == "register"
                                                  for d in node.decorator_list):
            names = [s.value.value for s in node.body if isinstance(s, ast.Assign) and isinstance(s.value, ast.Constant)
                     and any(isinstance(t, ast.Name) and t.id == "name" for t in s.targets)]
            found.append(names[0] if names else "?")
    return found


def method_file_problems(folder: Path) -> list[str]:
    """Where ``folder`` breaks the rule: a registered method is the one method of ``<name>.py``; a file
    ``<method>_<family>.py`` holds that method's family-specific propagation and registers nothing; shared
    machinery is in ``_``-modules and registers nothing; only the framework modules are anything else."""
    modules = {p.stem: _registered(ast.parse(p.read_text())) for p in sorted(folder.glob("*.py"))}
    methods = {stem for stem, names in modules.items() if names == [stem]}
    problems = []
    for stem, names in modules.items():
        if stem in methods:
            continue
        if stem.startswith("_") or stem in EXPLAINER_FRAMEWORK or any(stem.startswith(f"{m}_") for m in methods):
            if names:
                problems.append(f"{stem}.py registers {names} but is not a method file")
        else:
            problems.append(f"{stem}.py: registers {names}, expected exactly the method named {stem!r}")
    return problems


def test_one_file_per_method():
    from vitlens.explainers.registry import method_classes

    assert method_file_problems(SRC / "explainers") == []
    ours = {n: c.__module__ for n, c in method_classes().items() if c.__module__.startswith("vitlens.")}
    assert len(ours) >= 20 and ours == {n: f"vitlens.explainers.{n}" for n in ours}


def test_the_method_file_scan_sees_each_broken_rule(tmp_path):
    reg = "from .registry import register\n\n"

    def method(cls: str, name: str) -> str:
        return f"@register\nclass {cls}:\n    name = {name!r}\n\n"

    (tmp_path / "base.py").write_text("class Explainer: ...\n")
    (tmp_path / "gae.py").write_text(reg + method("GAE", "gae"))
    (tmp_path / "gae_swin.py").write_text("def windowed(): ...\n")
    (tmp_path / "_helpers.py").write_text(reg + method("Hidden", "hidden"))
    (tmp_path / "pair.py").write_text(reg + method("A", "a") + method("B", "b"))
    (tmp_path / "misnamed.py").write_text(reg + method("C", "c"))
    (tmp_path / "utils.py").write_text("def helper(): ...\n")
    assert method_file_problems(tmp_path) == [
        "_helpers.py registers ['hidden'] but is not a method file",
        "misnamed.py: registers ['c'], expected exactly the method named 'misnamed'",
        "pair.py: registers ['a', 'b'], expected exactly the method named 'pair'",
        "utils.py: registers [], expected exactly the method named 'utils'",
    ]


def test_the_cycle_scan_sees_cycles_inside_functions(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from . import a, b\n")
    (pkg / "a.py").write_text("from .b import g\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import x\n"
                              "def g():\n    from . import a\n")
    (pkg / "c.py").write_text("from .b import g\n")
    graph = import_graph(pkg)
    assert graph["pkg.b"] == {"pkg", "pkg.a", "pkg.c"} and graph["pkg"] == set()  # the type-only import counts
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]


def test_logits_of_reads_every_output_kind_and_keeps_its_old_name():
    t = torch.randn(2, 3)

    class Out:
        logits = t

    assert logits_of(t) is t and logits_of(Out()) is t and logits_of((t, None)) is t
    assert _logits_of is logits_of
    with pytest.raises(InputError, match="cannot find logits in the model output of type dict"):
        logits_of({"x": t})


def test_int_pair():
    assert int_pair(torch.Size([7, 9])) == (7, 9)
    assert int_pair((torch.tensor(3), np.int64(4))) == (3, 4)
    assert all(type(v) is int for v in int_pair(torch.ones(5, 6).shape))
    with pytest.raises(ValueError):
        int_pair((1, 2, 3))


def test_method_classes_is_a_read_only_view_of_the_registry():
    from vitlens.explainers.registry import method_classes

    classes = method_classes()
    assert sorted(classes) == vitlens.methods()
    assert classes["gradskip"].name == "gradskip"
    with pytest.raises(TypeError):
        classes["x"] = classes["gradskip"]


def test_register_adapter_refuses_a_class_without_matches():
    class NoMatches(Adapter):
        family = "no-matches"

    with pytest.raises(InputError, match="adapter NoMatches defines no static matches"):
        register_adapter(NoMatches)
    assert not Adapter.matches(nn.Linear(2, 2))


def test_eager_attention_restores_every_config_also_after_an_exception():
    from transformers import ViTConfig

    outer, inner = ViTConfig(), ViTConfig()
    outer._attn_implementation, inner._attn_implementation = "sdpa", "flash_attention_2"
    with pytest.raises(RuntimeError, match="boom"):
        with eager_attention([outer, inner, outer]):  # a config named twice is saved once
            assert outer._attn_implementation == inner._attn_implementation == "eager"
            raise RuntimeError("boom")
    assert (outer._attn_implementation, inner._attn_implementation) == ("sdpa", "flash_attention_2")


def test_timm_families_match_their_declared_class():
    import timm

    from vitlens.models import TimmBeitAdapter, TimmEvaAdapter, TimmRelPosAdapter, get_adapter

    beit = timm.create_model("beit_base_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=48,
                             depth=1, num_heads=4, num_classes=3)
    adapter = get_adapter(beit)
    assert type(adapter) is TimmBeitAdapter and adapter.any_size is False  # fixed_size
    assert not TimmEvaAdapter.matches(beit) and not TimmRelPosAdapter.matches(beit)
    assert not TimmBeitAdapter.matches(nn.Linear(2, 2))


CFG = {"input_size": (3, 8, 8), "mean": (0.5, 0.5, 0.5), "std": (0.5, 0.5, 0.5)}


def test_float_pixel_checks_name_the_container():
    from vitlens.images import load_images

    with pytest.raises(InputError, match=r"array contains NaN or infinite values"):
        load_images(np.full((8, 8, 3), np.nan, dtype=np.float32), CFG)
    with pytest.raises(InputError, match=r"got range \[0, 2\] \(divide 0-255 data by 255; pass raw pixels"):
        load_images(np.linspace(0, 2, 192, dtype=np.float32).reshape(8, 8, 3), CFG)
    with pytest.raises(InputError, match=r"tensor contains NaN or infinite values"):
        load_images(torch.full((3, 8, 8), float("inf")), CFG)
    with pytest.raises(InputError, match=r"got range \[-1, 0\] \(pass raw pixels, not normalised ones\)"):
        load_images(torch.linspace(-1, 0, 192).reshape(3, 8, 8), CFG)


def test_explain_names_model_option_in_its_error(tmp_path, capsys):
    from PIL import Image

    from vitlens.cli import main

    img = tmp_path / "a.png"
    Image.fromarray(np.zeros((32, 32, 3), dtype=np.uint8)).save(img)
    rc = main(["explain", str(img), "--model", "shapes-vit", "--model-option", "novalue", "--out",
               str(tmp_path / "out"), "--quiet"])
    assert rc == 2
    assert "--model-option expects KEY=VALUE, got 'novalue'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_no_file_over_600_lines_and_no_function_over_120():
    big = {p.relative_to(SRC).as_posix(): n for p in SRC.rglob("*.py") if (n := p.read_text().count("\n")) > 600}
    assert big == {}
    long_functions = []
    for p in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 120:
                long_functions.append(f"{p.relative_to(SRC).as_posix()}:{node.name}")
    assert long_functions == []
