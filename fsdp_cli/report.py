"""Run outputs: ``metrics.jsonl``, ``summary.json`` and the rich summary table.

No torch or lightning here: the parent process reads and prints these after the ranks exit.
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
CONFIG_FILE = "config.yaml"

STATUS_OK, STATUS_FAILED, STATUS_PREEMPTED = "ok", "failed", "preempted"
EXIT_PREEMPTED = 143  # 128 + SIGTERM: what schedulers expect from a job that was told to stop


def global_rank() -> int:
    """This process's rank from torchrun's or SLURM's environment (0 outside a job)."""
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


def steady_state(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows after warm-up: the first fifth (at least the first row) measures compilation and caches."""
    if len(rows) < 2:
        return rows
    return rows[max(1, len(rows) // 5) :]


def median_of(rows: Iterable[Mapping[str, Any]], key: str) -> float | None:
    values = [float(r[key]) for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def write_summary(run_dir: Path, summary: Mapping[str, Any]) -> None:
    path = Path(run_dir) / SUMMARY_FILE
    tmp = path.with_name(f"{path.name}.{os.getpid()}.partial")  # ranks may race on a failed run
    tmp.write_text(json.dumps(dict(summary), indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, path)


def read_summary(run_dir: Path) -> dict[str, Any] | None:
    path = Path(run_dir) / SUMMARY_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def print_summary(summary: Mapping[str, Any], run_dir: Path) -> None:
    """The table shown at the end of a run."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    status = summary.get("status")
    colour = {"ok": "green", "preempted": "yellow"}.get(str(status), "red")
    table = Table(title=f"fsdp-train [{colour}]{status}[/{colour}]", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    layout = f"{summary.get('strategy')}  dp={summary.get('dp')} tp={summary.get('tp')}  world={summary.get('world_size')}"
    rows = [
        ("layout", layout),
        ("precision", summary.get("precision")),
        ("model", f"{summary.get('model')} ({_count(summary.get('parameters'))} parameters)"),
        ("steps", summary.get("steps")),
        ("final loss", _fmt(summary.get("final_loss"), ".4f")),
        ("tokens/s", _fmt(summary.get("tokens_per_s"), ",.0f")),
        ("step time", _fmt(summary.get("step_time_s"), ".4f", " s")),
        ("peak memory / rank", _bytes(summary.get("peak_memory_bytes"))),
        ("checkpoint", summary.get("checkpoint") or "-"),
        ("run dir", str(run_dir)),
    ]
    if summary.get("error"):
        rows.append(("error", summary["error"]))
    for name, value in rows:
        table.add_row(name, escape(str(value)))
    Console(stderr=False).print(table)


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
