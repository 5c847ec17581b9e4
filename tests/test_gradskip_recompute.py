"""GradSkip on a model with timm's fused attention (the default a user gets) keeps that attention and recomputes
each block's probabilities in the backward (issue #26): same maps as on the explicit path up to float rounding,
the fused path really runs, nothing of the recording outlives the session, and the model is left as it was.
"""

from __future__ import annotations

import pytest
import torch

import vitlens
from vitlens.models.base import switched

from conftest import VARIANTS, model_fingerprint, tiny_vit


def batch(n: int = 3, size: int = 32, seed: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, size, size, generator=g)


def close(new: torch.Tensor, ref: torch.Tensor, rel: float) -> None:
    torch.testing.assert_close(new, ref, rtol=0.0, atol=rel * (float(ref.abs().max()) or 1.0))


@pytest.mark.parametrize("name", sorted(VARIANTS))
@pytest.mark.parametrize("opts", [{}, {"readout_path": False}, {"head_subset": "bottom50", "skip": "fixed"}],
                         ids=["defaults", "full-last-block", "subset"])
def test_recomputed_probabilities_give_the_explicit_maps(name, opts):
    model = VARIANTS[name]()
    assert all(blk.attn.fused_attn for blk in model.blocks)  # timm's default
    x = batch()
    fused = vitlens.explain(model, x, method="gradskip", **opts)
    with switched([blk.attn for blk in model.blocks], "fused_attn", False):
        explicit = vitlens.explain(model, x, method="gradskip", **opts)
    close(fused.token_maps, explicit.token_maps, 1e-5)
    close(fused.remainder, explicit.remainder, 1e-5)
    for key in ("head_weights", "layer_totals"):
        close(fused.extras[key], explicit.extras[key], 1e-5)
    close(fused.extras["beta_main"], explicit.extras["beta_main"], 1e-4)
    torch.testing.assert_close(fused.scores, explicit.scores, rtol=1e-5, atol=1e-6)


def test_the_fused_attention_runs_and_no_probabilities_are_recorded():
    model = tiny_vit()
    seen: list[bool] = []
    # on qkv: the readout path runs the last block's attention parts without calling the attention module
    handles = [blk.attn.qkv.register_forward_pre_hook(lambda m, a, at=blk.attn: seen.append(bool(at.fused_attn)))
               for blk in model.blocks]
    try:
        vitlens.explain(model, batch(2), method="gradskip")
        assert seen == [True] * len(model.blocks)
        adapter = vitlens.get_adapter(model)
        with adapter.session(capture=True, recompute=True) as rec:
            adapter.forward(batch(2))
        assert rec.recompute
        for b in rec.blocks:
            assert b.attn is None and b.out is not None and b.out.requires_grad
            assert b.query.shape == b.key.shape == b.value.shape == (2, 4, 17, 12)
            assert b.scale == pytest.approx(12 ** -0.5)
        seen.clear()
        with switched([model.blocks[1].attn], "fused_attn", False):  # one explicit block: explicit everywhere
            with adapter.session(capture=True, recompute=True) as rec:
                adapter.forward(batch(2))
        assert not rec.recompute and all(b.attn is not None and b.out is None for b in rec.blocks)
        assert seen == [False] * len(model.blocks)
    finally:
        for h in handles:
            h.remove()


def test_recomputed_probabilities_are_row_stochastic_and_match_the_explicit_ones():
    model = tiny_vit()
    adapter = vitlens.get_adapter(model)
    x = batch(2)
    with adapter.session(capture=True, recompute=True) as rec:
        adapter.forward(x)
    with adapter.session(capture=True) as ref:
        adapter.forward(x)
    for b, r in zip(rec.blocks, ref.blocks):
        a = ((b.query * b.scale) @ b.key.transpose(-2, -1)).softmax(dim=-1)
        torch.testing.assert_close(a, r.attn.detach(), rtol=1e-5, atol=1e-6)


def test_model_is_restored_after_an_exception_in_the_recomputing_session():
    model = tiny_vit()
    before = model_fingerprint(model)

    def fail(module, args, out):
        raise RuntimeError("head failed")

    handle = model.head.register_forward_hook(fail)
    try:
        with pytest.raises(RuntimeError, match="head failed"):
            vitlens.explain(model, batch(2), method="gradskip")
    finally:
        handle.remove()
    assert model_fingerprint(model) == before
    vitlens.explain(model, batch(2), method="gradskip")
    assert model_fingerprint(model) == before


