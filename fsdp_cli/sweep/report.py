"""After ``fsdp-train -m ...``: the comparison of every job, and the sweep's exit status.

A Hydra callback (``hydra.callbacks.sweep_report`` in ``train.yaml``). When the sweep ends it
reads the job folders of this sweep (any launcher: ours, basic, submitit on other nodes), prints
the table, writes ``sweep_summary.csv``, ``.json`` and ``.png`` in the sweep directory, and
decides the exit status :func:`fsdp_cli.cli.main.main` returns: 1 when any job failed, 2 when no
job ran (every one skipped as invalid), 0 when every job ran or some were skipped. (Exiting inside the callback would skip the callbacks
that run after it.)
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from fsdp_cli.rundir.status import EXIT_OK
from fsdp_cli.sweep.job import direction_name
from fsdp_cli.sweep.summary import none_ran, report, sweep_exit_status

CLOCK_SLACK_S = 2.0
"""Job folders are told apart from an earlier sweep's by their start time; clocks of the nodes
that ran them may differ by this much."""

_exit_status = EXIT_OK


def exit_status() -> int:
    """What this process should exit with after its sweep (0 outside a sweep)."""
    return _exit_status


class SweepReport(Callback):
    def __init__(self) -> None:
        self._started: float | None = None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        global _exit_status
        _exit_status = EXIT_OK
        self._started = time.time()
        self._no_color = _uncoloured_when_not_a_terminal()
        _warn_on_opposite_direction(config)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        global _exit_status
        if getattr(self, "_no_color", False):
            os.environ.pop(NO_COLOR, None)
        # Only this sweep's jobs: a reused hydra.sweep.dir may hold folders of an earlier one.
        since = None if self._started is None else self._started - CLOCK_SLACK_S
        jobs = report(Path(config.hydra.sweep.dir), since=since)
        _exit_status = sweep_exit_status(jobs)
        if none_ran(jobs):
            print(
                f"fsdp-train: error: no job of the sweep ran: all {len(jobs)} were skipped; "
                "hint: the reason of each is in the table",
                file=sys.stderr,
                flush=True,
            )


NO_COLOR = "NO_COLOR"
"""The convention (no-color.org) colorlog honours: Optuna's handler formats its lines with
colorlog's colours without asking whether stderr is a terminal, so a sweep's log written to a
file or a pipe carried raw escape codes."""


def _uncoloured_when_not_a_terminal() -> bool:
    """Set ``NO_COLOR`` for the sweep where stderr is not a terminal (and neither colour setting
    was given); True when it was set here, to be taken back when the sweep ends."""
    if sys.stderr.isatty() or NO_COLOR in os.environ or "FORCE_COLOR" in os.environ:
        return False
    os.environ[NO_COLOR] = "1"
    return True


def _warn_on_opposite_direction(config: DictConfig) -> None:
    """Optuna maximising the loss, or minimising throughput, is almost surely a mistake."""
    direction = OmegaConf.select(config, "hydra.sweeper.direction", default=None)
    objective = OmegaConf.select(config, "sweep.objective", default=None)
    if direction is None or objective is None:
        return
    wanted = (
        "minimize"
        if str(getattr(objective, "value", objective)) in ("auto", "val_loss", "final_loss", "step_time_s")
        else "maximize"
    )
    if direction_name(direction) != wanted:
        print(
            f"fsdp-train: note: hydra.sweeper.direction={direction_name(direction)} with "
            f"sweep.objective={getattr(objective, 'value', objective)}; hint: use hydra.sweeper.direction={wanted}",
            file=sys.stderr,
            flush=True,
        )
