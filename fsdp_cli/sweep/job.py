"""One job of a sweep (``fsdp-train -m ...``): whatever it does, the sweep goes on.

* :func:`check_job` and :func:`skip_job` are what the sweep launcher
  (:mod:`fsdp_cli.sweep.launcher`) calls: it checks every job of a batch before the first one
  starts, and runs :func:`skip_job` in place of each that cannot run.
* :func:`run_sweep_job` guards the job itself, under any launcher (ours, Hydra's basic one,
  submitit): a config error makes it ``skipped``, any other exception or exit ``failed``; either
  way it returns the worst objective value and the sweep goes on. Only a stop request (SIGTERM
  preemption, Ctrl-C) ends the sweep.

The value a job returns is its objective (``sweep.objective`` of its summary), which Optuna
minimises or maximises (``hydra.sweeper.direction``). A job without one returns the worst value
for that direction, +inf or -inf: Optuna records such a trial as complete and learns to avoid
it. (NaN crashes hydra-optuna-sweeper 1.3, and None marks the trial failed, which aborts the
study under its default ``max_failure_rate=0``.)
"""

from __future__ import annotations

import math
import os
import sys
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, ListConfig, OmegaConf

from fsdp_cli.config.convert import to_train_config
from fsdp_cli.config.migrate import migrate
from fsdp_cli.config.resolved import ResolvedRun, model_label
from fsdp_cli.errors import ConfigError
from fsdp_cli.launch.layout import resolve_layout
from fsdp_cli.resolve import resolve_config, resolve_run
from fsdp_cli.rundir.status import (
    EXIT_CONFIG_ERROR,
    STATUS_FAILED,
    STATUS_OK,
    STATUS_SKIPPED,
    STOP_CODES,
)
from fsdp_cli.rundir.summary import RunSummary, write_summary

PROG = "fsdp-train"
ERROR_LOG = "error.log"
"""The traceback of a job that failed in this process (the ranks' own go to ``logs/``)."""

Launch = Callable[[ResolvedRun], tuple[int, dict[str, Any] | None]]
"""Runs a resolved job: its exit status and summary (None when rank 0 is on another node)."""


def check_job(cfg: DictConfig) -> str | None:
    """None when the job can run, else the one line saying why not.

    The sweep launcher calls this with Hydra's state already set to the job's (output directory,
    job number, ``hydra.job.env_set`` applied), so it sees exactly what the job will see."""
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:  # (the job prints the notices)
        resolve_config(
            cfg, run_dir, os.environ, notify=lambda notice: None, multirun=True, overrides=_overrides()
        )
    except ConfigError as err:
        return err.one_line()
    return None


def skip_job(reason: str, cfg: DictConfig) -> float:
    """Record a job that cannot run (its ``summary.json`` says ``skipped`` and why); start nothing."""
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    summary = RunSummary(status=STATUS_SKIPPED, reason=reason, **{**layout_of(cfg), "run_dir": str(run_dir)})
    write_summary(run_dir, summary)
    print(f"{PROG}: skipped: {reason}", file=sys.stderr, flush=True)
    return worst_value()


def run_sweep_job(cfg: DictConfig, run_dir: Path, *, launch: Launch, notify: Callable[[str], None]) -> float:
    """Resolve, check and run one job; never raises, except to stop the whole sweep."""
    try:
        run = resolve_run(cfg, run_dir, os.environ, notify=notify, multirun=True, overrides=_overrides())
    except ConfigError as err:  # under launchers that do not check before launching (basic, submitit)
        return skip_job(err.one_line(), cfg)
    try:
        code, summary = launch(run)
    except SystemExit as err:
        if err.code in STOP_CODES:
            raise
        code, summary = 1, _record_failure(run_dir, err, cfg)
    except Exception as err:  # noqa: BLE001 - recorded in summary.json and error.log; the sweep goes on
        code, summary = 1, _record_failure(run_dir, err, cfg)
    if code == EXIT_CONFIG_ERROR and summary is not None:
        # A combination only the built model could reject (a wrap class it does not have, ...).
        summary = {**summary, "status": STATUS_SKIPPED, "reason": summary.get("error")}
        write_summary(run_dir, summary)
    return objective_value(summary, run.cfg.sweep.objective.value)


def _overrides() -> list[str]:
    """This job's overrides (Hydra's state is the job's while the launcher checks or runs it)."""
    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def objective_value(summary: Mapping[str, Any] | None, objective: str) -> float:
    """The job's ``objective`` when it finished with a finite one, else the worst value
    (``auto``: its ``val_loss`` where it validated, else its ``final_loss``)."""
    if objective == "auto":
        objective = "val_loss" if (summary or {}).get("val_loss") is not None else "final_loss"
    value = (summary or {}).get(objective)
    ok = summary is not None and summary.get("status") == STATUS_OK
    if ok and isinstance(value, (int, float)) and math.isfinite(value):
        return float(value)
    return worst_value()


def worst_value() -> float:
    """+inf when the sweeper minimises (and for sweepers without a direction), -inf when it maximises."""
    try:
        direction = OmegaConf.select(HydraConfig.get(), "sweeper.direction", default=None)
    except ValueError:  # HydraConfig not set: called outside a Hydra job
        direction = None
    if isinstance(direction, (list, tuple, ListConfig)):
        direction = direction[0] if len(direction) else None
    return -math.inf if direction_name(direction) == "maximize" else math.inf


def direction_name(direction: Any) -> str:
    """``minimize``/``maximize`` from Optuna's enum member, its name or its value."""
    name = str(getattr(direction, "name", direction) or "minimize").rsplit(".", 1)[-1].lower()
    return "maximize" if name.startswith("max") else "minimize"


def layout_of(cfg: DictConfig) -> dict[str, Any]:
    """The layout columns of a job that did not run, as far as its config resolves (the same
    columns a run that ran reports: :meth:`~fsdp_cli.config.resolved.ResolvedRun.summary_columns`)."""
    try:
        typed, _ = migrate(to_train_config(cfg))
    except ConfigError:
        return {}
    columns = {
        "strategy": typed.strategy.name,
        "precision": typed.precision.name,
        "pp": typed.pp,
        "tp": typed.tp,
        "dp": None if typed.dp == "auto" else typed.dp,
        "model": model_label(typed),
    }
    try:
        return {**columns, **ResolvedRun.of(resolve_layout(typed, os.environ)).summary_columns()}
    except (ConfigError, ValueError):  # a layout (or precision) that does not resolve
        return columns


def _record_failure(run_dir: Path, err: BaseException, cfg: DictConfig) -> dict[str, Any]:
    error = f"exited with status {err.code}" if isinstance(err, SystemExit) else _one_line(err)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / ERROR_LOG).write_text("".join(traceback.format_exception(err)))
    summary = RunSummary(status=STATUS_FAILED, error=error, **{**layout_of(cfg), "run_dir": str(run_dir)})
    write_summary(run_dir, summary)
    print(f"{PROG}: job failed: {error} (traceback in {run_dir / ERROR_LOG})", file=sys.stderr, flush=True)
    return summary.as_dict()


def _one_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__
