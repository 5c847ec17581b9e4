"""How doubly stochastic is the AHA sorter after its Sinkhorn iterations? (``vitlens.aha.sorter``)

After the last half-step of the iteration every row of ``P`` (rank position) sums to one exactly; the error sits in
the column sums (regions): ``max_k |Σ_j P[j, k] − 1|``. A column that sums to 1.2 is a region that is "deleted" 1.2
times by the end of the curve (the pixel masks are clamped to [0, 1]), one that sums to 0.8 is never fully deleted.

For every region count ``d`` (grids 7², 10², 14², 20², 28²) and temperature ``τ`` the table gives the column-sum
error after the default 30 iterations (max over ``--batch`` score vectors, uniform random scores, min–max scaled as
the sorter does), without noise (evaluation, refinement) and with Gumbel noise (training), and the number of
iterations needed to bring it below 1e-2 (``>N``: not within ``--max-iters``).

Usage::

    python benchmarks/aha_sorter_error.py                           # prints the table
    python benchmarks/aha_sorter_error.py --out docs/benchmarks/aha.md   # and writes its section of that page
"""

from __future__ import annotations

import argparse
import datetime as _dt
import platform
import shlex
import sys
import time
from pathlib import Path

import torch

from vitlens.aha.sorter import anchors, gumbel_noise, scale_scores, sinkhorn_error, soft_sort

START, END = "<!-- aha_sorter_error:start -->", "<!-- aha_sorter_error:end -->"


def iterations_to(scores: torch.Tensor, tau: float, noise: torch.Tensor | None, tol: float, max_iters: int) -> int:
    """Smallest number of iterations after which the column-sum error (max over the batch) is below ``tol``.

    Runs the scaling form of the iteration in float64 (the same iterates as the log form) and checks every step.
    """
    s = scale_scores(scores.double())
    d = s.shape[-1]
    a = anchors(d, dtype=torch.float64)
    la = -(s[:, None, :] - a[None, :, None]) ** 2
    if noise is not None:
        la = la + noise.double()
    la = la / tau
    top = la.reshape(la.shape[0], -1).amax(dim=1)
    spread = float((top - la.reshape(la.shape[0], -1).amin(dim=1)).max())
    if spread > 600:  # exp would underflow in float64: use the log form, checking every step
        for n in range(1, max_iters + 1):
            if float(sinkhorn_error(soft_sort(scores.double(), tau, n, noise=None if noise is None else
                                              noise.double(), method="log"))["col"].max()) < tol:
                return n
        return max_iters + 1
    k = (la - top[:, None, None]).exp()
    r = torch.ones(la.shape[0], d, 1, dtype=torch.float64)
    for n in range(1, max_iters + 1):
        c = 1.0 / torch.bmm(k.transpose(1, 2), r)
        r = 1.0 / torch.bmm(k, c)
        col = (c * torch.bmm(k.transpose(1, 2), r)).squeeze(-1)  # column sums of diag(r) K diag(c)
        if float((col - 1).abs().max()) < tol:
            return n
    return max_iters + 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d", type=int, nargs="+", default=[49, 100, 196, 400, 784], help="region counts")
    p.add_argument("--tau", type=float, nargs="+", default=[1.0, 0.5, 0.3, 0.2, 0.1])
    p.add_argument("--iters", type=int, default=30, help="Sinkhorn iterations (the default of the method)")
    p.add_argument("--batch", type=int, default=4, help="score vectors per cell")
    p.add_argument("--tol", type=float, default=1e-2)
    p.add_argument("--max-iters", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=None, help="Markdown page whose section to write")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    rows = []
    for d in args.d:
        g = torch.Generator().manual_seed(args.seed * 1000 + d)
        scores = torch.rand(args.batch, d, generator=g)
        noise = gumbel_noise((args.batch, d, d), generator=g)
        for tau in args.tau:
            pc = soft_sort(scores, tau, args.iters)
            pn = soft_sort(scores, tau, args.iters, noise=noise)
            clean = float(sinkhorn_error(pc)["col"].max())
            noisy = float(sinkhorn_error(pn)["col"].max())
            noisy_mean = float((pn.sum(dim=1) - 1).abs().mean())
            n_clean = iterations_to(scores, tau, None, args.tol, args.max_iters)
            n_noisy = iterations_to(scores, tau, noise, args.tol, args.max_iters)
            rows.append((d, tau, clean, noisy, noisy_mean, n_clean, n_noisy))
            print(f"d={d:4d} tau={tau:4.2f}  err(no noise)={clean:.2e}  err(gumbel)={noisy:.2e}  "
                  f"(mean {noisy_mean:.2e})  iters<{args.tol:g}: {n_clean} / {n_noisy}", flush=True)

    def fmt_n(n: int) -> str:
        return f">{args.max_iters}" if n > args.max_iters else str(n)

    cmd = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    lines = [
        START,
        "## Sorter: column-sum error of the Sinkhorn iteration",
        "",
        f"Command: `{cmd}` — {_dt.date.today().isoformat()}, torch {torch.__version__}, "
        f"{platform.machine()}, {time.perf_counter() - t0:.0f} s.",
        "",
        f"`max_k |Σ_j P[j,k] − 1|` after {args.iters} iterations (rows are exact), max over {args.batch} uniform "
        f"random score vectors; and the iterations needed to get below {args.tol:g}.",
        "",
        f"| d (grid) | τ | error, no noise | error, Gumbel noise (max / mean over regions) | "
        f"iterations to < {args.tol:g}, no noise | … with noise |",
        "|---|---|---|---|---|---|",
    ]
    for d, tau, clean, noisy, noisy_mean, n_clean, n_noisy in rows:
        side = int(round(d ** 0.5))
        grid = f"{d} ({side}²)" if side * side == d else str(d)
        lines.append(f"| {grid} | {tau:g} | {clean:.1e} | {noisy:.1e} / {noisy_mean:.1e} | {fmt_n(n_clean)} | "
                     f"{fmt_n(n_noisy)} |")
    lines += ["", END]
    print_section(lines, args.out, START, END)
    return 0


def print_section(lines: list[str], out: Path | None, start: str, end: str) -> None:
    """Print the section (``lines`` joined by newlines, from ``start`` to ``end``) and, with ``out``, write it into
    that page (:func:`write_section`). Shared by the AHA benchmark scripts."""
    text = "\n".join(lines)
    print(text)
    if out is not None:
        write_section(out, text, start, end)


def write_section(path: Path, text: str, start: str, end: str) -> None:
    """Replace the text between ``start`` and ``end`` in ``path`` (append if absent; create the page if needed)."""
    page = path.read_text(encoding="utf-8") if path.is_file() else "# AHA benchmarks\n\n"
    if start in page and end in page:
        head, _, rest = page.partition(start)
        _, _, tail = rest.partition(end)
        page = head + text + tail
    else:
        page = page.rstrip("\n") + "\n\n" + text + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())
