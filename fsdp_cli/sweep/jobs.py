"""The jobs of a sweep, read from their folders: one :class:`JobResult` per job.

Reads only files (``summary.json``, ``metrics.jsonl``, ``.hydra/overrides.yaml``), so it works
the same whichever launcher ran the jobs (in this process, submitit on other nodes) and on a
sweep that finished long ago. No torch, no Hydra.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsdp_cli.rundir.files import METRICS_FILE, SUMMARY_FILE
from fsdp_cli.rundir.status import STATUS_FAILED, STATUS_OK, STATUS_SKIPPED

COLUMNS = (
    "job",
    "overrides",
    "status",
    "reason",
    "pp",
    "dp",
    "tp",
    "strategy",
    "precision",
    "steps",
    "final_loss",
    "val_loss",
    "tokens_per_s",
    "step_time_s",
    "peak_memory_mib_per_rank",
    "job_dir",
)
"""One row per job, in this order, in ``sweep_summary.csv`` and ``.json``. ``reason``: why a job
was skipped, or the error of a failed one."""

NO_SUMMARY = "no summary.json: the job died before writing one (killed, timed out?)"


@dataclass
class JobResult:
    """One job of a sweep, as its folder tells it."""

    job: str
    overrides: list[str]
    status: str
    reason: str | None = None
    pp: int | None = None
    dp: int | None = None
    tp: int | None = None
    strategy: str | None = None
    precision: str | None = None
    steps: int | None = None
    final_loss: float | None = None
    val_loss: float | None = None
    """The last validation's loss (None: the job did not validate)."""
    tokens_per_s: float | None = None
    step_time_s: float | None = None
    peak_memory_mib_per_rank: list[float] = field(default_factory=list)
    job_dir: str = ""
    losses: list[tuple[int, float]] = field(default_factory=list)
    """(step, loss) of every logged step: the plot's curve."""
    val_losses: list[tuple[int, float]] = field(default_factory=list)
    """(step, val_loss) of every validation: the plot's markers."""
    label: str = ""
    """The overrides that differ between the jobs of the sweep: how the table and plot name a job."""

    def row(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in COLUMNS}


# --------------------------------------------------------------------------- reading


def collect(sweep_dir: Path, since: float | None = None) -> list[JobResult]:
    """Every job folder of a sweep in job order. ``since``: leave out jobs that started before
    this time (a reused ``hydra.sweep.dir`` may still hold an earlier sweep's jobs)."""
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        return []
    jobs = []
    for job_dir in sorted((p for p in sweep_dir.iterdir() if _is_job_dir(p)), key=_job_order):
        started = job_dir / ".hydra" / "overrides.yaml"
        if since is not None and started.is_file() and started.stat().st_mtime < since:
            continue
        jobs.append(read_job(job_dir))
    _set_labels(jobs)
    return jobs


def read_job(job_dir: Path) -> JobResult:
    summary = _read_json(job_dir / SUMMARY_FILE) or {"status": STATUS_FAILED, "error": NO_SUMMARY}
    memory = summary.get("peak_memory_bytes") or []
    result = JobResult(
        job=job_dir.name,
        overrides=_overrides(job_dir),
        status=str(summary.get("status") or STATUS_FAILED),
        reason=summary.get("reason") or summary.get("error"),
        pp=summary.get("pp"),
        dp=summary.get("dp"),
        tp=summary.get("tp"),
        strategy=summary.get("strategy"),
        precision=summary.get("precision"),
        steps=summary.get("steps"),
        final_loss=_finite(summary.get("final_loss")),
        val_loss=_finite(summary.get("val_loss")),
        tokens_per_s=_finite(summary.get("tokens_per_s")),
        step_time_s=_finite(summary.get("step_time_s")),
        peak_memory_mib_per_rank=[round(b / 2**20, 1) for b in memory if isinstance(b, (int, float))],
        job_dir=str(job_dir),
        losses=_losses(job_dir / METRICS_FILE),
        val_losses=_losses(job_dir / METRICS_FILE, key="val_loss"),
    )
    if not result.steps and result.losses:  # a job that failed part-way: how far it got
        result.steps = result.losses[-1][0]
    return result


def _is_job_dir(path: Path) -> bool:
    return path.is_dir() and (
        path.name.isdigit() or (path / ".hydra").is_dir() or (path / SUMMARY_FILE).is_file()
    )


def _job_order(path: Path) -> tuple[int, str]:
    return (int(path.name), "") if path.name.isdigit() else (1 << 30, path.name)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _overrides(job_dir: Path) -> list[str]:
    """Hydra's ``.hydra/overrides.yaml``: a YAML list of strings, one ``- key=value`` line each."""
    file = job_dir / ".hydra" / "overrides.yaml"
    if not file.is_file():
        return []
    out = []
    for line in file.read_text().splitlines():
        if not line.startswith("- "):
            continue
        value = line[2:].strip()
        if len(value) >= 2 and value[0] == value[-1] == "'":
            value = value[1:-1].replace("''", "'")
        elif len(value) >= 2 and value[0] == value[-1] == '"':
            value = json.loads(value)
        out.append(value)
    return out


def _losses(path: Path, key: str = "loss") -> list[tuple[int, float]]:
    """(step, value) of each metrics.jsonl row holding ``key`` (training steps' ``loss``, or
    validations' ``val_loss``)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    points = []
    for line in lines:
        try:
            row = json.loads(line)
            if key in row:
                points.append((int(row["step"]), float(row[key])))
        except (ValueError, KeyError, TypeError):
            continue  # the torn last line of a job that died mid-write
    return points


def _finite(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def _set_labels(jobs: list[JobResult]) -> None:
    keyed = [dict(o.split("=", 1) if "=" in o else (o, "") for o in job.overrides) for job in jobs]
    keys = {k for d in keyed for k in d}
    varying = {k for k in keys if len({d.get(k) for d in keyed}) > 1}
    for job, overrides in zip(jobs, keyed):
        parts = [f"{k}={v}" for k, v in overrides.items() if k in varying]
        job.label = " ".join(parts) or " ".join(job.overrides) or "(defaults)"


def counts(jobs: Iterable[JobResult]) -> dict[str, int]:
    statuses = [job.status for job in jobs]
    return {status: statuses.count(status) for status in (STATUS_OK, STATUS_SKIPPED, STATUS_FAILED)}
