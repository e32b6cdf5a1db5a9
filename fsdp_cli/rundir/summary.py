"""``summary.json``: written by rank 0 (or by the parent when the ranks died first), read by the
parent, the sweep report and the tests."""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from fsdp_cli.rundir.files import SUMMARY_FILE


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


def write_summary(run_dir: Path, summary: Mapping[str, Any]) -> None:
    path = Path(run_dir) / SUMMARY_FILE
    tmp = path.with_name(f"{path.name}.{os.getpid()}.partial")  # ranks may race on a failed run
    tmp.write_text(dumps_strict(dict(summary), indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def read_summary(run_dir: Path) -> dict[str, Any] | None:
    path = Path(run_dir) / SUMMARY_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def summary_exists(run_dir: Path) -> bool:
    return (Path(run_dir) / SUMMARY_FILE).exists()
