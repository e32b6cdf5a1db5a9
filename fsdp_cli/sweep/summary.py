"""The end of a sweep: a rich table comparing every job, ``sweep_summary.csv`` and
``sweep_summary.json`` in the sweep directory (and the plot, :mod:`fsdp_cli.sweep.plot`).

``python -m fsdp_cli.sweep.summary SWEEP_DIR`` rebuilds them for a finished sweep.
"""

from __future__ import annotations

import csv
import json
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from fsdp_cli.rundir.status import (
    EXIT_CONFIG_ERROR,
    EXIT_FAILED,
    EXIT_OK,
    STATUS_COLOURS,
    STATUS_FAILED,
    STATUS_OK,
    STATUS_SKIPPED,
)
from fsdp_cli.sweep.jobs import COLUMNS, JobResult, collect, counts
from fsdp_cli.sweep.plot import write_png

CSV_FILE = "sweep_summary.csv"
JSON_FILE = "sweep_summary.json"
PNG_FILE = "sweep_summary.png"
LOG_WIDTH = 240


# --------------------------------------------------------------------------- writing


def write_csv(jobs: Iterable[JobResult], path: Path) -> Path:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for job in jobs:
            row = job.row()
            row["overrides"] = " ".join(job.overrides)
            row["peak_memory_mib_per_rank"] = ";".join(f"{m:g}" for m in job.peak_memory_mib_per_rank)
            writer.writerow({k: "" if v is None else v for k, v in row.items()})
    return path


def write_json(jobs: Iterable[JobResult], path: Path) -> Path:
    path.write_text(json.dumps([job.row() for job in jobs], indent=2) + "\n")
    return path


def write_all(jobs: Sequence[JobResult], sweep_dir: Path) -> list[Path]:
    """CSV, JSON and (with matplotlib installed) the PNG in ``sweep_dir``; returns what was written."""
    sweep_dir = Path(sweep_dir)
    written = [write_csv(jobs, sweep_dir / CSV_FILE), write_json(jobs, sweep_dir / JSON_FILE)]
    png = write_png(jobs, sweep_dir / PNG_FILE, title=f"sweep {sweep_dir}")
    if png is not None:
        written.append(png)
    return written


def print_table(jobs: Sequence[JobResult], sweep_dir: Path) -> None:
    """Every job, the fastest as the 1.00x reference, skipped and failed ones with their reason."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    n = counts(jobs)
    title = (
        f"sweep: {len(jobs)} jobs ({n[STATUS_OK]} ok, {n[STATUS_SKIPPED]} skipped, "
        f"{n[STATUS_FAILED]} failed) in {sweep_dir}"
    )
    if none_ran(jobs):
        title += "; no job ran: every job was skipped (reasons below)"
    table = Table(title=escape(title), title_justify="left")
    widest = max((len(w) for j in jobs for w in j.label.split()), default=8)
    for name in ("job", "overrides", "status", "dp", "tp", "strategy", "precision", "steps"):
        left = name in ("overrides", "status", "strategy", "precision")
        # Overrides wrap between words, never inside one (precision=bf16-mixed stays whole).
        width = min(widest, 32) if name == "overrides" else None
        table.add_column(name, justify="left" if left else "right", overflow="fold", min_width=width)
    for name in ("final loss", "tokens/s", "vs best", "step time", "peak mem/rank"):
        table.add_column(name, justify="right")
    table.add_column("reason / error", overflow="fold", min_width=24)
    best = max((j.tokens_per_s for j in jobs if j.tokens_per_s), default=None)
    for j in jobs:
        table.add_row(*_cells(j, best, escape))
    console = Console()
    if not console.is_terminal:  # a log file or a pipe: the whole table, never cropped at 80 columns
        console = Console(width=LOG_WIDTH)
    console.print(table)


def none_ran(jobs: Sequence[JobResult]) -> bool:
    """Every job was skipped before it started: the sweep trained nothing."""
    return bool(jobs) and all(job.status == STATUS_SKIPPED for job in jobs)


def sweep_exit_status(jobs: Sequence[JobResult]) -> int:
    """1 when any job failed; 2 when no job ran (every one skipped, as a single run's config mistake
    exits 2: a script that goes on to read the results must not take the sweep for a success); else 0."""
    if counts(jobs)[STATUS_FAILED]:
        return EXIT_FAILED
    return EXIT_CONFIG_ERROR if none_ran(jobs) else EXIT_OK


def _cells(j: JobResult, best: float | None, escape: Any) -> list[str]:
    colour = STATUS_COLOURS.get(j.status, "red")
    return [
        j.job,
        escape(j.label),
        f"[{colour}]{j.status}[/{colour}]",
        *(_show(v) for v in (j.dp, j.tp, j.strategy, j.precision, j.steps)),
        "-" if j.final_loss is None else f"{j.final_loss:.4f}",
        "-" if j.tokens_per_s is None else f"{j.tokens_per_s:,.0f}",
        "-" if not (j.tokens_per_s and best) else f"{j.tokens_per_s / best:.2f}x",
        "-" if j.step_time_s is None else f"{j.step_time_s * 1e3:.1f} ms",
        "-" if not j.peak_memory_mib_per_rank else f"{max(j.peak_memory_mib_per_rank):,.0f} MiB",
        escape(j.reason or ""),
    ]


def _show(value: Any) -> str:
    return "-" if value is None else str(value)


def report(sweep_dir: Path, since: float | None = None) -> list[JobResult]:
    """Table and files for the sweep in ``sweep_dir``; returns its jobs (none: nothing written)."""
    jobs = collect(sweep_dir, since=since)
    if jobs:
        print_table(jobs, sweep_dir)
        for path in write_all(jobs, sweep_dir):
            print(f"fsdp-train: wrote {path}", flush=True)
    return jobs


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fsdp_cli.sweep.summary SWEEP_DIR``: the table and files of a finished sweep."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m fsdp_cli.sweep.summary SWEEP_DIR", file=sys.stderr)
        return 2
    jobs = report(Path(args[0]))
    if not jobs:
        print(f"error: no job folders in {args[0]}", file=sys.stderr)
        return 2
    return sweep_exit_status(jobs)


if __name__ == "__main__":
    sys.exit(main())
