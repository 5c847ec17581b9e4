"""The ranking table of a benchmark run as text for a paper: Markdown (``summary.md``) and LaTeX (``summary.tex``).

Both show per method (display name, settings in words) and per quality column the mean with its 95% interval
(``0.444 ± 0.137`` for a mean, ``0.83 [0.44, 0.97]`` Wilson for a proportion), the best value of each column and the
methods statistically tied with it (:mod:`vitlens.bench.report_stats`), then the cost per image. Markdown: best in
bold, tied in italics; LaTeX: best ``\\textbf``, tied ``\\underline`` (a ``tabular`` with ``booktabs`` rules).
"""

from __future__ import annotations

import math
from typing import Any

from ..explainers.registry import display_label, is_baseline
from .naming import Column
from .report_stats import PAIRED_TEST

__all__ = ["cell_text", "mark", "markdown_table", "latex_table", "table_note", "markdown_escape", "latex_escape"]


def cell_text(v: dict[str, Any] | None, latex: bool = False) -> str:
    """``'0.444 ± 0.137'`` (t interval) or ``'0.833 [0.436, 0.970]'`` (Wilson); ``'—'`` for no value."""
    if not isinstance(v, dict) or math.isnan(float(v["mean"])):
        return "--" if latex else "—"
    mean = float(v["mean"])
    pm = r"$\pm$" if latex else "±"
    if v.get("interval") == "wilson":
        return f"{mean:.3f} [{float(v['low']):.3f}, {float(v['high']):.3f}]"
    ci = float(v["ci95"])
    return f"{mean:.3f}" + ("" if math.isnan(ci) else f" {pm} {ci:.3f}")


def mark(v: Any, best: float | None) -> str:
    """``'best'``, ``'tied'`` (statistically tied with the best) or ``''`` for a table cell. Summaries written
    before the paired test (no ``best`` flag) mark the best mean only."""
    if not isinstance(v, dict):
        return "best" if best is not None and v is not None and float(v) == best else ""
    if "best" in v:
        return "best" if v["best"] else ("tied" if v.get("tied_with_best") else "")
    return "best" if best is not None and float(v["mean"]) == best else ""


def _cost(row: dict[str, Any], key: str) -> float:
    v = row.get(key)
    return float("nan") if v is None else float(v["mean"] if isinstance(v, dict) else v)


def table_note(headline: Column | None, latex: bool = False, markdown: bool = False) -> str:
    """What the marks and intervals mean (the sentence under the table); ``markdown``: the headline's name and
    settings escaped for Markdown (:func:`markdown_escape`)."""
    best, tied = (r"\textbf{bold}", r"\underline{underlined}") if latex else ("**bold**", "*italic*")
    ranked = f"Ranked by {headline.title}" + (f" ({headline.settings})" if headline.settings else "") + "; " \
        if headline else ""
    if markdown:
        ranked = markdown_escape(ranked)
    return (f"{ranked}mean ± 95% interval over images (Student t; Wilson score interval [low, high] for "
            f"proportions); {best}: best in its column; {tied}: statistically tied with it ({PAIRED_TEST}); "
            "↑ higher is better, ↓ lower is better; cost: passes through the model and median ms per image "
            "(baselines are never marked).")


def markdown_table(rows: list[dict[str, Any]], cols: list[Column], best: dict[str, float],
                   headline: Column | None) -> str:
    """The ranked table in Markdown, with its note."""
    head = ["rank", "method"] + [markdown_escape(c.title + (f" ({c.settings})" if c.settings else "")) for c in cols]
    head += ["fwd/bwd passes", "ms per image"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for k, row in enumerate(rows, start=1):
        cells = [str(k), markdown_escape(display_label(str(row["method"])))]
        for c in cols:
            text, how = cell_text(row.get(c.key)), mark(row.get(c.key), best.get(c.key))
            cells.append(f"**{text}**" if how == "best" else f"*{text}*" if how == "tied" else text)
        ms = _cost(row, "ms_per_image")
        ms_text = f"{ms:.1f}"
        if not is_baseline(str(row["method"])) and best.get("ms_per_image") == ms:
            ms_text = f"**{ms_text}**"
        cells += [f"{_cost(row, 'forward_passes'):g}/{_cost(row, 'backward_passes'):g}", ms_text]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\n" + table_note(headline, markdown=True)


#: Markdown's inline syntax characters (emphasis, code, links, table cells, escapes): backslash-escaped
_MARKDOWN_SPECIAL = set("\\`*_[]|")


def markdown_escape(text: str) -> str:
    """Plain text (a method's or metric's name and settings, which come from the user) as Markdown that shows it
    literally: ``&``, ``<`` and ``>`` as HTML entities (no raw HTML, no autolinks), the inline syntax characters
    ``\\ ` * _ [ ] |`` backslash-escaped (no emphasis, code, links or extra table cells), line breaks as spaces."""
    import html

    out = html.escape(" ".join(str(text).splitlines()), quote=False)
    return "".join("\\" + ch if ch in _MARKDOWN_SPECIAL else ch for ch in out)


_LATEX_SPECIAL = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
                  "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}",
                  "<": r"\textless{}", ">": r"\textgreater{}", "|": r"\textbar{}"}
