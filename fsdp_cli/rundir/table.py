"""The table printed at the end of a run, from its ``summary.json``."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rich.cells import cell_len
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from fsdp_cli.rundir.fit import longest_word, widest_line
from fsdp_cli.rundir.status import STATUS_COLOURS

BORDERS = 7
"""Terminal columns a two-column boxed table spends on its lines (3) and padding (4)."""


def print_summary(summary: Mapping[str, Any], run_dir: Path, console: Console | None = None) -> None:
    """The run in a name/value table fitted to the terminal: values wrap between words; one with
    a word too wide for the table (a checkpoint path) is printed whole on its own line below it,
    for the user to copy."""
    console = console or Console(stderr=False)
    rows = [(name, str(value)) for name, value in _rows(summary, run_dir)]
    names = max(cell_len(name) for name, _ in rows)
    room = console.width - BORDERS - names
    below = [(name, value) for name, value in rows if longest_word(value) > room]
    shown = [(name, "(below)" if (name, value) in below else value) for name, value in rows]
    status = summary.get("status")
    colour = STATUS_COLOURS.get(str(status), "red")
    table = Table(title=f"fsdp-train [{colour}]{status}[/{colour}]", show_header=False, title_justify="left")
    table.add_column(style="bold", width=names)
    table.add_column(width=max(1, min(room, max(widest_line(value) for _, value in shown))))
    for name, value in shown:
        table.add_row(name, escape(value))
    console.print(table)
    for name, value in below:
        console.print(f"{name}: {value}", soft_wrap=True, markup=False, highlight=False)


def _rows(summary: Mapping[str, Any], run_dir: Path) -> list[tuple[str, Any]]:
    pp = "".join(f" {k}={summary[k]}" for k in ("cp", "ep") if summary.get(k))
    pp += f" pp={summary['pp']}" if summary.get("pp") else ""
    layout = f"{summary.get('strategy')}  dp={summary.get('dp')} tp={summary.get('tp')}{pp}  world={summary.get('world_size')}"
    rows = [
        ("layout", layout),
        ("precision", summary.get("precision")),
        ("model", f"{summary.get('model')} ({_count(summary.get('parameters'))} parameters)"),
        ("steps", summary.get("steps")),
        ("final loss", _fmt(summary.get("final_loss"), ".4f")),
        *([("val loss", _fmt(summary["val_loss"], ".4f"))] if summary.get("val_loss") is not None else []),
        _throughput(summary),
        ("step time", _fmt(summary.get("step_time_s"), ".4f", " s")),
        ("TFLOP/s / rank", _fmt(summary.get("tflops_per_s"), ".3g")),
        ("MFU", _fmt(summary.get("mfu"), ".1%")),
        ("peak memory / rank", _bytes(summary.get("peak_memory_bytes"))),
        ("checkpoint", summary.get("checkpoint") or "-"),
        ("run dir", str(run_dir)),
    ]
    if summary.get("error"):
        rows.append(("error", summary["error"]))
    return rows


def _throughput(summary: Mapping[str, Any]) -> tuple[str, str]:
    """tokens/s; samples/s for a module that trained on its own DataLoaders."""
    if summary.get("tokens_per_s") is None and summary.get("samples_per_s") is not None:
        return "samples/s", _fmt(summary["samples_per_s"], ",.1f")
    return "tokens/s", _fmt(summary.get("tokens_per_s"), ",.0f")


def _fmt(value: Any, spec: str, unit: str = "") -> str:
    return "-" if value is None else f"{format(value, spec)}{unit}"


def _count(value: Any) -> str:
    if not isinstance(value, (int, float)):
        return "?"
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if value >= size:
            return f"{value / size:.2f}{unit}"
    return str(int(value))


def _bytes(values: Any) -> str:
    if not values:
        return "-"
    peak = max(values)
    return f"{peak / 2**20:,.0f} MiB (max of {len(values)} ranks)"