def _first_block_gradient(adapter, x, sink=None):
    """``∂(Σ top logit)/∂u₀`` in a recomputing session, with ``on_probabilities`` set to ``sink`` (or not)."""
    with adapter.session(capture=True, recompute=True) as rec:
        rec.on_probabilities = sink
        logits = adapter.forward(x)
        y = logits.gather(1, logits.argmax(1, keepdim=True)).sum()
        (g,) = torch.autograd.grad(y, rec.blocks[0].u)
    return rec, logits.detach(), g


def _handed_over(adapter, x):
    """:func:`_first_block_gradient` with a sink that keeps what each block hands over: ``(A, F, ΣF, ‖v‖)`` per
    block, over the whole batch (the chunks of images checked to be consecutive and to cover it, then joined)."""
    chunks: dict[int, list[tuple[slice, tuple[torch.Tensor, ...]]]] = {}

    def sink(i, images, *tensors):  # the tensors are buffers reused for the next images: copied
        chunks.setdefault(i, []).append((images, tuple(t.clone() for t in tensors)))

    rec, logits, g = _first_block_gradient(adapter, x, sink)
    for parts in chunks.values():
        bounds = [b for s, _ in parts for b in (s.start, s.stop)]
        assert bounds[0] == 0 and bounds[-1] == len(x) and bounds[1:-1:2] == bounds[2::2]
    return rec, logits, g, {i: tuple(torch.cat(ts) for ts in zip(*(t for _, t in parts)))
                            for i, parts in chunks.items()}


@pytest.mark.parametrize("readout", [True, False], ids=["readout-path", "full-last-block"])
def test_attention_backward_from_recomputed_probabilities_matches_the_fused_kernel(readout):
    """With ``Recording.on_probabilities`` set, each fused attention's backward is computed from its recomputed
    probabilities (``models/_probabilities_backward.py``): the same logits, the same gradient to the first block's
    input as the fused kernel's own backward (up to rounding), and every block hands over ``A`` and
    ``A ⊙ ∂y/∂A`` equal to the explicit path's."""
    import contextlib

    model = tiny_vit()
    adapter = vitlens.get_adapter(model)
    x = batch(2)
    fast = adapter.readout_only(all_queries=True) if readout else contextlib.nullcontext()
    with fast:
        rec, logits, g, got = _handed_over(adapter, x)
        ref_rec, ref_logits, ref_g = _first_block_gradient(adapter, x)
    assert all(b.probabilities_in_backward for b in rec.blocks)
    assert not any(b.probabilities_in_backward for b in ref_rec.blocks)
    torch.testing.assert_close(logits, ref_logits, rtol=0.0, atol=0.0)  # the fused kernel's values, unchanged
    close(g, ref_g, 1e-5)
    assert sorted(got) == [0, 1, 2]
    with adapter.session(capture=True) as ex:  # explicit attention: A and ∂y/∂A from autograd
        out = adapter.forward(x)
        y = out.gather(1, out.argmax(1, keepdim=True)).sum()
        grads = torch.autograd.grad(y, [b.attn for b in ex.blocks])
    for i, (a, f, row_sums, vnorm) in got.items():
        ref_a = ex.blocks[i].attn.detach()
        torch.testing.assert_close(a, ref_a, rtol=1e-5, atol=1e-6)
        ref_f = (ref_a * grads[i])[:, :, : f.shape[2]]
        assert f.shape[2] == (1 if readout and i == 2 else ref_a.shape[2])
        close(f, ref_f, 1e-5)
        close(row_sums, ref_f.sum(-1), 1e-5)  # the softmax backward's row sums, handed over with F
        torch.testing.assert_close(vnorm, ex.blocks[i].value.norm(dim=-1), rtol=1e-5, atol=1e-6)


