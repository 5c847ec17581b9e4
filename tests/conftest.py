"""Tiny deterministic models shared by the tests (seconds on a CPU), and the helpers several test files use: loading
a benchmark script, reading a bench run's results, one torch thread, GradSkip's ablation switches."""

from __future__ import annotations

import contextlib
import os
import importlib.util
import sqlite3
import sys
from pathlib import Path
from types import ModuleType
from typing import Iterator

import pytest
import torch
from torch import nn

timm = pytest.importorskip("timm")
from timm.models.vision_transformer import VisionTransformer  # noqa: E402

from timm_to_hf import timm_to_hf_vit  # noqa: E402,F401  (re-exported: the tests import it from here)

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def sharpen(model: nn.Module, gain: float = 4.0) -> nn.Module:
    """Scale the query/key projections so attention is peaked and heads differ (random init is near-uniform)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("qkv.weight"):
                d = p.shape[0] // 3
                p[: 2 * d].mul_(gain)
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(gain)
    return model


def tiny_vit(seed: int = 0, **kw) -> VisionTransformer:
    """A 3-block, 4-head, 32-px timm ViT with patch 8 (4x4 tokens). ``kw`` override the architecture."""
    torch.manual_seed(seed)
    args = dict(img_size=32, patch_size=8, embed_dim=48, depth=3, num_heads=4, num_classes=5, qkv_bias=True)
    args.update(kw)
    return sharpen(VisionTransformer(**args)).eval()


def tiny_deit_distilled(seed: int = 0, **kw) -> nn.Module:
    from timm.models.deit import VisionTransformerDistilled

    torch.manual_seed(seed)
    args = dict(img_size=32, patch_size=8, embed_dim=48, depth=3, num_heads=4, num_classes=5, qkv_bias=True)
    args.update(kw)
    m = VisionTransformerDistilled(**args)
    with torch.no_grad():  # the distillation head starts as zeros in timm; make both heads matter
        m.head_dist.weight.normal_(0, 0.2)
    return sharpen(m).eval()


#: prefix-token configurations: (name, constructor) — 0 (GAP), 1 (CLS), 2 (distilled), 1 + 4 registers.
VARIANTS = {
    "gap": lambda: tiny_vit(class_token=False, global_pool="avg"),
    "cls": lambda: tiny_vit(),
    "distilled": lambda: tiny_deit_distilled(),
    "cls+4reg": lambda: tiny_vit(reg_tokens=4),
    "gap+4reg": lambda: tiny_vit(reg_tokens=4, global_pool="avg", class_token=False),
}


@pytest.fixture(params=sorted(VARIANTS))
def variant(request):
    return request.param, VARIANTS[request.param]()


def model_fingerprint(model: nn.Module) -> dict:
    """Everything an explainer could leave changed on a model."""
    import io

    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    state = {
        "weights": buf.getvalue(),
        "training": [(n, m.training) for n, m in model.named_modules()],
        "requires_grad": [(n, p.requires_grad) for n, p in model.named_parameters()],
        "hooks": [
            (n, len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks),
             len(getattr(m, "_backward_pre_hooks", {})))
            for n, m in model.named_modules()
        ],
        "fused": [(n, getattr(m, "fused_attn", None)) for n, m in model.named_modules()],
        "grads": [(n, p.grad is None) for n, p in model.named_parameters()],
    }
    cfg = getattr(model, "config", None)
    if cfg is not None:
        state["attn_impl"] = cfg._attn_implementation
    return state


def assert_restored(model: nn.Module, explain, failing: nn.Module) -> None:
    """``explain(model)`` leaves ``model`` as it was (:func:`model_fingerprint`), also when a forward hook on
    ``failing`` raises inside it (the error reaches the caller unchanged)."""
    before = model_fingerprint(model)
    explain(model)
    assert model_fingerprint(model) == before

    def bad(module, args, output):
        raise RuntimeError("inside the forward")

    handle = failing.register_forward_hook(bad)
    try:
        with pytest.raises(RuntimeError, match="inside the forward"):
            explain(model)
    finally:
        handle.remove()
    assert model_fingerprint(model) == before


def load_benchmark(name: str, module_name: str | None = None) -> ModuleType:
    """Import ``benchmarks/<name>.py`` as a module, registered in ``sys.modules`` under ``module_name`` (default
    ``name``): dataclasses look their module up there."""
    spec = importlib.util.spec_from_file_location(module_name or name, BENCHMARKS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def result_rows(run: Path) -> list[tuple]:
    """The sorted ``(image, method, metric, output, value)`` rows of a bench run's ``results.sqlite``, read with plain
    sqlite3 (not through vitlens' store)."""
    con = sqlite3.connect(run / "results.sqlite")
    try:
        return sorted(con.execute("SELECT image, method, metric, output, value FROM results"))
    finally:
        con.close()


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto`` (the default, pyproject.toml's addopts): one worker per core, at most 4. Each worker holds a torch
    (about 2 GB resident at the suite's peak), so more workers cost memory faster than they save time."""
    return max(1, min(4, os.cpu_count() or 1))


def pytest_configure(config) -> None:
    """A pytest-xdist worker runs torch with one intra-op thread: the workers already fill the cores, and two OpenMP
    pools per core stall each other. (The thread count is then restored to 1 after every test, like any other.)"""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _restore_global_state() -> Iterator[None]:
    """No test leaves global state behind for the next: torch's thread count, deterministic-algorithms flag, default
    dtype and grad mode, the environment variables and the working directory are put back after every test (also
    when it fails), so a test passes or fails alike whatever ran before it."""
    threads = torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    dtype = torch.get_default_dtype()
    grad = torch.is_grad_enabled()
    environ = dict(os.environ)
    cwd = os.getcwd()
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
        torch.set_default_dtype(dtype)
        torch.set_grad_enabled(grad)
        for key in set(os.environ) - set(environ):
            del os.environ[key]
        os.environ.update(environ)
        os.chdir(cwd)


@contextlib.contextmanager
def torch_threads(n: int = 1) -> Iterator[None]:
    """Run torch with ``n`` intra-op threads; the previous count is restored, also after an exception."""
    threads = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def one_thread_per_module() -> Iterator[None]:
    """One thread for a whole test module (``pytestmark = pytest.mark.usefixtures("one_thread_per_module")``): on a
    shared 2-core machine two OpenMP threads stall when another process holds a core."""
    with torch_threads(1):
        yield


#: The float32 rounding budget of the tests: 128 machine epsilons (128 · 2^-23 ≈ 1.5e-5). Every result passes through
#: reductions (matrix products, softmax, sums over tokens and pixels) whose summation order depends on the BLAS kernel,
#: the SIMD width and the thread count, so two correct machines differ by a few epsilons times the magnitude of the
#: *terms* summed; over the depth of the small test models (a few hundred dependent operations) that stays well inside
#: 128 epsilons. A wrong change moves results by far more (golden cases differ by >= 1e-3 relative when the maths
#: changes). Use :func:`assert_close_at_scale`, not a bare rtol tuned on one machine.
F32_ROUNDING = 128 * torch.finfo(torch.float32).eps


def assert_close_at_scale(have: torch.Tensor, want: torch.Tensor, scale: float | None = None, msg=None) -> None:
    """``have`` equals ``want`` up to float32 rounding at ``scale``: ``|have − want| ≤ F32_ROUNDING·(|want| + scale)``
    elementwise. ``scale`` is the magnitude of the terms the values were computed from: by default ``max |want|``; for
    a value that is a difference of larger terms (GradSkip's remainder = score − Σ map) the scale of those terms (the
    score), since rounding follows the terms, not the small difference. NaNs must match."""
    if scale is None:
        scale = float(want.abs().nan_to_num().max()) if want.numel() else 0.0
    torch.testing.assert_close(have, want, rtol=F32_ROUNDING, atol=F32_ROUNDING * max(scale, 1e-30), equal_nan=True,
                               msg=msg)


#: GradSkip's ablation switches: each one must change the map (tests/test_gradskip*.py)
GRADSKIP_ABLATIONS = [
    {"head_weighting": "uniform"},
    {"head_weighting": "gradient"},
    {"head_weighting": "sparsity"},
    {"alpha": 0.2},
    {"grad_threshold": 0.6},
    {"head_subset": ("top", 0.25)},
    {"head_subset": ("bottom", 0.25)},
    {"skip": "fixed"},
    {"skip": "none"},
    {"conservative": False},
]


def options_id(opts: dict) -> str:
    """A test id for a dict of explainer options: ``key=value-key=value``."""
    return "-".join(f"{k}={v}" for k, v in opts.items())


def scene_png(folder: Path, seed: int = 0) -> Path:
    """A 2–4-object scene (``make_multi_scenes(n=1, seed=seed)``) written as ``folder/scene.png`` (for CLI tests)."""
    import numpy as np
    from PIL import Image

    from vitlens.data.multiscenes import make_multi_scenes

    img = folder / "scene.png"
    pixels = make_multi_scenes(n=1, seed=seed).images[0].permute(1, 2, 0).numpy()
    Image.fromarray((np.clip(pixels, 0, 1) * 255).astype("uint8")).save(img)
    return img
