"""Bad input gets one specific, one-line error — never a stack trace from deep inside torch."""

from __future__ import annotations

import pytest
import torch

import vitlens
from vitlens.errors import InputError, TargetError, UnsupportedModelError, WeightsUnavailableError

from conftest import tiny_vit


@pytest.fixture(scope="module")
def model():
    return tiny_vit()


def one_line(err: pytest.ExceptionInfo) -> str:
    msg = str(err.value)
    assert "\n" not in msg and len(msg) < 400
    return msg


@pytest.mark.parametrize("x,msg", [
    (torch.randn(3, 32, 32), r"shape \(B, C, H, W\).*add a batch dimension"),
    (torch.randn(2, 1, 32, 32), "expects 3 input channels; got a batch with 1"),
    (torch.randn(0, 3, 32, 32), "batch is empty"),
    (torch.zeros(1, 3, 32, 32, dtype=torch.uint8), "floating-point"),
    (torch.full((2, 3, 32, 32), float("nan")), "NaN or inf"),
    (torch.tensor([[[[float("inf")]]]]).expand(1, 3, 32, 32).clone(), "NaN or inf"),
    ([[1, 2, 3]], "expected a torch.Tensor"),
])
def test_bad_batches(model, x, msg):
    with pytest.raises(InputError, match=msg) as err:
        vitlens.explain(model, x)
    one_line(err)


def test_target_out_of_range(model):
    with pytest.raises(TargetError, match="class 9 is out of range for a model with 5 classes") as err:
        vitlens.explain(model, torch.randn(1, 3, 32, 32), target=9)
    one_line(err)


def test_unknown_method_and_option(model):
    with pytest.raises(InputError, match="unknown method 'gradskipp'; available: .*gradskip") as err:
        vitlens.explain(model, torch.randn(1, 3, 32, 32), method="gradskipp")
    one_line(err)
    with pytest.raises(InputError, match="unknown option.*alhpa.*options are") as err:
        vitlens.explain(model, torch.randn(1, 3, 32, 32), alhpa=0.3)
    with pytest.raises(InputError, match=r"option alpha of method 'gradskip' must be a finite number in \[0, 1\]; got 2.0"):
        vitlens.explain(model, torch.randn(1, 3, 32, 32), alpha=2.0)
    with pytest.raises(InputError, match="option skip of method 'gradskip' must be one of 'adaptive', 'fixed', 'none'"):
        vitlens.explain(model, torch.randn(1, 3, 32, 32), skip="sometimes")


def test_unsupported_model_objects():
    with pytest.raises(UnsupportedModelError, match="expected a torch.nn.Module") as err:
        vitlens.explain("not a model", torch.randn(1, 3, 32, 32))
    one_line(err)
    with pytest.raises(UnsupportedModelError, match="no architecture named"):
        vitlens.load_model("timm:no_such_architecture")
    with pytest.raises(UnsupportedModelError, match="shapes-vit"):
        vitlens.load_model("no-such-bundled-model")


def test_pretrained_weights_unavailable_offline_fail_fast(monkeypatch, tmp_path):
    # an empty cache: the error must come at once, without trying the network
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hf"))
    with pytest.raises(WeightsUnavailableError, match="not in the local cache and vitlens never downloads") as err:
        vitlens.load_model("timm:vit_tiny_patch16_224")
    one_line(err)
    with pytest.raises(WeightsUnavailableError, match="does not exist"):
        vitlens.load_model("timm:vit_tiny_patch16_224", weights=tmp_path / "missing.safetensors")
    with pytest.raises(WeightsUnavailableError, match="not available offline") as err:
        vitlens.load_model("hf:some-org/some-vit")
    one_line(err)


def test_local_weights_file_is_used(tmp_path):
    from safetensors.torch import save_file

    src = vitlens.load_model("timm:vit_tiny_patch16_224", pretrained=False, num_classes=3, img_size=32)
    path = tmp_path / "w.safetensors"
    save_file(src.state_dict(), str(path))
    loaded = vitlens.load_model("timm:vit_tiny_patch16_224", weights=path, num_classes=3, img_size=32)
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(src(x), loaded(x))
    assert not loaded.training
