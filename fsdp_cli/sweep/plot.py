"""``sweep_summary.png``: the loss curve of every job on one axis (left) and tokens/s per job as
bars (right), so a sweep over layouts is read at a glance.

matplotlib is an optional extra (``pip install ".[plot]"``): imported here only, and
without it the PNG is skipped with a one-line notice. The object API (``Figure``), not pyplot: no
global figure state and no GUI backend, safe in any process.
"""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fsdp_cli.extras import install_hint
from fsdp_cli.rundir.status import STATUS_OK, STATUS_SKIPPED
from fsdp_cli.sweep.jobs import JobResult, counts

MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def write_png(jobs: Sequence[JobResult], path: Path, title: str = "sweep") -> Path | None:
    """Draw the plot into ``path``; None (after a one-line notice) when matplotlib is missing."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        print(
            f"fsdp-train: note: {path.name} not written: matplotlib is not installed ({install_hint('plot')})",
            file=sys.stderr,
            flush=True,
        )
        return None
    n = len(jobs)
    fig = Figure(figsize=(15, max(5.0, 1.6 + 0.45 * n)), layout="constrained")
    FigureCanvasAgg(fig)
    loss_ax, bar_ax = fig.subplots(1, 2)
    colours = _colours(n)
    _loss_curves(loss_ax, jobs, colours)
    _legend(fig, loss_ax, n)
    _throughput_bars(bar_ax, jobs, colours)
    summary = ", ".join(f"{count} {status}" for status, count in counts(jobs).items())
    fig.suptitle(f"{title}: {n} jobs ({summary})", fontsize=11)
    fig.savefig(path, dpi=110)
    return path


def _loss_curves(ax: Any, jobs: Sequence[JobResult], colours: list[Any]) -> None:
    """Jobs that ran: solid; failed ones that logged steps: dashed, an X where they stopped; jobs
    without a step share one legend entry per kind."""
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    skipped = []
    for i, (j, colour) in enumerate(zip(jobs, colours)):
        name = f"#{j.job} {_short(j.label, 64)}"
        if j.losses:
            # Layouts often reach the same losses: earlier jobs are drawn wider, with another
            # marker, so a curve hidden under a later one still shows around it.
            width = 1.5 + 3.0 * (len(jobs) - 1 - i) / max(len(jobs) - 1, 1)
            _curve(ax, j, colour, name, width=width, marker=MARKERS[i % len(MARKERS)])
        elif j.status == STATUS_SKIPPED:
            skipped.append(f"#{j.job}")
        else:
            ax.add_line(Line2D([], [], color=colour, lw=0, marker="X", ms=8, label=f"{name}  ({j.status})"))
    if skipped:
        label = f"skipped (no steps): {_short(' '.join(skipped), 60)}"
        ax.add_line(Line2D([], [], color="grey", lw=0, marker="$\\varnothing$", ms=9, label=label))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    validated = any(j.val_losses for j in jobs)
    ax.set_ylabel("training loss" + (" (line); validation loss (hollow, dotted)" if validated else ""))
    ax.set_title("loss per step")
    ax.grid(True, alpha=0.3)
    if not any(j.losses for j in jobs):
        ax.text(0.5, 0.5, "no job logged a step", ha="center", va="center", transform=ax.transAxes)


def _curve(ax: Any, j: JobResult, colour: Any, name: str, *, width: float, marker: str) -> None:
    steps, losses = zip(*j.losses)
    ok = j.status == STATUS_OK
    ax.plot(
        steps,
        losses,
        color=colour,
        lw=width,
        alpha=0.85,
        ls="-" if ok else "--",
        marker=marker if len(steps) <= 30 else None,
        ms=2 + width,
        label=name if ok else f"{name}  ({j.status} after step {steps[-1]})",
    )
    if not ok:
        ax.plot(steps[-1], losses[-1], marker="X", ms=11, color=colour, mec="black", ls="none")
    if j.val_losses:  # each validation: a hollow marker joined by a dotted line, in the job's colour
        val_steps, val_losses = zip(*j.val_losses)
        ax.plot(val_steps, val_losses, color=colour, ls=":", lw=1.2, marker="o", mfc="white", ms=6)


def _legend(fig: Any, ax: Any, n: int) -> None:
    # Below both plots, as a figure legend: an axes legend would cover curves or squeeze the axes.
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        fig.legend(
            handles,
            labels,
            loc="outside lower left",
            ncol=1 if n <= 6 else 2 if n <= 30 else 3,
            fontsize=8,
            frameon=False,
            title="job (the overrides that differ between jobs)",
            title_fontsize=8,
            alignment="left",
        )


def _throughput_bars(ax: Any, jobs: Sequence[JobResult], colours: list[Any]) -> None:
    """One bar row per job, first job on top; skipped and failed rows say why instead of a value."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    n = len(jobs)
    ys = list(range(n))[::-1]
    values = [j.tokens_per_s or 0.0 for j in jobs]
    top = max(values, default=0.0) or 1.0
    bars = ax.barh(ys, values, height=0.6, color=colours, edgecolor="black", linewidth=0.6)
    for bar, j, y, value in zip(bars, jobs, ys, values):
        if j.status == STATUS_OK and j.tokens_per_s is not None:
            ax.text(value + top * 0.01, y, f"{value:,.0f}", va="center", fontsize=8)
            continue
        bar.set_hatch("//")
        bar.set_alpha(0.6)
        colour = "#8a6d00" if j.status == STATUS_SKIPPED else "#b00000"
        text = f"{j.status.upper()}: {_short(j.reason or '', 64)}"
        ax.text(value + top * 0.01, y, text, va="center", fontsize=8, color=colour, style="italic")
    ax.set_yticks(ys, [_wrap(f"#{j.job} {j.label}", 34) for j in jobs], fontsize=8)
    ax.set_ylim(-0.6, n - 0.4)
    ax.set_xlim(0, top * 1.7)  # room for the value and reason labels
    ax.xaxis.set_major_locator(MaxNLocator(nbins=5))
    ax.xaxis.set_major_formatter(FuncFormatter(_si))
    ax.set_xlabel("tokens/s (median over steady-state steps)")
    ax.set_title("throughput per job")
    ax.grid(True, axis="x", alpha=0.3)


def _colours(n: int) -> list[Any]:
    if n <= 10:
        return [f"C{i}" for i in range(n)]
    from matplotlib import colormaps

    if n <= 20:
        return [colormaps["tab20"](i) for i in range(n)]
    return [colormaps["turbo"](i / (n - 1)) for i in range(n)]


def _si(value: float, _pos: Any = None) -> str:
    for unit, size in (("M", 1e6), ("k", 1e3)):
        if abs(value) >= size:
            return f"{value / size:g}{unit}"
    return f"{value:g}"


def _wrap(text: str, width: int) -> str:
    lines = textwrap.wrap(text, width) or [text]
    return "\n".join(lines[:2]) + ("…" if len(lines) > 2 else "")


def _short(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"
