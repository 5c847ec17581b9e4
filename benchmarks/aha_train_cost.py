"""What one AHA training step costs against its floor: the ``b·k·2·(m − 2)`` forward+backward passes of the target
that the soft curves need (``b`` images, ``k`` classes per image, ``m`` curve points; the endpoints are exact
no-grad probabilities), measured side by side in one run.

Rows (medians over ``--repeats`` interleaved repeats, one thread): the whole step (:func:`training_loss` + backward +
optimiser) and the floor: the same number of target forward+backward passes on a batch of the same images with an
input that requires grad; their ratio is paired per repeat. ``--clock cpu`` (default) times the process's CPU time,
which a loaded machine disturbs less than wall time (one thread: the two agree on an idle machine); ``wall`` the wall
time. ``--parts`` adds a second table: the step's parts that are not target passes, each timed alone on the step's
inputs (÷ the floor, paired), and the rest (step − floor − those parts: masks, blends, the loss, bookkeeping).
Usage: ``python benchmarks/aha_train_cost.py [--m 8] [--batch 8] [--clock cpu|wall] [--parts]``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Any, Callable

import torch

import vitlens
from vitlens.aha.network import AHANet
from vitlens.aha.plan import plan_step
from vitlens.aha.soft_metrics import RegionGrid
from vitlens.aha.sorter import soft_sort
from vitlens.aha.train import AHATrainConfig, ScenesData, mean_std, training_loss
from vitlens.images import data_config
from vitlens.models import get_adapter

#: the parts of a step timed alone (``--parts``), in the order of the table
PARTS = ("clean forward", "decoder fwd+bwd", "sorts fwd+bwd", "optimiser")


def time_parts(net: AHANet, x: Any, r: int, cfg: AHATrainConfig, tau: float, opt: Any,
               clock: Callable[[], float]) -> dict[str, float]:
    """The step's parts that are not target passes, each alone on the step's inputs: the clean forward (features and
    logits of the ``b`` images), the decoder's forward and backward, the two sorts of the step's grid (forward and
    backward) and the optimiser (on a copy, so the run's weights are not touched)."""
    hw = (int(x.shape[-2]), int(x.shape[-1]))
    out = {}
    t0 = clock()
    feats, logits = net.features(x)
    out["clean forward"] = clock() - t0
    t0 = clock()
    maps = net.finish(net.decoder(feats, logits.argmax(-1), hw), cfg.pool)
    (maps * maps).sum().backward()
    out["decoder fwd+bwd"] = clock() - t0
    plan = plan_step(cfg, r, hw)
    scores = RegionGrid(hw, plan.grid, plan.offset).pool(maps.detach()).requires_grad_(True)
    t0 = clock()
    p_desc = soft_sort(scores, tau, cfg.n_iters, descending=True)
    p_asc = soft_sort(scores, tau, cfg.n_iters, descending=False)
    (p_desc.cumsum(1).sum() + (p_asc * p_asc).sum()).backward()
    out["sorts fwd+bwd"] = clock() - t0
    t0 = clock()
    opt.step()
    out["optimiser"] = clock() - t0
    net.decoder.zero_grad(set_to_none=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="shapes-vit")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--m", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    p.add_argument("--warmup", type=int, default=1, help="untimed repeats first")
    p.add_argument("--parts", action="store_true", help="also time the step's other parts alone (second table)")
    args = p.parse_args()
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    model = vitlens.load_model(args.model)
    cfg = AHATrainConfig.preset("tracked", m=args.m, step_sampling="fixed", batch_size=args.batch)
    net = AHANet(model, width=cfg.width)
    opt = torch.optim.AdamW(net.decoder.parameters(), lr=cfg.lr)
    spare = copy.deepcopy(net.decoder)  # the optimiser timed alone steps this copy with made-up gradients
    for q in spare.parameters():
        q.grad = torch.full_like(q, 1e-3)
    spare_opt = torch.optim.AdamW(spare.parameters(), lr=cfg.lr)
    data = ScenesData(10_000, 1, data_config(model).size_hw[0], data_config(model))
    adapter = get_adapter(model)
    norm = mean_std(model)
    n_pass = args.batch * cfg.classes_per_image * 2 * (args.m - 2)
    ref_cache: dict = {}  # what the training loop keeps between steps (the logits on a shared reference)
    times: dict[str, list[float]] = {"step": [], "data": [], "floor": []}
    with adapter.session(capture=False):
        for r in range(args.warmup + args.repeats):
            if r == args.warmup:
                times = {k: [] for k in times}
            t0 = clock()
            items = [data[r * args.batch + i] for i in range(args.batch)]
            times["data"].append(clock() - t0)
            x = torch.stack([it[0] for it in items])
            labels = torch.tensor([it[1] for it in items])
            t0 = clock()
            loss, _, _ = training_loss(net, net.decoder, x, labels, list(range(args.batch)), r, cfg, 0.05, norm,
                                          mean_img=x.mean(0), ref_cache=ref_cache)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            times["step"].append(clock() - t0)
            t0 = clock()
            xs = x.repeat_interleave(n_pass // args.batch, dim=0).clone().requires_grad_(True)
            out = adapter.forward(xs).float().softmax(-1)[:, 0].sum()
            out.backward()
            times["floor"].append(clock() - t0)
            if args.parts:
                for k, v in time_parts(net, x, r, cfg, 0.05, spare_opt, clock).items():
                    times.setdefault(k, []).append(v)
    report(args, times, n_pass)


def report(args: Any, times: dict[str, list[float]], n_pass: int) -> None:
    med = {k: statistics.median(v) for k, v in times.items()}
    ratios = [s / f for s, f in zip(times["step"], times["floor"])]
    print(f"| model | batch | m | target passes per step | step (ms) | floor (ms) | step ÷ floor (paired median) | "
          f"data generation (ms, outside the step) | clock |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(f"| {args.model} | {args.batch} | {args.m} | {n_pass} fwd+bwd | {1e3 * med['step']:.0f} | "
          f"{1e3 * med['floor']:.0f} | {statistics.median(ratios):.2f} [{min(ratios):.2f}–{max(ratios):.2f}] | "
          f"{1e3 * med['data']:.0f} | {args.clock} |")
    if not args.parts:
        return
    n = len(times["step"])
    rest = [times["step"][i] - times["floor"][i] - sum(times[k][i] for k in PARTS) for i in range(n)]
    cells = [statistics.median([times[k][i] / times["floor"][i] for i in range(n)]) for k in PARTS]
    cells.append(statistics.median([rest[i] / times["floor"][i] for i in range(n)]))
    print()
    print("| model | " + " | ".join(f"{k} ÷ floor" for k in PARTS) + " | rest ÷ floor (step − floor − parts) |")
    print("|---|" + "---|" * (len(PARTS) + 1))
    print(f"| {args.model} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")


if __name__ == "__main__":
    main()