_LATEX_UNICODE = {"×": r"$\times$", "−": "$-$", "±": r"$\pm$", "↑": r"$\uparrow$", "↓": r"$\downarrow$",
                  "≈": r"$\approx$", "α": r"$\alpha$", "β": r"$\beta$", "γ": r"$\gamma$", "ε": r"$\varepsilon$",
                  "σ": r"$\sigma$", "τ": r"$\tau$", "λ": r"$\lambda$", "²": r"$^2$", "—": "---", "–": "--"}


def latex_escape(text: str) -> str:
    """Plain text as LaTeX: special characters escaped, the symbols display names use as math."""
    return "".join(_LATEX_SPECIAL.get(ch) or _LATEX_UNICODE.get(ch) or ch for ch in str(text))


#: short column heads of the single-column LaTeX table (the legend under it spells them out)
_SHORT = {"deletion": "Del.", "insertion": "Ins.", "insertion − deletion": "I−D", "positive perturbation": "Pos.",
          "negative perturbation": "Neg.", "negative − positive": "N−P", "violation": "Viol.",
          "pointing game": "PG", "relevance in object": "Obj.", "relevance on evidence": "On ev.",
          "pointing at evidence": "Ev. PG", "evidence rank AUC": "Ev. AUC", "pixel accuracy": "PA",
          "IoU object": "IoU obj.", "IoU background": "IoU bg.", "mIoU": "mIoU", "average precision": "AP"}


def _short(c: Column) -> str:
    return _SHORT.get(c.name, c.name if len(c.name) <= 8 else c.name[:7] + ".")


def _stack(*lines: str) -> str:
    """Lines stacked in one cell (a nested ``tabular``), centred."""
    return "\\begin{tabular}[c]{@{}c@{}}" + "\\\\[-1pt]".join(lines) + "\\end{tabular}"


def _narrow_cell(v: dict[str, Any] | None, how: str) -> str:
    """The mean (bold when best, underlined when tied) over its interval in small type, leading zeros dropped:
    ``0.444`` / ``±.137``; ``0.83`` / ``[.44,.97]`` for a proportion."""
    if not isinstance(v, dict) or math.isnan(float(v["mean"])):
        return "--"

    def short(x: float, digits: int) -> str:
        text = f"{x:.{digits}f}"
        if float(text) == 1.0:
            return "1"
        return text[1:] if text.startswith("0.") else text.replace("-0.", "$-$.").replace("-", "$-$")

    mean = float(v["mean"])
    wilson = v.get("interval") == "wilson"
    top = f"{mean:.2f}" if wilson else f"{mean:.3f}".replace("-", "$-$")
    top = f"\\textbf{{{top}}}" if how == "best" else f"\\underline{{{top}}}" if how == "tied" else top
    if wilson:
        return _stack(top, f"{{\\scriptsize[{short(float(v['low']), 2)},{short(float(v['high']), 2)}]}}")
    ci = float(v["ci95"])
    return top if math.isnan(ci) else _stack(top, f"{{\\scriptsize$\\pm${short(ci, 3)}}}")