def test_no_rerouting_without_a_consumer_or_with_normalised_queries():
    model = tiny_vit(qk_norm=True)
    adapter = vitlens.get_adapter(model)
    x = batch(2)
    rec, _, g = _first_block_gradient(adapter, x, lambda *_: None)
    assert rec.recompute and not any(b.probabilities_in_backward for b in rec.blocks)  # q_norm: the fused backward
    before = model_fingerprint(model)
    maps = vitlens.explain(model, x, method="gradskip").token_maps
    with switched([blk.attn for blk in model.blocks], "fused_attn", False):
        close(maps, vitlens.explain(model, x, method="gradskip").token_maps, 1e-5)
    assert model_fingerprint(model) == before


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [57, 65, 129, 256, 257, 258, 513])
def test_probability_gini_is_the_gini_coefficient(dtype, n):
    """GradSkip's head sparsity sorts the rows as integers with the same bits (``probability_gini``): the same
    coefficient as the definition (``vitlens.runtime.gini``) on softmax rows, spikes, uniform, zero and tied rows,
    also at 256-258 values (past the width NumPy's SIMD sort handles in one network), a spike and a tie in the last
    column."""
    from vitlens.explainers._gradskip_rules import probability_gini
    from vitlens.runtime import gini

    g = torch.Generator().manual_seed(0)
    rows = torch.randn(2, 3, 40, n, generator=g, dtype=dtype).mul(4).softmax(-1)
    rows[0, 0, 0] = 0.0
    rows[0, 0, 1] = 1.0 / n
    rows[0, 0, 2] = torch.nn.functional.one_hot(torch.tensor(5), n).to(dtype)
    rows[0, 0, 3, :30] = 0.25
    rows[0, 0, 3, 30:] = 0.0
    rows[0, 0, 4] = torch.nn.functional.one_hot(torch.tensor(n - 1), n).to(dtype)  # the spike in the last column
    rows[0, 0, 5, -1] = rows[0, 0, 5, 0]  # a tie between the last column and a sorted one
    got, ref = probability_gini(rows), gini(rows)
    assert got.dtype == dtype and got.shape == (2, 3, 40)
    torch.testing.assert_close(got, ref, rtol=0.0, atol=1e-6 if dtype == torch.float32 else 1e-12)
    assert float(got[0, 0, 0]) == 0.0 and abs(float(got[0, 0, 1])) < 1e-6
    assert float(got[0, 0, 2]) == pytest.approx((n - 1) / n)
    assert float(got[0, 0, 4]) == pytest.approx((n - 1) / n)


@pytest.mark.parametrize("n", [197, 257])
def test_probability_gini_blocks_give_the_whole_array(monkeypatch, n):
    """``probability_gini`` takes the rows in blocks of ``GINI_BLOCK_BYTES`` through one sort buffer: with blocks of
    7 rows (the last one partial) the coefficients are those of one block (up to the rounding of the matrix-vector
    product, whose kernel depends on the row count) and of the definition, and the input is left as it was (the sort
    works on the buffer)."""
    from vitlens.explainers import _gradskip_rules as rules

    rows = torch.randn(2, 3, 20, n, generator=torch.Generator().manual_seed(1)).mul(4).softmax(-1)
    before = rows.clone()
    whole = rules.probability_gini(rows)
    monkeypatch.setattr(rules, "GINI_BLOCK_BYTES", 7 * n * 4)
    blocked = rules.probability_gini(rows)
    torch.testing.assert_close(blocked, whole, rtol=0.0, atol=2e-7)
    assert torch.equal(rows, before)
    torch.testing.assert_close(blocked, rules.gini(rows), rtol=0.0, atol=1e-6)


def _eva(seed: int = 0, **kw):
    """A small timm EVA02 (rotary embeddings on queries and keys, SwiGLU, prefix and register tokens)."""
    timm = pytest.importorskip("timm")
    from conftest import sharpen

    torch.manual_seed(seed)
    return sharpen(timm.create_model("eva02_tiny_patch14_224", pretrained=False, img_size=28, patch_size=7, depth=3,
                                     num_classes=5, **kw)).eval()


def _function_modes() -> int:
    return torch._C._len_torch_function_stack()


