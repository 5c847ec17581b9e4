"""The GradSkip propagation as it was before the cost work of issue #15, kept as a reference path for the tests.

A plain re-statement of ``docs/methods/gradskip.md``: one forward with the decomposed conservative LayerNorm
(``(x − μ) / sqrt(σ² + ε).detach()``), one ``torch.autograd.grad`` for every block's ``∂y/∂A`` and ``∂y/∂h``
returned at once, then the propagation over the returned tensors. ``tests/test_gradskip_fast.py`` compares the
optimised implementation against it.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

import vitlens
from vitlens.explainers.gradskip import GradSkip, head_weights, readout_relevance


def decomposed_conservative_layernorm(module: nn.LayerNorm, inputs: tuple, output: Tensor) -> Tensor:
    x = inputs[0]
    dims = tuple(range(-len(module.normalized_shape), 0))
    mean = x.mean(dim=dims, keepdim=True)
    var = x.var(dim=dims, unbiased=False, keepdim=True)
    y = (x - mean) / (var + module.eps).sqrt().detach()
    if module.weight is not None:
        y = y * module.weight
    if module.bias is not None:
        y = y + module.bias
    return y.to(output.dtype)


def weighted_attention(attn: Tensor, grad_attn: Tensor, value: Tensor, omega: Tensor) -> Tensor:
    vnorm = value.norm(dim=-1)
    m = torch.einsum("bh,bhij,bhj->bij", omega, (attn * grad_attn).clamp_min(0), vnorm)
    rows = m.sum(dim=-1, keepdim=True)
    fallback = torch.einsum("bh,bhij->bij", omega, attn)
    return torch.where(rows > 0, m / rows.clamp_min(torch.finfo(m.dtype).tiny), fallback)


def gate(u: Tensor, h: Tensor, grad_h: Tensor, skip: str, eps: float) -> Tensor:
    if skip == "fixed":
        return torch.full(u.shape[:2], 0.5, dtype=u.dtype)
    if skip == "none":
        return torch.ones(u.shape[:2], dtype=u.dtype)
    c_main = ((h - u) * grad_h).sum(-1).abs()
    c_skip = (u * grad_h).sum(-1).abs()
    return c_main / (c_main + c_skip + eps)


def reference_gradskip(model: nn.Module, x: Tensor, **options) -> dict[str, Tensor]:
    """Token maps ``(B, gh, gw)``, remainder, scores and the extras of the pre-#15 implementation."""
    o = dict(GradSkip.defaults)
    o.update(options)
    exp = GradSkip(**options)  # option validation (head_subset parsing) as in the library
    o = exp.options
    adapter = vitlens.get_adapter(model)
    with adapter.session(capture=True, conservative=False) as rec:
        handles = [ln.register_forward_hook(decomposed_conservative_layernorm)
                   for ln in adapter.layernorms()] if o["conservative"] else []
        try:
            logits = adapter.forward(x)
        finally:
            for hnd in handles:
                hnd.remove()
        cls = logits.argmax(dim=1)
        y = logits.gather(1, cls[:, None])[:, 0]
        wanted = [t for blk in rec.blocks for t in (blk.attn, blk.h)] + [rec.final]
        grads = torch.autograd.grad(y.sum(), wanted, allow_unused=True)
    grads = [torch.zeros_like(w) if g is None else g for w, g in zip(wanted, grads)]
    y = y.detach()
    relevance = readout_relevance(rec.final.detach(), grads[-1], y, adapter.readout_tokens, adapter.num_prefix_tokens)
    totals, omegas, gates = [relevance.sum(-1)], [], []
    for li in range(len(rec.blocks) - 1, -1, -1):
        blk = rec.blocks[li]
        attn, grad_attn, grad_h = blk.attn.detach(), grads[2 * li], grads[2 * li + 1]
        omega = head_weights(attn, grad_attn, o["head_weighting"], float(o["alpha"]), float(o["grad_threshold"]),
                             o["head_subset"])
        w = weighted_attention(attn, grad_attn, blk.value, omega)
        beta = gate(blk.u.detach(), blk.h.detach(), grad_h, o["skip"], float(o["eps"]))
        relevance = (beta * relevance)[:, None, :].bmm(w)[:, 0] + (1.0 - beta) * relevance
        totals.append(relevance.sum(-1))
        omegas.append(omega)
        gates.append(beta)
    p = adapter.num_prefix_tokens
    gh, gw = adapter.grid(tuple(x.shape[-2:]))
    return {
        "token_maps": relevance[:, p:].reshape(-1, gh, gw), "remainder": relevance[:, :p].sum(-1), "scores": y,
        "head_weights": torch.stack(omegas[::-1], 1), "beta_main": torch.stack(gates[::-1], 1),
        "layer_totals": torch.stack(totals[::-1], 1),
    }
