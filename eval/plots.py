"""PNG plots of benchmark summaries.

Figures are built with `matplotlib.figure.Figure` on an explicit Agg canvas instead of pyplot: no
global figure registry, no backend switching at import, nothing that needs a display, and figures
are freed as soon as they are rendered. Every plot reads only `MethodSummary` fields, so a report
can be re-plotted from its JSON without the raw records.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from eval.summary import MethodSummary, variant


def _figure(width: float = 7.0, height: float = 4.0) -> tuple[Figure, object]:
    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def to_png(fig: Figure) -> bytes:
    """Render a figure to PNG bytes (written atomically by the caller)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def plot_speedup(summaries: Sequence[MethodSummary]) -> Figure:
    """Bars of tokens/s speedup per method over the plain baseline and, beside them, over HF."""
    fig, ax = _figure()
    names = [s.method for s in summaries]
    x = range(len(names))
    groups = [("speedup", "baseline"), ("speedup_hf", "hf_baseline")]
    present = [(attr, ref) for attr, ref in groups if any(getattr(s, attr) is not None for s in summaries)]
    width = 0.8 / max(len(present), 1)
    for j, (attr, ref) in enumerate(present):
        values = [getattr(s, attr) or 0.0 for s in summaries]
        offset = (j - (len(present) - 1) / 2) * width
        bars = ax.bar([i + offset for i in x], values, width, label=f"vs {getattr(summaries[0], ref)}")
        ax.bar_label(bars, labels=[f"{v:.2f}x" if v else "" for v in values], fontsize=8)
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xticks(list(x), names, rotation=20, ha="right")
    ax.set_ylabel("speedup (ratio of tokens/s)")
    ax.set_title("Speedup per method")
    if present:
        ax.legend()
    return fig


def plot_acceptance(summaries: Sequence[MethodSummary]) -> Figure:
    """Acceptance rate per draft position, one line per speculative method (tau in the legend)."""
    fig, ax = _figure()
    speculative = [s for s in summaries if s.accept_rates]
    for s in speculative:
        positions = range(1, len(s.accept_rates) + 1)
        ax.plot(positions, s.accept_rates, marker="o", label=f"{s.method} (tau {s.tau:.2f})")
    ax.set_xlabel("draft position i")
    ax.set_ylabel("acceptance rate (cycles reaching i)")
    ax.set_ylim(0.0, 1.05)
    ax.set_title("Acceptance per draft position")
    if speculative:
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no speculative methods", ha="center", va="center", transform=ax.transAxes)
    return fig


def plot_draft_length(summaries: Sequence[MethodSummary]) -> Figure:
    """Tokens/s against draft length k.

    Fixed-k chains (every cycle drafted the same k) form a line per numerics (bf16, +q4, ...); trees are
    points at their depth; tuned methods, whose k varies
    per cycle, are a marker at their cycle-weighted mean k with a bar over the range of k they used,
    and the bars underneath (right axis) show how often each k was chosen. Methods without drafting
    (plain, HF) are horizontal reference lines.
    """
    fig, ax = _figure()
    fixed, tuned = [], []
    for s in summaries:
        if not s.cycles:
            ax.axhline(s.tokens_per_s, linestyle="--", linewidth=0.8, color="grey")
            ax.annotate(
                s.method,
                (0.99, s.tokens_per_s),
                xycoords=("axes fraction", "data"),
                fontsize=8,
                va="bottom",
                ha="right",
            )
            continue
        used = [k for k, n in enumerate(s.draft_length_counts) if n]
        if "tree" in s.method:  # its draft length is the tree's depth: a point of its own, on no line
            ax.plot([s.mean_draft_length], [s.tokens_per_s], marker="^", linestyle="none", color="grey")
            ax.annotate(s.method, (s.mean_draft_length, s.tokens_per_s), fontsize=8,
                        textcoords="offset points", xytext=(4, 4))  # fmt: skip
            continue
        (fixed if len(used) == 1 else tuned).append((s, used))
    lines = {}  # one fixed-k line per numerics (bf16, +q4, -compiled, ...): a line joins like with like
    for s, used in sorted(fixed, key=lambda item: item[1][0]):
        lines.setdefault(variant(s.method), []).append((used[0], s))
    for i, (suffix, points) in enumerate(lines.items()):
        ax.plot([k for k, _ in points], [s.tokens_per_s for _, s in points], marker="o", color=f"C{i}",
                label="fixed k" + (f" ({suffix})" if suffix else ""))  # fmt: skip
        for k, s in points:
            ax.annotate(s.method, (k, s.tokens_per_s), fontsize=8, textcoords="offset points", xytext=(4, 4))
    if tuned:
        share_ax = ax.twinx()
        share_ax.set_ylabel("share of cycles (tuned runs)")
        width = 0.8 / len(tuned)
        for j, (s, used) in enumerate(tuned, start=1):
            mean_k = s.mean_draft_length
            ax.errorbar(
                [mean_k],
                [s.tokens_per_s],
                xerr=[[mean_k - min(used)], [max(used) - mean_k]],
                marker="*",
                markersize=12,
                capsize=4,
                color=f"C{j + len(lines)}",
                label=f"{s.method} (tuned, mean k {mean_k:.2f})",
            )
            shares = [s.draft_length_counts[k] / s.cycles for k in used]
            offset = (j - 1 - (len(tuned) - 1) / 2) * width
            share_ax.bar([k + offset for k in used], shares, width, alpha=0.25, color=f"C{j + len(lines)}")
        share_ax.set_ylim(0.0, 1.0)
        # Draw the main axes (points, legend) above the share bars.
        ax.set_zorder(share_ax.get_zorder() + 1)
        ax.patch.set_visible(False)
    ax.set_xlabel("draft length k")
    ax.set_ylabel("tokens/s")
    ax.set_title("Tokens/s vs draft length")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylim(bottom=0.0)
    if fixed or tuned:
        ax.legend(loc="upper left", fontsize=8)
    return fig
