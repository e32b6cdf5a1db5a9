"""What a rank reports: the :class:`Outcome` of its run (a failure as one line, in summary.json,
on stderr and for the agent) and the :class:`~fsdp_cli.rundir.summary.RunSummary` assembled from
what it built, how the fit ended and the metrics its callbacks kept.
"""

from __future__ import annotations

import sys
import traceback
from dataclasses import dataclass
from typing import Any

from fsdp_cli.config.resolved import ResolvedRun
from fsdp_cli.errors import ConfigError, RunFailure
from fsdp_cli.rundir.status import EXIT_CONFIG_ERROR, EXIT_FAILED, EXIT_OK, STATUS_FAILED, STATUS_OK
from fsdp_cli.rundir.summary import RunSummary, median_of, steady_state
from fsdp_cli.worker.fit import BuiltRank, FitResult, parameter_count
from fsdp_cli.worker.monitor import report_error_to_agent


@dataclass
class Outcome:
    """How a rank's run ended: its status, its one-line error, its exit status."""

    status: str = STATUS_OK
    error: str | None = None
    exit_code: int = EXIT_OK


def outcome_of(err: BaseException) -> Outcome:
    """The outcome of a rank that raised ``err``: one line in summary.json, on stderr and for the
    agent; a traceback only for what may be a bug."""
    if isinstance(err, ConfigError):
        outcome = Outcome(STATUS_FAILED, err.one_line(), EXIT_CONFIG_ERROR)
    elif isinstance(err, RunFailure):
        outcome = Outcome(STATUS_FAILED, str(err), EXIT_FAILED)
    else:
        traceback.print_exc()
        text = str(err) if isinstance(err, Exception) else (str(err).strip().splitlines() or [""])[0]
        outcome = Outcome(STATUS_FAILED, f"{type(err).__name__}: {text}", EXIT_FAILED)
    if isinstance(err, (ConfigError, RunFailure)):
        print(f"fsdp-train: error: {outcome.error}", file=sys.stderr, flush=True)
    report_error_to_agent(outcome.error or "")
    return outcome


def rank_summary(
    run: ResolvedRun, built: BuiltRank | None, result: FitResult | None, outcome: Outcome, *, wall: float
) -> RunSummary:
    """summary.json's content for this rank (``built``/``result`` None: it failed before them)."""
    metrics = built.callbacks.metrics if built is not None else None
    setup = built.callbacks.setup if built is not None else None
    skipped = built.callbacks.nonfinite.skipped if built is not None else []
    rows = metrics.rows if metrics is not None else []
    val_rows = metrics.val_rows if metrics is not None else []
    steady = steady_state(rows)
    data = run.cfg.data
    tokens = built is None or built.tokens  # else batches from the user's loaders
    return RunSummary(
        status=outcome.status,
        error=outcome.error,
        exit_code=outcome.exit_code,
        **run.summary_columns(),
        parameters=max(built.parameters_at_build, parameter_count(built.module))
        if built is not None
        else None,
        global_batch_size=data.global_batch_size if tokens else None,
        seq_len=data.seq_len if tokens else None,
        steps=_steps_done(built, result, rows),
        final_loss=rows[-1]["loss"] if rows else None,
        val_loss=val_rows[-1].get("val_loss") if val_rows else None,
        tokens_per_s=median_of(steady, "tokens_per_s"),
        samples_per_s=median_of(steady, "samples_per_s"),
        step_time_s=median_of(steady, "step_time_s"),
        tflops_per_s=median_of(steady, "tflops_per_s"),
        mfu=median_of(steady, "mfu"),
        peak_memory_bytes=metrics.peak_memory_bytes if metrics is not None else [],
        checkpoint=result.checkpoint if result is not None else None,
        skipped_nonfinite_steps=len(skipped),
        skipped_nonfinite_at=list(skipped),
        setup=setup.info if setup is not None else None,
        wall_time_s=round(wall, 3),
    )


def _steps_done(built: BuiltRank | None, result: FitResult | None, rows: list[dict[str, Any]]) -> int:
    if result is not None:
        return result.steps
    if built is not None:  # a failed run: the optimizer steps it took before failing
        return int(built.trainer.global_step)
    return rows[-1]["step"] if rows else 0
