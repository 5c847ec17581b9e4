"""Issue 51, items 5 and 6: the tracebacks of round three are one line (a meta-device model or target, a model that
takes no image, ``aha:grid=(0,0)``, train-aha on a full disk), the family sweep's misleading cells tell the truth
(transformer attribution and GAE on pooled readouts, attention-pool heads, FastViT, hybrids with attention), and
the extension path: a timm sequence family's patch embedding is found, not assumed to be ``model.patch_embed``."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch
from torch import nn

import vitlens
from vitlens.cli import main
from vitlens.errors import InputError, TargetError, UnsupportedModelError
from vitlens.explainers.registry import get_method, method_classes
from vitlens.explainers.support import working_methods

from conftest import tiny_vit

TINY = ["--model", "timm:vit_tiny_patch16_224", "--model-option", "pretrained=False", "--model-option", "img_size=32",
        "--model-option", "patch_size=8", "--model-option", "num_classes=6"]


def one_line(msg: str) -> str:
    assert "\n" not in msg.strip() and 0 < len(msg.strip()) < 800, msg
    assert "Traceback" not in msg, msg
    return msg


def _x(n: int = 1, size: int = 32) -> torch.Tensor:
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(0))


# --- a meta-device model or target ----------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["gradskip", "random", "inputxgradient"])
def test_meta_device_model_is_one_line(method):
    model = tiny_vit().to("meta")
    with pytest.raises(InputError, match=r"parameter cls_token is on the 'meta' device \(a shape, no values\): the "
                                         r"model has no weights to run") as err:
        vitlens.explain(model, _x(), method=method)
    one_line(str(err.value))


@pytest.mark.parametrize("target", [torch.tensor([1], device="meta"), vitlens.targets.ClassLogit(
    torch.tensor([1], device="meta"))], ids=["tensor", "ClassLogit"])
def test_meta_device_target_is_one_line(target):
    with pytest.raises(TargetError, match=r"on the 'meta' device \(a shape, no values\)") as err:
        vitlens.explain(tiny_vit(), _x(), method="inputxgradient", target=target)
    one_line(str(err.value))


# --- a model whose input is not an image ----------------------------------------------------------------------

class TokenIds(nn.Module):
    """A text classifier: token ids (B, L) → logits; no image goes in."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 16)
        self.head = nn.Linear(16, 5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids).mean(1))


@pytest.mark.parametrize("method", ["inputxgradient", "gradient", "integrated_gradients", "rise", "random"])
def test_model_that_takes_token_ids_is_one_line(method):
    opts = {"integrated_gradients": {"n_steps": 2}, "rise": {"n_masks": 4}}.get(method, {})
    with pytest.raises(UnsupportedModelError, match=r"TokenIds refused the input: its forward on a torch.float32 "
                                                    r"image batch of shape \(1, 3, 32, 32\) failed \(RuntimeError: "
                                                    r"Expected tensor for argument #1 'indices'") as e:
        vitlens.explain(TokenIds(), _x(), method=method, **opts)
    one_line(str(e.value))


def test_generic_model_errors_that_are_vitlens_errors_pass_through():
    class Odd(nn.Module):
        def forward(self, x):
            raise InputError("my own one-line refusal")

    with pytest.raises(InputError, match="my own one-line refusal"):
        vitlens.explain(Odd(), _x(), method="random")


# --- AHA's grid of no cells, from the command line -------------------------------------------------------------

def test_aha_grid_zero_on_the_command_line(tmp_path, capsys):
    from PIL import Image

    Image.new("RGB", (32, 32), (120, 30, 200)).save(tmp_path / "x.png")
    rc = main(["explain", str(tmp_path / "x.png"), *TINY, "--methods",
               "aha:grid=(0,0),explainer='untrained'", "--out", str(tmp_path / "o"), "--quiet"])
    err = one_line(capsys.readouterr().err)
    assert rc == 2 and "option grid of method 'aha' must be None, an integer >= 1 or a pair (gy, gx)" in err, err
    assert "got (0, 0)" in err


# --- train-aha on a full disk ----------------------------------------------------------------------------------

