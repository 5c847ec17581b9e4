"""How heterogeneous a model's attention heads are: per-head Gini sparsity and mean attention distance.

GradSkip's adaptive head weighting can only matter where the heads of a layer differ. Two standard per-head
statistics, averaged over query tokens and images:

- **Gini sparsity** of each attention row (0 = uniform over the keys, → 1 = all attention on one key), the sparsity
  score GradSkip itself uses (:func:`vitlens.runtime.gini`);
- **mean attention distance** (Dosovitskiy et al., ICLR 2021, Fig. 7): the attention-weighted distance, in patches,
  between a patch query and the patch keys it attends to (attention to prefix tokens is left out and the rest
  renormalised) — local heads score ~1, global heads ~ the grid's mean pairwise distance.

The *spread* of either over the heads of a layer (max − min) measures how specialised the heads are.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["head_statistics"]


@torch.no_grad()
def head_statistics(model: nn.Module, x: Tensor, batch: int = 100) -> dict[str, Tensor]:
    """Per-layer, per-head attention statistics of ``model`` on the (preprocessed) inputs ``x``.

    Returns ``{"gini": (L, H), "distance": (L, H)}`` float64 tensors (means over query rows and images; distance in
    patches, patch queries and keys only). Needs a model whose adapter captures attention.
    """
    from ..runtime import gini
    from ..models import get_adapter
    from ..models.base import int_pair, recorded

    adapter = get_adapter(model, require="attention")
    if adapter.windowed or adapter.class_attention:  # per-window / two-phase attention: not one (T, T) grid per block
        from ..errors import UnsupportedModelError

        raise UnsupportedModelError(f"head_statistics reads one attention matrix over the token grid per block; "
                                    f"{type(model).__name__} ({adapter.family}) does not have one")
    g_sum: Tensor | None = None
    d_sum: Tensor | None = None
    n = 0
    for s in range(0, len(x), batch):
        xb = x[s:s + batch]
        gh, gw = adapter.grid(int_pair(xb.shape[-2:]))
        p = adapter.num_prefix_tokens
        ys, xs = torch.meshgrid(torch.arange(gh), torch.arange(gw), indexing="ij")
        pos = torch.stack([ys.flatten(), xs.flatten()], -1).double()
        dist = torch.cdist(pos, pos)  # (T, T) in patches
        with adapter.session() as rec:
            adapter.forward(xb)
            gs, ds = [], []
            for b in rec.blocks:
                a = recorded(b.attn, "attention").detach().double()  # (B, H, T, T_k)
                gs.append(gini(a).mean(-1).sum(0))
                pa = a[:, :, p:, p:]
                pa = pa / pa.sum(-1, keepdim=True).clamp_min(1e-30)
                ds.append((pa * dist.to(pa.device)).sum(-1).mean(-1).sum(0))
        g, d = torch.stack(gs).cpu(), torch.stack(ds).cpu()
        g_sum = g if g_sum is None else g_sum + g
        d_sum = d if d_sum is None else d_sum + d
        n += len(xb)
    assert g_sum is not None and d_sum is not None
    return {"gini": g_sum / n, "distance": d_sum / n}
