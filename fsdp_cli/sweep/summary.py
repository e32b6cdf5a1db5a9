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

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from fsdp_cli.rundir.fit import fit_widths
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


HEADERS = (
    "job",
    "overrides",
    "status",
    "dp",
    "tp",
    "strategy",
    "precision",
    "steps",
    "final loss",
    "tokens/s",
    "vs best",
    "step time",
    "peak mem/rank",
    "reason / error",
)
WRAPPING = ("overrides", "reason / error")
"""The columns that wrap between words; the others are as wide as their widest cell."""
STACKED = (
    ("job", "overrides", "status", "dp", "tp", "strategy", "precision", "reason / error"),
    ("job", "steps", "final loss", "tokens/s", "vs best", "step time", "peak mem/rank"),
)
"""Where the whole table does not fit: the same columns in two tables, one above the other."""
GAP = 2
"""Blank columns between two of the table's columns (one of padding either side of the line)."""
LEFT = ("overrides", "status", "strategy", "precision", "reason / error")
PIPELINE = "pp"
"""The pipeline-parallel column, before ``dp``: shown when a job of the sweep has pp > 1."""


VALIDATION = "val loss"
"""The validation-loss column, after ``final loss``: shown when a job of the sweep validated."""


def _shown(headers: Sequence[str], *, with_pp: bool, with_val: bool) -> tuple[str, ...]:
    """``headers`` with the columns this sweep's jobs need: ``pp`` before ``dp``, ``val loss``
    after ``final loss`` (each where the headers have that neighbour)."""
    out: list[str] = []
    for header in headers:
        if header == "dp" and with_pp:
            out.append(PIPELINE)
        out.append(header)
        if header == "final loss" and with_val:
            out.append(VALIDATION)
    return tuple(out)


def pipelined(jobs: Sequence[JobResult]) -> bool:
    return any((j.pp or 1) > 1 for j in jobs)


def validated(jobs: Sequence[JobResult]) -> bool:
    return any(j.val_loss is not None for j in jobs)


def print_table(jobs: Sequence[JobResult], sweep_dir: Path, console: Console | None = None) -> None:
    """Every job, the fastest as the 1.00x reference, skipped and failed ones with their reason:
    one table where it fits the terminal without cutting a word, else one block per job."""
    console = console or _console()
    n = counts(jobs)
    title = (
        f"sweep: {len(jobs)} jobs ({n[STATUS_OK]} ok, {n[STATUS_SKIPPED]} skipped, "
        f"{n[STATUS_FAILED]} failed) in {sweep_dir}"
    )
    if none_ran(jobs):
        title += "; no job ran: every job was skipped (reasons below)"
    _print_whole(console, Text(title))
    best = max((j.tokens_per_s for j in jobs if j.tokens_per_s), default=None)
    shown = {"with_pp": pipelined(jobs), "with_val": validated(jobs)}
    rows = [_cells(j, best, **shown) for j in jobs]
    headers = _shown(HEADERS, **shown)
    stacked = [_shown(group, **shown) for group in STACKED]
    for groups in ([headers], stacked):
        tables = [_table(jobs, rows, group, console.width, headers) for group in groups]
        if all(table is not None for table in tables):
            console.print(*tables)
            return
    for job, row in zip(jobs, rows):
        _print_stacked(console, job, row, headers)


def _console() -> Console:
    console = Console()
    # A log file or a pipe: the whole table on one line per row, never stacked at 80 columns.
    return console if console.is_terminal else Console(width=LOG_WIDTH)


def _table(
    jobs: Sequence[JobResult],
    rows: Sequence[Sequence[str]],
    headers: Sequence[str],
    width: int,
    all_headers: Sequence[str] = HEADERS,
) -> Table | None:
    """The ``headers`` columns (of the rows' ``all_headers``) of every job (a skipped job has no
    numbers to show), or None where they do not fit ``width`` without cutting a word."""
    index = [list(all_headers).index(h) for h in headers]
    numbers_only = "reason / error" not in headers
    keep = [i for i, job in enumerate(jobs) if not (numbers_only and job.status == STATUS_SKIPPED)]
    cells = [[rows[r][i] for i in index] for r in keep]
    widths = fit_widths(
        list(zip(headers, *cells)), [h in WRAPPING for h in headers], width - GAP * (len(headers) - 1)
    )
    if widths is None:
        return None
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True)
    for header, column_width in zip(headers, widths):
        justify = "left" if header in LEFT else "right"
        table.add_column(header, justify=justify, width=column_width, overflow="fold")
    for r, row in zip(keep, cells):
        colour = STATUS_COLOURS.get(jobs[r].status, "red")
        table.add_row(*(Text(cell, style=colour) if h == "status" else cell for h, cell in zip(headers, row)))
    return table


def _print_stacked(
    console: Console, job: JobResult, row: Sequence[str], headers: Sequence[str] = HEADERS
) -> None:
    """One job as a block: a skipped job on one line with its reason; else every value that is
    not "-" on a line of its own, so nothing is cut however narrow the terminal."""
    colour = STATUS_COLOURS.get(job.status, "red")
    head = Text.assemble(f"job {job.job}  ", (job.status, colour), f"  {job.label}")
    if job.status == STATUS_SKIPPED:
        _print_whole(console, head.append(f": {job.reason or ''}"))
        return
    _print_whole(console, head)
    for header, value in zip(headers[3:], row[3:]):
        if value not in ("-", ""):
            _print_whole(console, Text(f"    {header}: {value}"))


def _print_whole(console: Console, text: Text) -> None:
    """Wrapped between words; a word wider than the terminal stays whole on its own line (a path
    to copy), for the terminal to wrap."""
    console.print(text, overflow="ignore", crop=False)


def none_ran(jobs: Sequence[JobResult]) -> bool:
    """Every job was skipped before it started: the sweep trained nothing."""
    return bool(jobs) and all(job.status == STATUS_SKIPPED for job in jobs)


def sweep_exit_status(jobs: Sequence[JobResult]) -> int:
    """1 when any job failed; 2 when no job ran (every one skipped, as a single run's config mistake
    exits 2: a script that goes on to read the results must not take the sweep for a success); else 0."""
    if counts(jobs)[STATUS_FAILED]:
        return EXIT_FAILED
    return EXIT_CONFIG_ERROR if none_ran(jobs) else EXIT_OK


def _cells(j: JobResult, best: float | None, *, with_pp: bool = False, with_val: bool = False) -> list[str]:
    """The row of :data:`HEADERS` (with ``pp`` before ``dp`` when ``with_pp``, ``val loss``
    after ``final loss`` when ``with_val``)."""
    return [
        j.job,
        j.label,
        j.status,
        *([_show(j.pp)] if with_pp else []),
        *(_show(v) for v in (j.dp, j.tp, j.strategy, j.precision, j.steps)),
        "-" if j.final_loss is None else f"{j.final_loss:.4f}",
        *([_show(None if j.val_loss is None else f"{j.val_loss:.4f}")] if with_val else []),
        "-" if j.tokens_per_s is None else f"{j.tokens_per_s:,.0f}",
        "-" if not (j.tokens_per_s and best) else f"{j.tokens_per_s / best:.2f}x",
        "-" if j.step_time_s is None else f"{j.step_time_s * 1e3:.1f} ms",
        "-" if not j.peak_memory_mib_per_rank else f"{max(j.peak_memory_mib_per_rank):,.0f} MiB",
        j.reason or "",
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