#: what torch.save raises when the disk fills while it writes its zip (measured on a 256 KiB tmpfs, torch 2.x)
SHORT_WRITE = "[enforce fail at inline_container.cc:672] . unexpected pos 36416 vs 36304"


def test_short_write_of_torch_save_is_a_full_disk_naming_the_folder(tmp_path, monkeypatch):
    from vitlens import atomic

    def full(obj, f, *a, **k):
        Path(f).write_bytes(b"partial")
        raise RuntimeError(SHORT_WRITE)

    monkeypatch.setattr(torch, "save", full)
    monkeypatch.setattr("shutil.disk_usage", lambda p: type("U", (), {"free": 0})())
    with pytest.raises(OSError) as err:
        atomic.save_torch({"x": 1}, tmp_path / "checkpoint.pt")
    assert err.value.errno == errno.ENOSPC and err.value.filename == str(tmp_path / "checkpoint.pt")
    assert f"disk full: 0 bytes free on the disk holding {tmp_path}" in err.value.strerror
    assert not list(tmp_path.iterdir())  # the temporary is gone


def test_train_aha_on_a_full_disk_is_one_line(tmp_path, monkeypatch, capsys):
    def full(obj, f, *a, **k):
        Path(f).write_bytes(b"partial")
        raise RuntimeError(SHORT_WRITE)

    monkeypatch.setattr(torch, "save", full)
    rc = main(["train-aha", *TINY, "--steps", "2", "--batch-size", "2", "--n-val", "0", "--width", "8",
               "--no-progress", "--out", str(tmp_path / "aha")])
    err = one_line(capsys.readouterr().err)
    assert rc == 1 and "checkpoint.pt" in err and "disk full" in err and str(tmp_path / "aha") in err, err
    assert "inline_container" in err and ".tmp" not in err


def test_full_disk_in_the_safetensors_explainer_is_one_line(tmp_path, monkeypatch):
    """The final explainer is written with safetensors, whose full disk is its own SafetensorError."""
    import safetensors.torch

    from vitlens.aha import AHANet
    from vitlens.aha.network import save_explainer

    class SafetensorError(Exception):
        pass

    def full(state, filename, *a, **k):
        Path(filename).write_bytes(b"partial")
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    with pytest.raises(OSError, match=r"disk full|write failed \(disk full\?") as err:
        save_explainer(AHANet(tiny_vit(), seed=0), tmp_path / "x.safetensors")
    assert err.value.filename == str(tmp_path / "x.safetensors") and "os error 28" in err.value.strerror
    assert not list(tmp_path.iterdir())


# --- the family sweep's cells ------------------------------------------------------------------------------------

def _pooled() -> nn.Module:
    import timm

    torch.manual_seed(0)
    return timm.create_model("vit_medium_patch16_gap_256", pretrained=False, img_size=32, patch_size=8, embed_dim=48,
                             depth=2, num_heads=4, num_classes=5).eval()


@pytest.mark.parametrize("method", ["transformer_attribution", "gae"])
def test_rollouts_on_a_pooled_readout_are_not_a_constant(method):
    """Before: every token got exactly 1/N for every target (the identity's share of R = Π(I + M) dwarfed the rest).
    Now the map varies over the tokens and with the class explained."""
    model, x = _pooled(), _x(2)
    maps = [vitlens.explain(model, x, method=method, target=c).token_maps.flatten(1) for c in (0, 3)]
    for m in maps:
        spread = (m.std(1) / m.abs().mean(1)).min()
        assert spread > 1e-2, f"{method}: the map is flat (relative spread {float(spread):.2e})"
    assert not torch.allclose(maps[0], maps[1], rtol=1e-3, atol=0), f"{method}: the same map for two classes"


def test_rollout_row_equals_the_readout_token_row_for_a_cls_model():
    """On a CLS readout nothing changes: the identity's share lands on the CLS token, outside the map."""
    from vitlens.explainers._attention import readout_row, relevance_rollout, rollout_row

    maps = [torch.rand(2, 5, 5) for _ in range(3)]
    torch.testing.assert_close(rollout_row(maps, (0,), 1)[:, 1:], readout_row(relevance_rollout(maps), (0,), 1)[:, 1:])
    pooled = rollout_row(maps, None, 1)
    torch.testing.assert_close(pooled, readout_row(relevance_rollout(maps) - torch.eye(5), None, 1))