@pytest.mark.parametrize("kw", [{}, {"qkv_fused": False, "num_reg_tokens": 2}], ids=["qkv", "separate-qkv-registers"])
def test_eva_keeps_its_fused_attention_and_gives_the_explicit_maps(kw):
    """timm EVA applies RoPE between the projections and the fused kernel: the recording takes the queries and keys
    as the kernel receives them (``models/_fused_calls.py``), the backward hands over ``A`` and ``A ⊙ ∂y/∂A`` equal
    to the explicit path's, and GradSkip's maps are the explicit path's up to rounding."""
    model = _eva(**kw)
    assert all(blk.attn.fused_attn for blk in model.blocks)
    adapter = vitlens.get_adapter(model)
    assert adapter.recomputes_attention()
    x = batch(2, size=28)
    before, modes = model_fingerprint(model), _function_modes()
    fused = vitlens.explain(model, x, method="gradskip")
    assert _function_modes() == modes and model_fingerprint(model) == before
    with switched([blk.attn for blk in model.blocks], "fused_attn", False):
        assert not adapter.recomputes_attention()
        explicit = vitlens.explain(model, x, method="gradskip")
    close(fused.token_maps, explicit.token_maps, 1e-5)
    close(fused.remainder, explicit.remainder, 1e-5)
    for key in ("head_weights", "layer_totals"):
        close(fused.extras[key], explicit.extras[key], 1e-5)
    close(fused.extras["beta_main"], explicit.extras["beta_main"], 1e-4)

    rec, logits, g, got = _handed_over(adapter, x)
    ref_rec, ref_logits, ref_g = _first_block_gradient(adapter, x)
    assert rec.recompute and all(b.probabilities_in_backward and b.attn is None for b in rec.blocks)
    assert not any(b.probabilities_in_backward for b in ref_rec.blocks)
    torch.testing.assert_close(logits, ref_logits, rtol=0.0, atol=0.0)  # the fused kernel's values
    close(g, ref_g, 1e-5)
    assert sorted(got) == [0, 1, 2]
    with adapter.session(capture=True) as ex:
        out = adapter.forward(x)
        y = out.gather(1, out.argmax(1, keepdim=True)).sum()
        grads = torch.autograd.grad(y, [b.attn for b in ex.blocks])
    for i, b in enumerate(rec.blocks):  # the recorded queries and keys are after RoPE
        torch.testing.assert_close(((b.query * b.scale) @ b.key.transpose(-2, -1)).softmax(-1),
                                   ex.blocks[i].attn.detach(), rtol=1e-5, atol=1e-6)
    for i, (a, f, row_sums, vnorm) in got.items():
        ref_a = ex.blocks[i].attn.detach()
        torch.testing.assert_close(a, ref_a, rtol=1e-5, atol=1e-6)
        close(f, ref_a * grads[i], 1e-5)
        close(row_sums, (ref_a * grads[i]).sum(-1), 1e-5)
        torch.testing.assert_close(vnorm, ex.blocks[i].value.norm(dim=-1), rtol=1e-5, atol=1e-6)
    assert _function_modes() == modes


def test_eva_fused_recording_is_left_after_an_exception_and_refuses_masks():
    model = _eva()
    adapter = vitlens.get_adapter(model)
    before, modes = model_fingerprint(model), _function_modes()

    def fail(module, args, out):
        raise RuntimeError("head failed")

    handle = model.head.register_forward_hook(fail)
    try:
        with pytest.raises(RuntimeError, match="head failed"):
            vitlens.explain(model, batch(2, size=28), method="gradskip")
    finally:
        handle.remove()
    assert _function_modes() == modes and model_fingerprint(model) == before
    mask = torch.zeros(17, 17, dtype=torch.bool)
    with adapter.session(capture=True, recompute=True):
        with pytest.raises(vitlens.UnsupportedModelError, match="fused_attn = False"):
            model.forward_features(batch(2, size=28), attn_mask=mask)
    assert _function_modes() == modes and model_fingerprint(model) == before


