"""Reading the Chrome traces ``trainer.profiler=torch`` writes: which collectives ran inside
each backward pass of rank 0."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

REDUCE_SCATTER = "c10d::_reduce_scatter_base_"
ALL_GATHER = "c10d::_allgather_base_"
ALL_REDUCE = "c10d::allreduce_"
BROADCAST = "c10d::broadcast_"


def rank0_trace(run_dir: Path) -> list[dict[str, Any]]:
    traces = sorted((run_dir / "profiler").glob("fit-trace-0-*.pt.trace.json"))
    assert len(traces) == 1, sorted(p.name for p in (run_dir / "profiler").iterdir())
    return [e for e in json.loads(traces[0].read_text())["traceEvents"] if e.get("ph") == "X"]


def inside(event: dict[str, Any], window: dict[str, Any]) -> bool:
    return (
        event["tid"] == window["tid"]
        and window["ts"] <= event["ts"]
        and event["ts"] + event["dur"] <= window["ts"] + window["dur"]
    )


def collectives_per_backward(run_dir: Path, name: str, within: str | None = None) -> list[int]:
    """For each backward pass in rank 0's trace, in order: how many ``name`` collectives it ran
    (only those inside an event whose name starts with ``within``, when given)."""
    events = rank0_trace(run_dir)
    backwards = sorted(
        (
            e
            for e in events
            if e["name"].startswith("[pl][profile][Strategy]") and e["name"].endswith(".backward")
        ),
        key=lambda e: e["ts"],
    )
    calls = [e for e in events if e["name"] == name]
    if within is not None:
        windows = [e for e in events if e["name"].startswith(within)]
        calls = [c for c in calls if any(inside(c, w) for w in windows)]
    return [sum(inside(c, b) for c in calls) for b in backwards]