def _method_cell(label: str, wide: bool) -> str:
    """A method label's display name; in the one-column table a long one over two lines, its settings under its
    name (``AHA`` / ``(T = 0)``, ``Input ×`` / ``Gradient``)."""
    import textwrap

    from ..explainers.registry import display_parts

    name, settings = display_parts(label)
    if wide or len(display_label(label)) <= 10:
        lines = [display_label(label)]
    elif settings:
        lines = [name, f"({settings})"]
    else:
        lines = textwrap.wrap(name, max(10, (len(name) + 1) // 2))
    cells = [latex_escape(line) for line in lines]
    return cells[0] if len(cells) == 1 else "\\begin{tabular}[c]{@{}l@{}}" + "\\\\[-1pt]".join(cells) + \
        "\\end{tabular}"


def _head(c: Column, wide: bool) -> str:
    """A column head: short (``I−D ↑``) in the one-column table, the plain name over two lines in the wide one."""
    arrow = "↑" if c.higher_is_better else "↓"
    if not wide:
        return latex_escape(f"{_short(c)} {arrow}")
    import textwrap

    return _stack(*(latex_escape(line) for line in textwrap.wrap(f"{c.name} {arrow}", 12)))


def latex_table(rows: list[dict[str, Any]], cols: list[Column], best: dict[str, float],
                headline: Column | None, wide: bool = False) -> str:
    """The ranked table as a LaTeX ``table`` float (``booktabs`` rules; ``graphicx``), with a legend under it.

    By default it fits ``\\linewidth`` of one column of a two-column paper: ``\\footnotesize``, short column heads
    (``I−D ↑``) spelled out with their settings in the legend, intervals in small type; should a long method name
    still make it wider, it is scaled down to the line width (never up). ``wide``: a ``table*`` across both
    columns with full heads, fitted to the text width the same way."""
    heads = [_head(c, wide) for c in cols]
    head = ["Method"] + heads + ([_stack("Fwd/bwd", "passes"), _stack("ms /", "image")] if wide else ["F/B", "ms"])
    spec = "l" + "c" * len(cols) + "rr"
    env = "table*" if wide else "table"
    lines = ["% " + line for line in _wrap(table_note(headline, latex=True))]
    lines += ["% needs \\usepackage{booktabs} and \\usepackage{graphicx}; add \\caption{...} and \\label{...} "
              "inside the float", f"% {'wide: both columns (table*)' if wide else 'one column; the wide variant: vitlens report RUN --format latex --wide'}",
              f"\\begin{{{env}}}[t]", "\\centering", "\\small" if wide else "\\footnotesize",
              "\\setlength{\\tabcolsep}{" + ("4pt" if wide else "2pt") + "}",
              "\\sbox0{\\begin{tabular}{" + spec + "}", "\\toprule", " & ".join(head) + r" \\", "\\midrule"]
    for row in rows:
        cells = [_method_cell(str(row["method"]), wide)]
        for c in cols:
            v = row.get(c.key)
            how = mark(v, best.get(c.key))
            cells.append(_narrow_cell(v, how))
        ms = _cost(row, "ms_per_image")
        ms_text = "--" if math.isnan(ms) else f"{ms:.1f}" if wide or ms < 100 else f"{ms:.0f}"
        if not is_baseline(str(row["method"])) and best.get("ms_per_image") == ms:
            ms_text = f"\\textbf{{{ms_text}}}"
        cells += [f"{_cost(row, 'forward_passes'):g}/{_cost(row, 'backward_passes'):g}", ms_text]
        lines.append(" & ".join(cells) + r" \\")
    lines += ["\\bottomrule", "\\end{tabular}}%",
              "\\ifdim\\wd0>\\linewidth\\resizebox{\\linewidth}{!}{\\usebox0}\\else\\usebox0\\fi",
              "\\par\\smallskip", "\\begin{minipage}{\\linewidth}\\scriptsize", *_wrap(_legend(cols, headline, wide), 110),
              "\\end{minipage}", f"\\end{{{env}}}"]
    return "\n".join(lines)


def _legend(cols: list[Column], headline: Column | None, wide: bool) -> str:
    """The legend under the LaTeX table: the short heads spelled out with their settings, then the note."""
    parts = []
    for c in cols:
        settings = f" ({c.settings})" if c.settings else ""
        parts.append(f"{c.name}{settings}" if wide else f"{_short(c)}: {c.name}{settings}")
    if not wide:
        parts.append("F/B: forward/backward passes per image; ms: median milliseconds per image")
    note = latex_escape(table_note(headline)).replace("**bold**", "\\textbf{bold}") \
        .replace("*italic*", "\\underline{underlined}")
    return latex_escape("; ".join(parts) + (". " if parts else "")) + note


def _wrap(text: str, width: int = 110) -> list[str]:
    import textwrap

    return textwrap.wrap(text, width)


def headline_sentence(rows: list[dict[str, Any]], headline: Column | None) -> str:
    """The report's answer in one or two sentences: the best method by the headline column, and which methods are
    statistically tied with it (or that every other one is worse), naming the test."""
    if headline is None or not rows or not isinstance(rows[0].get(headline.key), dict):
        return ""
    top = rows[0][headline.key]
    first = f"{display_label(str(rows[0]['method']))} has the best {headline.name} ({cell_text(top)})"
    scored = [r for r in rows[1:] if isinstance(r.get(headline.key), dict)]
    if "tied_with_best" not in top or not scored:
        return first + "."
    tied = [r for r in scored if r[headline.key].get("tied_with_best")]
    if not tied:
        return f"{first}; every other method scores lower ({PAIRED_TEST})."
    names = "; ".join(f"{display_label(str(r['method']))}, p = {float(r[headline.key]['p_vs_best']):.2g}"
                      for r in tied)
    return (f"{first}, but it is not significantly better than {len(tied)} other method"
            f"{'s' if len(tied) > 1 else ''} ({names}; {PAIRED_TEST}): these are tied with it.")
