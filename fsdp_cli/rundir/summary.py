"""``summary.json``: written by rank 0 (or by the parent when the ranks died first, or by a sweep
for a job it skipped), read by the parent, the sweep report and the tests.

Every writer fills one :class:`RunSummary`, so every ``summary.json`` has the same keys with the
same meaning (README "Run directory"); the layout columns come from the resolved run
(:meth:`fsdp_cli.config.resolved.ResolvedRun.summary_columns`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsdp_cli.rundir.files import SUMMARY_FILE


@dataclass
class RunSummary:
    status: str
    """ok, failed, preempted, interrupted or skipped (rundir.status)."""
    error: str | None = None
    """One line, the cause first."""
    exit_code: int | None = None
    reason: str | None = None
    """Why a sweep skipped the job (only then)."""
    failure: dict[str, Any] | None = None
    """Which rank failed first and how, or which ranks hung (only when the launcher saw it)."""
    strategy: str | None = None
    accelerator: str | None = None
    world_size: int | None = None
    dp: int | None = None
    tp: int | None = None
    cp: int | None = None
    """Context-parallel size (only when above 1)."""
    ep: int | None = None
    """Expert-parallel size (only when above 1)."""
    pp: int | None = None
    """Pipeline-parallel size (only when above 1)."""
    precision: str | None = None
    model: str | None = None
    parameters: int | None = None
    global_batch_size: int | None = None
    seq_len: int | None = None
    steps: int | None = None
    final_loss: float | None = None
    val_loss: float | None = None
    tokens_per_s: float | None = None
    samples_per_s: float | None = None
    step_time_s: float | None = None
    tflops_per_s: float | None = None
    mfu: float | None = None
    peak_memory_bytes: list[int] = field(default_factory=list)
    checkpoint: str | None = None
    skipped_nonfinite_steps: int = 0
    skipped_nonfinite_at: list[int] = field(default_factory=list)
    setup: dict[str, Any] | None = None
    wall_time_s: float | None = None
    run_dir: str | None = None

    ONLY_WHEN_SET = ("reason", "failure")

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for key in self.ONLY_WHEN_SET:
            if out[key] is None:
                del out[key]
        return out


def steady_state(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows after warm-up: the first fifth (at least the first row) measures compilation and caches."""
    if len(rows) < 2:
        return rows
    return rows[max(1, len(rows) // 5) :]


def median_of(rows: Iterable[Mapping[str, Any]], key: str) -> float | None:
    values = [float(r[key]) for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def json_safe(value: Any) -> Any:
    """``value`` with every NaN or infinity replaced by None: strict JSON has no tokens for them
    (Python writes bare ``NaN``, which ``jq`` and most parsers reject)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def dumps_strict(value: Any, **kwargs: Any) -> str:
    """JSON text that every parser reads: non-finite floats become null."""
    return json.dumps(json_safe(value), allow_nan=False, default=str, **kwargs)


def write_summary(run_dir: Path, summary: RunSummary | Mapping[str, Any]) -> None:
    path = Path(run_dir) / SUMMARY_FILE
    data = summary.as_dict() if isinstance(summary, RunSummary) else dict(summary)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.partial")  # ranks may race on a failed run
    tmp.write_text(dumps_strict(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def read_summary(run_dir: Path) -> dict[str, Any] | None:
    path = Path(run_dir) / SUMMARY_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def clear_summary(run_dir: Path) -> None:
    """Remove the summary of an earlier run in this directory (a resume reuses it): whatever ends
    this run, a summary read after it is this run's, never the one before."""
    (Path(run_dir) / SUMMARY_FILE).unlink(missing_ok=True)


def summary_exists(run_dir: Path) -> bool:
    return (Path(run_dir) / SUMMARY_FILE).exists()
