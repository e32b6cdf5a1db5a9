"""``fsdp-plan --rehearse`` and ``fsdp-train --dry-run``: rehearse one rank, show it beside the plan.

The rehearsal (:mod:`fsdp_cli.plan.rehearsal`) builds rank R of the layout in this process on a
fake process group; its held bytes are compared with the formula plan's for the same rank (more
than 1% apart: exit 1, naming both), its fake step's peak is shown beside the plan's total. A
layout the model cannot take has already stopped with one line (exit 2).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from fsdp_cli.rundir.status import EXIT_FAILED

GIB = 2**30
HELD = ("params", "grads", "optimizer")


def rehearse_and_report(
    cfg: Any, *, rank: int, memory: int | None, as_json: bool, step: bool, prog: str
) -> int:
    """Rehearse rank ``rank`` of ``cfg`` (resolved, validated) and print it with the plan; returns
    the exit status (1 when the two disagree). Raises ConfigError for a refused layout."""
    from fsdp_cli.plan.check import plan_for
    from fsdp_cli.plan.rehearsal import disagreements, rehearse

    result = rehearse(cfg, rank, step=step)
    plan = plan_for(cfg, memory)
    problems = disagreements(result, plan) if plan is not None else []
    if as_json:
        out = plan.as_dict() if plan is not None else {}
        out["rehearsal"] = {**result.as_dict(), "disagreements": problems}
        print(json.dumps(out, indent=2))
    else:
        if plan is not None:
            from fsdp_cli.cli.plan import print_plan

            print_plan(cfg, plan)
        print_rehearsal(cfg, result, plan)
    for line in problems:
        print(f"{prog}: error: the rehearsal and the plan disagree: {line}", file=sys.stderr, flush=True)
    return EXIT_FAILED if problems else 0


def print_rehearsal(cfg: Any, result: Any, plan: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console = Console(width=140)
    coordinates = " ".join(f"{k}={v}" for k, v in result.mesh_coordinates.items())
    # Plain prints for the lines: they stay whole (rich wraps at the console's width), for grep and logs.
    print(
        f"rehearsal: rank {result.rank} of {result.world_size} ({coordinates}), "
        f"{len(result.fsdp_units)} FSDP units, {result.seconds:.1f} s",
        flush=True,
    )
    planned = plan.ranks[result.rank] if plan is not None else None
    held = [getattr(result.held_bytes, kind) for kind in HELD]
    name, scale = _unit(held)
    table = Table()
    for column in (f"held by rank {result.rank} ({name})", "rehearsed", "plan"):
        table.add_column(column, justify="right")
    for kind, nbytes in zip(HELD, held):
        expected = f"{getattr(planned, kind) / scale:,.2f}" if planned is not None else "-"
        table.add_row(kind, f"{nbytes / scale:,.2f}", expected)
    console.print(table)
    if planned is None:
        print(f"no formula plan for strategy={cfg.strategy.name} with this model: the rehearsal alone")
    print(step_line(result.step, planned), flush=True)


def step_line(step: dict[str, Any] | None, planned: Any) -> str:
    if step is None:
        return "fake step: not run (--no-step)"
    if "skipped" in step:
        return f"fake step: {step['skipped']}"
    depths = step["measured_blocks"]
    how = (
        f"measured at {depths[0]} and {depths[1]} blocks, extended to {step['blocks']}"
        if len(depths) == 2
        else f"measured on all {depths[0]} blocks"
    )
    name, scale = _unit([step["peak_bytes"]])
    beside = f"; the plan's estimate {planned.total / scale:,.2f} {name}" if planned is not None else ""
    largest = sorted(step["by_kind"].items(), key=lambda kv: -kv[1])
    kinds = ", ".join(f"{k} {v / scale:,.2f}" for k, v in largest if v >= scale / 200)
    return (
        f"fake step: peak {step['peak_bytes'] / scale:,.2f} {name} in the {step['phase']} ({how}){beside}\n"
        f"  at the peak ({name}): {kinds}"
    )


def _unit(values: list[int]) -> tuple[str, int]:
    """GiB, or MiB where everything is smaller than a GiB."""
    return ("GiB", GIB) if max(values, default=0) >= GIB else ("MiB", 2**20)