def _attention_pool() -> nn.Module:
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    return VisionTransformer(img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=4, num_classes=5,
                             global_pool="map", class_token=False).eval()


def test_attention_pool_head_claims_only_what_its_methods_honour():
    """SigLIP-style heads (global_pool='map'): no LRP capability and no linear head is claimed (transformer
    attribution refused itself from inside; AttnLRP's completeness was off by up to 1.2e-3 on this model); every
    method the support query lists runs."""
    model, x = _attention_pool(), _x(2)
    adapter = vitlens.get_adapter(model)
    for cap in ("lrp_linears", "lrp_variant_linears", "linear_head"):
        assert not adapter.provides(cap) and "global_pool='map'" in adapter.lacking(cap)
    listed = working_methods(model)
    for name in ("transformer_attribution", "attnlrp", "cplrp"):
        assert name not in listed
        with pytest.raises(UnsupportedModelError, match=r"attention-pool head \(global_pool='map'\)") as err:
            vitlens.explain(model, x, method=name)
        one_line(str(err.value))
    for name in listed:
        opts = {"explainer": "untrained", "refine_steps": 0} if name == "aha" else method_classes()[name].fast_options
        exp = get_method(name, **opts).explain(model, x)
        assert torch.isfinite(exp.maps).all(), name


@pytest.mark.parametrize("arch,attention", [
    ("mobilevit_xxs", "Attention"), ("visformer_tiny", "Attention"), ("davit_tiny", "WindowAttention"),
    ("gcvit_xxtiny", "WindowAttentionGlobal"), ("nextvit_small", "Attention")])
def test_hybrids_with_attention_are_not_called_attention_free(arch, attention):
    import timm

    model = timm.create_model(arch, pretrained=False, num_classes=5).eval()
    why = vitlens.get_adapter(model).lacking("attention")
    assert "a CNN has no attention" not in why
    assert f"vitlens has no adapter that reads {type(model).__name__}'s attention" in why and attention in why
    with pytest.raises(UnsupportedModelError, match="has no adapter that reads") as err:
        get_method("rollout").explain(model, torch.randn(1, 3, 64, 64))
    one_line(str(err.value))


def test_fastvit_is_read_as_a_cnn_without_an_internal_attribute_error():
    import timm

    model = timm.create_model("fastvit_t8", pretrained=False, num_classes=5).eval()
    adapter = vitlens.get_adapter(model)
    assert adapter.family == "timm-cnn" and adapter.in_chans == 3
    with pytest.raises(UnsupportedModelError) as err:
        get_method("gae").explain(model, torch.randn(1, 3, 64, 64))
    assert "AttributeError" not in str(err.value) and "split" not in str(err.value)
    exp = vitlens.explain(model, torch.randn(1, 3, 64, 64), method="gradcam")
    assert torch.isfinite(exp.maps).all()


# --- the extension path: a sequence family's patch embedding is found, not assumed ------------------------------

def test_patch_embedding_is_found_by_its_layout():
    """``patch_embed`` where timm names it so; otherwise the one module laid out as a patch embedding (a new family
    may call it ``stem``); none or two of them is one line, never an AttributeError."""
    import timm
    from timm.layers import PatchEmbed

    from vitlens.models.timm_families import patch_embedding

    eva = timm.create_model("eva02_tiny_patch14_224", pretrained=False, img_size=32, patch_size=8, embed_dim=48,
                            depth=1, num_heads=4, num_classes=5)
    assert patch_embedding(eva) is eva.patch_embed
    assert vitlens.get_adapter(eva).patch_embed is eva.patch_embed

    class Family(nn.Module):
        def __init__(self, n: int) -> None:
            super().__init__()
            self.stems = nn.ModuleList(PatchEmbed(32, 8, 3, 48) for _ in range(n))

    one = Family(1)
    assert patch_embedding(one) is one.stems[0]
    for n in (0, 2):
        with pytest.raises(UnsupportedModelError, match=r"Family: found (no module|2 modules \(stems.0, stems.1\)) "
                                                        r"laid out as a patch embedding") as err:
            patch_embedding(Family(n))
        one_line(str(err.value))
