"""Beats the rank's heartbeat (:mod:`fsdp_cli.rundir.heartbeat`) from the training loop.

Every training and validation batch is progress; a save is a phase of its own (the watchdog
gives it the longer start-up timeout). Until the first optimizer step has finished the phase
stays ``start``: imports, checkpoint loading and compilation make the first step the slowest.
A beat is one ``pwrite`` of a fixed-width record: no sync, no flush.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import lightning as L

from fsdp_cli.rundir.heartbeat import PHASE_SAVE, PHASE_START, PHASE_TRAIN, PHASE_VAL

if TYPE_CHECKING:  # (type-only: the rank's monitor is handed in by the worker)
    from fsdp_cli.worker.monitor import RankMonitor


class HeartbeatCallback(L.Callback):
    def __init__(self, monitor: RankMonitor) -> None:
        self.monitor = monitor
        self._first_step: int | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._first_step = trainer.global_step
        self.monitor.beat(trainer.global_step, PHASE_START)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        self.monitor.beat(step, PHASE_START if step == self._first_step else PHASE_TRAIN)

    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.monitor.beat(trainer.global_step, PHASE_VAL)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: Any) -> None:
        self.monitor.beat(trainer.global_step, PHASE_SAVE)
