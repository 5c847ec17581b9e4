"""The GradSkip cost benchmark runs end to end; its FLOP counts (deterministic) are in the expected range.

Wall time is measured by the script but never asserted on.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("timm")

from conftest import load_benchmark  # noqa: E402

#: vit_tiny's architecture (12 blocks, 3 heads, width 192) at 64 px (4x4 patches + CLS) keeps the test fast.
SMALL = "vit_tiny_patch16_224:img_size=64"


def test_parse_model_spec():
    bench = load_benchmark("gradskip_cost")
    assert bench.parse_model_spec("vit_tiny_patch16_224") == ("vit_tiny_patch16_224", {})
    assert bench.parse_model_spec("vit_tiny_patch16_224:img_size=64, depth=2,global_pool='avg'") == (
        "vit_tiny_patch16_224", {"img_size": 64, "depth": 2, "global_pool": "avg"})


@pytest.mark.slow
def test_quick_benchmark_table_and_flops(tmp_path):
    bench = load_benchmark("gradskip_cost")
    threads = torch.get_num_threads()
    out = tmp_path / "cost.md"
    # one thread: on a shared 2-core machine, two OpenMP threads stall badly when another process holds a core
    res = bench.main(["--quick", "--models", SMALL, "--batch", "2", "--threads", "1", "--out", str(out)])
    assert torch.get_num_threads() == threads  # main restores the thread count

    rows = {r.row: r for r in res["results"]}
    assert list(rows) == [r + " (default)" for r in bench.ROWS] + list(bench.ROWS)  # --attention both (default)
    for r in rows.values():
        assert r.gflops > 0
        assert len(r.ms_per_image) == 3 and all(t > 0 for t in r.ms_per_image)
        assert math.isfinite(r.peak_mib) and r.peak_mib >= 0
    assert rows["forward+backward"].peak_mib > 0 and rows["gradskip"].peak_mib > 0
    assert (rows["forward"].forward_passes, rows["forward"].backward_passes) == (1, 0)
    assert (rows["gradskip"].forward_passes, rows["gradskip"].backward_passes) == (1, 1)

    fwd, floor, gs = (rows[k].gflops for k in ("forward", "forward+backward", "gradskip"))
    assert gs >= fwd
    assert gs <= 1.1 * floor * 1.01
    # the floor is a forward plus an activation-only backward: between 1.5x and 2.5x a forward
    assert 1.5 * fwd < floor < 2.5 * fwd

    md = res["markdown"]
    for label in ("(a) forward", "(b) forward+backward", "(c) GradSkip", "(b′) forward+backward, default attention",
                  "(c′) GradSkip, default attention", "default-attention floor"):
        assert label in md
    assert f"torch {torch.__version__}" in md and "torch threads: 1" in md
    assert out.read_text() == md
    csv_lines = out.with_suffix(".csv").read_text().strip().splitlines()
    assert len(csv_lines) == 7 and csv_lines[0].startswith("model,row,gflops_per_image")


TINY = "vit_tiny_patch16_224:img_size=32,patch_size=8,depth=2"


def test_fused_rows_count_the_fused_kernels_flops_as_the_explicit_products():
    bench = load_benchmark("gradskip_cost")
    model = bench.build_model(TINY, torch.device("cpu"), fused=True)
    assert all(blk.attn.fused_attn for blk in model.blocks)
    x = bench.make_batch(model, 1, torch.device("cpu"))
    for row in ("forward", "forward+backward"):
        fused, by_op = bench.count_flops(model, x, row + bench.FUSED)
        explicit, _ = bench.count_flops(model, x, row)
        assert fused == explicit  # same matrix products, counted once by aten.bmm, once by the kernel formulas
        assert any("scaled_dot_product" in op for op in by_op)
    assert all(blk.attn.fused_attn for blk in model.blocks)  # the rows restore the model's attention path


@pytest.mark.parametrize("attention", ["default", "fused", "explicit"])
def test_one_attention_path_runs_alone(attention):
    bench = load_benchmark("gradskip_cost")
    res = bench.main(["--models", TINY, "--batch", "1", "--repeats", "1", "--threads", "1", "--no-memory",
                      "--attention", attention])
    rows = [r.row for r in res["results"]]
    assert rows == list(bench.ATTENTION_ROWS[attention])
    for r in res["results"]:
        assert r.gflops > 0 and r.extra["time_x_floor"] > 0
    floor = next(r for r in res["results"] if r.row.startswith("forward+backward"))
    assert floor.extra["time_x_floor"] == 1.0
    assert ("GradSkip ÷ default-attention floor" in res["markdown"]) == (attention == "default")
    assert ("GradSkip ÷ fused-attention floor" in res["markdown"]) == (attention == "fused")
    assert floor.extra["time_x_floor_min"] == floor.extra["time_x_floor_max"] == 1.0  # the per-repeat spread
    for r in res["results"]:  # each timed call's minor page faults, counted per row
        assert 0 <= r.extra["minor_faults"] <= r.extra["minor_faults_max"]
    assert ("minor page faults per call" in res["markdown"]) == (attention != "explicit")


def test_the_default_rows_run_each_attention_as_timm_built_it():
    """The default-attention floor is the model as a user builds it: timm fuses ViT's attention by default but not
    Swin's window attention (its fused path is experimental), so Swin's default rows run explicit attention."""
    bench = load_benchmark("gradskip_cost")
    swin = bench.build_model("swin_tiny_patch4_window7_224:img_size=56,embed_dim=24,window_size=7",
                             torch.device("cpu"))
    vit = bench.build_model(TINY, torch.device("cpu"))
    assert not any(m.fused_attn for m in swin.modules() if hasattr(m, "fused_attn"))
    assert all(blk.attn.fused_attn for blk in vit.blocks)
    seen = []
    with bench.attention_path(swin, None):
        seen += [m.fused_attn for m in swin.modules() if hasattr(m, "fused_attn")]
    with bench.attention_path(swin, True):
        assert all(m.fused_attn for m in swin.modules() if hasattr(m, "fused_attn"))
    assert seen and not any(seen)
    assert not any(m.fused_attn for m in swin.modules() if hasattr(m, "fused_attn"))  # restored


def test_the_floor_starts_at_the_first_block_of_a_swin_and_an_eva():
    """Issue #26 measures the default-attention floor on Swin (blocks under ``layers``) and EVA02 as on a ViT."""
    bench = load_benchmark("gradskip_cost")
    specs = ["swin_tiny_patch4_window7_224:img_size=56,embed_dim=24,window_size=7",
             "eva02_tiny_patch14_224:img_size=28,depth=2,num_classes=5"]
    for spec in specs:
        model = bench.build_model(spec, torch.device("cpu"), fused=True)
        first = bench.first_block(model)
        seen = []
        handle = first.register_forward_hook(lambda m, args, out: seen.append(args[0].requires_grad))
        try:
            assert bench.run_floor(model, bench.make_batch(model, 2, torch.device("cpu"))) == {
                "forward_passes": 1.0, "backward_passes": 1.0}
        finally:
            handle.remove()
        assert seen == [True]  # the leaf the floor differentiates to is the first block's input
        assert all(p.requires_grad for p in model.parameters())  # frozen only for the call
