"""``fsdp-plan --rehearse`` and ``fsdp-train --dry-run``: rehearse one rank, show it beside the plan.

The rehearsal (:mod:`fsdp_cli.plan.rehearsal`) builds rank R of the layout in this process on a
fake process group; its held bytes are compared with the formula plan's for the same rank (more
than 1% apart: exit 1, naming both), its fake step's peak is shown beside the plan's total. A
layout the model cannot take has already stopped with one line (exit 2).
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING

from fsdp_cli.rundir.status import EXIT_FAILED

if TYPE_CHECKING:
    from fsdp_cli.config.resolved import ResolvedRun


def rehearse_and_report(
    run: ResolvedRun, *, rank: int, memory: int | None, as_json: bool, step: bool, prog: str
) -> int:
    """Rehearse rank ``rank`` of ``cfg`` (resolved, validated) and print it with the plan; returns
    the exit status (1 when the two disagree). Raises ConfigError for a refused layout."""
    from fsdp_cli.plan.check import plan_for
    from fsdp_cli.plan.rehearsal import disagreements, rehearse

    result = rehearse(run, rank, step=step)
    plan = plan_for(run, memory)
    problems = disagreements(result, plan) if plan is not None else []
    if as_json:
        out = plan.as_dict() if plan is not None else {}
        out["rehearsal"] = {**result.as_dict(), "disagreements": problems}
        print(json.dumps(out, indent=2))
    else:
        from fsdp_cli.cli.plan_tables import print_plan, print_rehearsal

        if plan is not None:
            print_plan(run.cfg, plan)
        print_rehearsal(run, result, plan)
    for line in problems:
        print(f"{prog}: error: the rehearsal and the plan disagree: {line}", file=sys.stderr, flush=True)
    return EXIT_FAILED if problems else 0
