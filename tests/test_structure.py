"""Structure of the package (issue #11): no private name imported across modules, and the shared helpers that
replaced the private imports and the duplicated code behave as the code they replaced."""

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
