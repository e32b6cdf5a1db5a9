"""After ``fsdp-train -m ...``: one table comparing the layouts of the sweep.

A Hydra callback (configured in ``train.yaml`` under ``hydra.callbacks``) that reads each job's
``summary.json`` when the sweep ends, prints the comparison and writes ``sweep_summary.json``
in the sweep directory. If any job failed, the sweep exits with status 1.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from fsdp_cli.rundir.summary import read_summary

SWEEP_SUMMARY = "sweep_summary.json"
COLUMNS = (
    "status",
    "strategy",
    "dp",
    "tp",
    "precision",
    "steps",
    "final_loss",
    "tokens_per_s",
    "step_time_s",
)


class SweepReport(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        jobs = []
        for job_dir in sorted((p for p in sweep_dir.iterdir() if p.is_dir()), key=_job_order):
            summary = read_summary(job_dir)
            if summary is None:
                continue
            overrides = _overrides(job_dir)
            jobs.append({"job": job_dir.name, "overrides": overrides, **{k: summary.get(k) for k in COLUMNS}})
        if not jobs:
            return
        (sweep_dir / SWEEP_SUMMARY).write_text(json.dumps(jobs, indent=2) + "\n")
        _print(jobs, sweep_dir)
        if any(job["status"] != "ok" for job in jobs):
            sys.exit(1)


def _job_order(path: Path) -> tuple[int, str]:
    return (int(path.name), "") if path.name.isdigit() else (1 << 30, path.name)


def _overrides(job_dir: Path) -> str:
    file = job_dir / ".hydra" / "overrides.yaml"
    if not file.is_file():
        return ""
    lines = [line[2:].strip() for line in file.read_text().splitlines() if line.startswith("- ")]
    return " ".join(lines)


def _print(jobs: list[dict[str, Any]], sweep_dir: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    baseline = next((j["tokens_per_s"] for j in jobs if j["tokens_per_s"]), None)
    table = Table(title=f"sweep: {len(jobs)} jobs in {sweep_dir}", title_justify="left")
    for name in (
        "job",
        "overrides",
        "status",
        "dp",
        "tp",
        "steps",
        "final loss",
        "tokens/s",
        "vs job 0",
        "step time",
    ):
        table.add_column(name, justify="right" if name not in ("overrides", "status") else "left")
    for job in jobs:
        tps = job["tokens_per_s"]
        table.add_row(
            job["job"],
            job["overrides"],
            str(job["status"]),
            str(job["dp"]),
            str(job["tp"]),
            str(job["steps"]),
            "-" if job["final_loss"] is None else f"{job['final_loss']:.4f}",
            "-" if tps is None else f"{tps:,.0f}",
            "-" if not (tps and baseline) else f"{tps / baseline:.2f}x",
            "-" if job["step_time_s"] is None else f"{job['step_time_s'] * 1e3:.1f} ms",
        )
    Console().print(table)
