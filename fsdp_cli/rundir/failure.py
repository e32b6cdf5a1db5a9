"""``failure.json``: why a job's ranks stopped, as seen from outside them.

The elastic agent writes it when a rank fails (which rank failed first and how: an exit code or
a signal), the launcher when it ends a hung job (which ranks were stuck, where, and the last
step). The parent merges it into ``summary.json``: a rank that survived a peer's death writes
"Connection reset by peer" as its error, which is never the cause.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fsdp_cli.rundir.files import FAILURE_FILE
from fsdp_cli.rundir.status import STATUS_FAILED


def write_failure(run_dir: str | Path, report: Mapping[str, Any]) -> None:
    path = Path(run_dir) / FAILURE_FILE
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(dict(report), indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, path)


def read_failure(run_dir: str | Path) -> dict[str, Any] | None:
    try:
        return json.loads((Path(run_dir) / FAILURE_FILE).read_text())
    except (OSError, ValueError):
        return None


def clear_failure(run_dir: str | Path) -> None:
    (Path(run_dir) / FAILURE_FILE).unlink(missing_ok=True)


def merge_failure(summary: Mapping[str, Any], failure: Mapping[str, Any]) -> dict[str, Any]:
    """``summary`` with the failure's one-line ``error`` and its details under ``failure``.

    When the summary already holds the cause (written by the rank that failed first, or every
    failing rank reported the same error: a non-finite loss, a failed save), the ranks' own line
    is kept; otherwise it moves to ``rank_error`` (a survivor's "connection reset"), so that the
    cause comes first.
    """
    merged = {**summary, "status": STATUS_FAILED, "failure": dict(failure)}
    rank_error = summary.get("error")
    if rank_error and (failure.get("agreed") or rank_error == failure.get("message")):
        return merged
    merged["error"] = failure["error"]
    if rank_error and rank_error != failure["error"]:
        merged["rank_error"] = rank_error
    return merged
