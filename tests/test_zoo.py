"""Tests of the bundled-model registry (vitlens.models.zoo). Never retrains; uses the shipped weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("timm")

from vitlens.data import CLASS_NAMES, make_scenes  # noqa: E402
from vitlens.errors import UnsupportedModelError, VitlensError, WeightsUnavailableError  # noqa: E402
from vitlens.models import zoo  # noqa: E402


def _normalise(x: torch.Tensor, model: torch.nn.Module) -> torch.Tensor:
    mean = torch.tensor(model.pretrained_cfg["mean"]).view(1, 3, 1, 1)
    std = torch.tensor(model.pretrained_cfg["std"]).view(1, 3, 1, 1)
    return (x - mean) / std


SHAPES_MODELS = ["shapes-vit", "shapes-deit", "shapes-vit-gap-reg"]


def test_registry() -> None:
    assert set(SHAPES_MODELS) <= set(zoo.BUNDLED)
    assert zoo.bundled_names() == sorted(zoo.BUNDLED)


@pytest.mark.parametrize("name", SHAPES_MODELS)
def test_architecture_and_cfg(name: str) -> None:
    from timm.data import resolve_model_data_config
    from timm.models.deit import VisionTransformerDistilled
    from timm.models.vision_transformer import VisionTransformer

    m = zoo.BUNDLED[name].build()
    assert isinstance(m, VisionTransformer)
    assert len(m.blocks) == 6 and m.blocks[0].attn.num_heads == 6 and m.embed_dim == 192
    assert m.patch_embed.patch_size == (8, 8) and m.num_classes == 6
    assert isinstance(m.patch_embed.proj, zoo.ConvStem)
    prefix = {"shapes-vit": 1, "shapes-deit": 2, "shapes-vit-gap-reg": 4}[name]
    assert m.num_prefix_tokens == prefix
    assert isinstance(m, VisionTransformerDistilled) == (name == "shapes-deit")
    assert m.global_pool == ("avg" if name == "shapes-vit-gap-reg" else "token")
    assert (m.cls_token is None) == (name == "shapes-vit-gap-reg")
    with torch.no_grad():  # the stem maps 8x8 pixels to one token, like a patch-8 projection
        assert m.patch_embed.proj(torch.zeros(1, 3, 64, 48)).shape == (1, 192, 8, 6)
    cfg = resolve_model_data_config(m)
    assert cfg["input_size"] == (3, 64, 64)
    assert tuple(cfg["mean"]) == tuple(m.pretrained_cfg["mean"])
    assert tuple(cfg["std"]) == tuple(m.pretrained_cfg["std"])
    assert cfg["interpolation"] == "bilinear" and cfg["crop_pct"] == 1.0
    assert tuple(m.pretrained_cfg["label_names"]) == CLASS_NAMES
    with torch.no_grad():  # dynamic image size: other inputs are accepted
        assert m.eval()(torch.zeros(1, 3, 96, 96)).shape == (1, 6)


@pytest.fixture(scope="module", params=SHAPES_MODELS)
def named_model(request: pytest.FixtureRequest) -> tuple[str, torch.nn.Module]:
    return request.param, zoo.load_bundled(request.param)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return zoo.load_bundled("shapes-vit")


def test_load_bundled_offline_eval_mode(model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    assert not model.training
    assert all(not mod.training for mod in model.modules())


def test_loading_never_touches_the_network(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("network access attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    assert not zoo.load_bundled("shapes-vit").training


def test_bundled_accuracy_on_fresh_scenes(named_model: tuple[str, torch.nn.Module]) -> None:
    name, model = named_model
    assert not model.training
    s = make_scenes(n=300, seed=12345)
    with torch.inference_mode():
        pred = model(_normalise(s.images, model)).argmax(-1)
    acc = (pred == s.labels).float().mean().item()
    import json

    recorded = json.loads((zoo.WEIGHTS_DIR / f"{name}.json").read_text())["test_accuracy"]
    # the shipped weights perform as their model card says (300 fresh scenes: ±0.04 covers sampling noise at ≥ 95%)
    assert acc >= recorded - 0.04, f"{name}: accuracy {acc:.3f} on fresh scenes vs {recorded:.3f} recorded"
    assert recorded > 0.8, f"{name}: recorded test accuracy {recorded:.3f} (chance is 1/6)"
    # the spec's targets (97% / 95% / 95%) are compared with the recorded values in docs/models.md, met or not


@pytest.mark.parametrize("name", SHAPES_MODELS)
def test_model_card_and_metadata(name: str) -> None:
    card = zoo.model_card(name)
    assert name in card and "accuracy" in card.lower() and "Gini" in card
    meta = zoo.WEIGHTS_DIR / f"{name}.json"
    assert meta.is_file()
    assert zoo.weights_path(name).stat().st_size < 20_000_000


def test_unknown_name_raises() -> None:
    with pytest.raises(UnsupportedModelError, match="shapes-vit"):
        zoo.load_bundled("resnet-9000")
    with pytest.raises(VitlensError):
        zoo.model_card("resnet-9000")


def test_missing_weights_raise(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(zoo, "WEIGHTS_DIR", tmp_path)
    with pytest.raises(WeightsUnavailableError) as info:
        zoo.load_bundled("shapes-vit")
    msg = str(info.value)
    assert "\n" not in msg and "shapes-vit.safetensors" in msg and "vitlens.training.shapes" in msg
    assert not zoo.load_bundled("shapes-vit", weights=False).training  # architecture alone still works
    assert "vitlens.training.shapes" in zoo.model_card("shapes-vit")


def test_corrupt_weights_raise(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "shapes-vit.safetensors").write_bytes(b"not a safetensors file")
    monkeypatch.setattr(zoo, "WEIGHTS_DIR", tmp_path)
    with pytest.raises(WeightsUnavailableError):
        zoo.load_bundled("shapes-vit")
