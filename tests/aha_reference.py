"""The AHA training step as it was before the cost work of issue #26, kept as a reference path for the tests.

Restated from the code of that time (``vitlens.aha.loop.training_loss``, ``soft_metrics.soft_curves`` and
``RegionGrid.to_pixels``, ``network.AHADecoder.forward`` with its fusion blocks and residual units): the decoder in
the default (NCHW) memory layout, its class embedding concatenated to every token, its 1×1 convs after the resizes
and a resize to the same size at the head, the pixel
masks by nearest upsampling and a reflect-padded separable convolution, the reference's probabilities from a forward
of the whole reference batch. The parts that did not change (the sorter, the plan, the classes, the references, the
loss) are imported. ``tests/test_aha_numerics.py`` trains with both and compares.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from vitlens.aha.loop import target_probs
from vitlens.aha.network import AHANet
from vitlens.aha.plan import choose_classes, image_noise, plan_step
from vitlens.aha.soft_metrics import (CurveResult, RegionGrid, aha_loss, blend, gaussian_blur, reference,
                                      soft_membership, trapezoid_auc)
from vitlens.aha.sorter import soft_sort


def to_pixels(grid: RegionGrid, regions: Tensor, blur_sigma: float = 1.0) -> Tensor:
    lead = regions.shape[:-1]
    px = regions[..., grid.cell.to(regions.device)].reshape(-1, 1, *grid.hw)
    if blur_sigma > 0:
        px = gaussian_blur(px, blur_sigma)
    return px.clamp(0.0, 1.0).reshape(*lead, *grid.hw)


def _rcu(unit: Any, x: Tensor) -> Tensor:
    return x + unit.conv2(F.relu(unit.conv1(F.relu(x))))


def _fuse(block: Any, x: Tensor, skip: Tensor | None, size: tuple[int, int]) -> Tensor:
    if skip is not None and block.rcu1 is not None:
        x = x + _rcu(block.rcu1, skip)
    x = _rcu(block.rcu2, x)
    x = F.interpolate(x, size=size, mode="bilinear", align_corners=False)
    return block.out(x)


def decoder_forward(dec: Any, features: Sequence[Tensor], classes: Tensor, out_hw: tuple[int, int]) -> Tensor:
    emb = dec.class_embed(classes)
    sizes = dec.level_sizes(features)
    levels = []
    for k, f in enumerate(features):
        b, _, h, w = f.shape
        z = f.to(emb.dtype).permute(0, 2, 3, 1)
        z = torch.cat([z, emb[:, None, None, :].expand(b, h, w, emb.shape[-1])], dim=-1)
        z = F.gelu(dec.mix[k](z)).permute(0, 3, 1, 2)
        z = dec.proj[k](z)
        if (h, w) != sizes[k]:
            z = F.interpolate(z, size=sizes[k], mode="bilinear", align_corners=False)
        levels.append(dec.post[k](z))
    y = None
    for k in range(dec.n_levels - 1, -1, -1):
        nxt = sizes[k - 1] if k > 0 else (2 * sizes[0][0], 2 * sizes[0][1])
        y = _fuse(dec.fuse[k], levels[k] if y is None else y, None if y is None else levels[k], nxt)
    y = dec.head1(y)
    y = F.interpolate(y, size=tuple(out_hw), mode="bilinear", align_corners=False)
    y = dec.head3(F.relu(dec.head2(y)))
    return y[:, 0]


def soft_curves(prob_fn: Any, x: Tensor, ref: Tensor, maps: Tensor, classes: Tensor, grid: RegionGrid,
                fractions: Tensor, tau: float, n_iters: int, noise: Tensor | None, endpoints: tuple[Tensor, Tensor],
                mask_sigma: float) -> CurveResult:
    b = maps.shape[0]
    scores = grid.pool(maps)
    nd = None if noise is None else noise[:, 0]
    na = None if noise is None else noise[:, 1]
    p_desc = soft_sort(scores, tau, n_iters, noise=nd, descending=True)
    p_asc = soft_sort(scores, tau, n_iters, noise=na, descending=False)
    fr = fractions.to(maps.device, maps.dtype)
    inner = fr[1:-1]
    n = inner.shape[0]
    memb = torch.cat([soft_membership(p_desc, inner), soft_membership(p_asc, inner)], dim=1)
    masks = to_pixels(grid, memb, mask_sigma)
    xs = blend(x, masks, ref)
    cls = classes[:, None].expand(b, 2 * n).reshape(-1)
    probs = prob_fn(xs.reshape(b * 2 * n, *x.shape[1:]), cls).reshape(b, 2, n)
    p0 = endpoints[0].to(maps.dtype).reshape(b, 1)
    p1 = endpoints[1].to(maps.dtype).reshape(b, 1)
    dele = torch.cat([p0, probs[:, 0], p1], dim=1)
    ins = torch.cat([p0, probs[:, 1], p1], dim=1)
    return CurveResult(fractions=fr, deletion=dele, insertion=ins,
                       del_auc=trapezoid_auc(dele, fr), ins_auc=trapezoid_auc(ins, fr))


def training_loss(net: AHANet, x: Tensor, labels: Tensor, indices: Sequence[int], step: int, cfg: Any, tau: float,
                  mean_std: tuple[Sequence[float], Sequence[float]], mean_img: Tensor | None = None
                  ) -> tuple[Tensor, dict[str, Tensor]]:
    adapter = net.target_adapter
    hw = (int(x.shape[-2]), int(x.shape[-1]))
    plan = plan_step(cfg, step, hw)
    grid = RegionGrid(hw, plan.grid, plan.offset, device=x.device)
    feats, logits = net.features(x)
    classes = choose_classes(logits, labels, cfg.classes_per_image)
    k = classes.shape[1]
    ref = reference(x, plan.reference, mean_std[0], mean_std[1], mean_image=mean_img)
    with torch.no_grad():
        ref_logits = adapter.forward(ref).float()
    p0 = logits.float().softmax(-1).gather(1, classes)
    p1 = ref_logits.softmax(-1).gather(1, classes)

    def rep(t: Tensor) -> Tensor:
        return t.repeat_interleave(k, dim=0)

    cls = classes.reshape(-1)
    maps = net.finish(decoder_forward(net.decoder, [rep(f) for f in feats], cls, hw), cfg.pool)
    noise = None
    if cfg.noise_scale:
        noise = torch.cat([image_noise(cfg, step, i, k, grid.d) for i in indices]).to(x.device)
    curves = soft_curves(lambda im, c: target_probs(adapter, im, c, cfg.chunk), rep(x), rep(ref), maps, cls, grid,
                         plan.fractions, tau, cfg.n_iters, noise, (p0.reshape(-1), p1.reshape(-1)), cfg.mask_sigma)
    loss_items, parts = aha_loss(curves, maps, cfg.w_del, cfg.w_ins, cfg.w_peak, cfg.peak_kernel)
    return loss_items.mean(), parts