@pytest.mark.parametrize("tq", [17, 1], ids=["all-rows", "readout-rows"])
def test_attention_backward_in_chunks_is_the_whole_batch_backward(tq, monkeypatch):
    """The recomputed attention backward takes the image × head rows a few at a time (cache-sized chunks) and hands
    ``A``, ``F`` and the row sums over in consecutive groups of whole images (at least one, also when one image's
    rows exceed the bytes of a group): the same tensors and q/k/v gradients, bit for bit, as one pass over all rows, also when
    only the first ``T_q`` output rows have a gradient (the readout path) and when the rows do not divide into
    chunks."""
    import vitlens.models._probabilities_backward as pb

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(7 * 2, 17, 8, generator=g) for _ in range(3))  # 7 images, 2 heads
    grad = torch.randn(14, tq, 8, generator=g)

    def run(chunk_rows, consume_images):
        monkeypatch.setattr(pb, "CHUNK_BYTES", chunk_rows * 17 * 17 * 4)
        monkeypatch.setattr(pb, "CONSUME_BYTES", consume_images * 2 * 17 * 17 * 4)
        handed: list[tuple[slice, tuple[torch.Tensor, ...]]] = []
        parts = pb._attention_backward(q, k, v, grad, 0.3, 2,
                                       lambda images, *ts: handed.append((images, tuple(t.clone() for t in ts))))
        return (*(torch.cat(ts) for ts in zip(*(t for _, t in handed))), parts), [(s.start, s.stop) for s, _ in handed]

    whole, images = run(1 << 30, 1 << 30)
    assert images == [(0, 7)]
    for rows, per_call, expected in ((3, 2, [(0, 2), (2, 4), (4, 6), (6, 7)]),  # 4 rows a call, taken 3 + 1
                                     (5, 3, [(0, 3), (3, 6), (6, 7)]),  # 6 rows a call, taken 5 + 1
                                     (1, 0, [(j, j + 1) for j in range(7)])):  # at least one image a call
        chunked, images = run(rows, per_call)
        assert images == expected
        for a, b in zip(whole, chunked):
            assert torch.equal(a, b)
    attn, flow, row_sums, parts = whole
    handed_only: list[tuple[torch.Tensor, ...]] = []  # block 0's path: A, F and ΣF only, the same bits
    assert pb._attention_backward(q, k, v, grad, 0.3, 2, lambda images, *ts: handed_only.append(
        tuple(t.clone() for t in ts)), gradients=False) is None
    for a, b in zip(whole[:3], (torch.cat(ts) for ts in zip(*handed_only))):
        assert torch.equal(a, b)
    ref = ((q * 0.3) @ k.transpose(-2, -1)).softmax(-1)
    torch.testing.assert_close(attn, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(flow, (grad @ v.transpose(-2, -1)) * ref[:, :tq], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(row_sums, flow.sum(-1, keepdim=True))
    assert parts.shape == (3, 14, 17, 8) and bool((parts[0, :, tq:] == 0).all())


@pytest.mark.parametrize("family", ["vit", "eva"])
def test_gradskip_maps_do_not_depend_on_how_the_backward_chunks_the_images(family, monkeypatch):
    """GradSkip reduces each chunk of images that the recomputed attention backward hands over (head weights and
    ``W̃`` are per image): one image at a time and the whole batch at once give the same maps, head weights and
    layer totals, bit for bit."""
    import vitlens.models._probabilities_backward as pb

    model = tiny_vit() if family == "vit" else _eva()
    x = batch(3, size=32 if family == "vit" else 28)
    monkeypatch.setattr(pb, "CHUNK_BYTES", 1 << 40)
    monkeypatch.setattr(pb, "CONSUME_BYTES", 1 << 40)
    whole = vitlens.explain(model, x, method="gradskip")
    monkeypatch.setattr(pb, "CHUNK_BYTES", 1)  # one row a chunk, one image a call
    monkeypatch.setattr(pb, "CONSUME_BYTES", 1)
    single = vitlens.explain(model, x, method="gradskip")
    assert torch.equal(whole.token_maps, single.token_maps)
    for key in ("head_weights", "layer_totals"):
        assert torch.equal(whole.extras[key], single.extras[key])


@pytest.mark.parametrize("family", ["vit", "eva"])
def test_block_zero_is_reduced_in_groups_of_images_like_the_others(family, monkeypatch):
    """Block 0's attention backward does not run; its ``A`` and ``A ⊙ ∂y/∂A`` are recomputed in the same chunks and
    groups of images as the other blocks' (:func:`~vitlens.models._probabilities_backward.hand_over_probabilities`,
    no ``(B, H, T, T)`` tensor for the whole batch), and handed to the same consumer: with one image a group every
    block, block 0 included, is reduced image by image, and the maps are the whole-batch recomputation's."""
    import vitlens.explainers.gradskip as gs
    import vitlens.models._probabilities_backward as pb

    model = tiny_vit() if family == "vit" else _eva()
    x = batch(3, size=32 if family == "vit" else 28)
    calls: list[tuple[int, int, int]] = []
    consume = gs._BlockSteps.probabilities

    def counted(self, li, images, *ts):
        calls.append((li, images.start, images.stop))
        return consume(self, li, images, *ts)

    monkeypatch.setattr(pb, "CONSUME_BYTES", 1)  # one image a group
    monkeypatch.setattr(gs._BlockSteps, "probabilities", counted)
    grouped = vitlens.explain(model, x, method="gradskip")
    assert sorted(calls) == [(li, i, i + 1) for li in range(len(model.blocks)) for i in range(3)]
    monkeypatch.setattr(gs, "hand_over_probabilities", lambda *a: pytest.fail("not the whole-batch path"))
    monkeypatch.setattr(gs._BlockSteps, "_attn_step", _whole_batch_attn_step)
    whole = vitlens.explain(model, x, method="gradskip")
    close(grouped.token_maps, whole.token_maps, 1e-5)
    close(grouped.extras["head_weights"], whole.extras["head_weights"], 1e-5)


def _whole_batch_attn_step(self, li, grad):
    """The attention step as it was before block 0 took the chunked path: ``A`` for the whole batch at once."""
    from vitlens.explainers.gradskip import _recomputed

    cap = self.saved[li]
    with torch.no_grad():
        attn, flow_terms, vnorm = _recomputed(cap, grad)
        self.w[li], self.omega[li] = self._reduced(attn, flow_terms, vnorm)
