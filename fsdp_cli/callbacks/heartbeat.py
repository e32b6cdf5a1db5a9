"""Beats the rank's heartbeat (:mod:`fsdp_cli.rundir.heartbeat`) from the training loop.

Every training and validation batch is progress; a save is a phase of its own (the watchdog
gives it the longer start-up timeout). From the start of training until the first optimizer
step has finished the phase is ``first``, watched with a limit of its own: the first batches
(a loader's workers starting), compilation and lazy initialization make the first step the
slowest, and a loader that never delivers shows here.
A beat is one ``pwrite`` of a fixed-width record: no sync, no flush.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import lightning as L

from fsdp_cli.rundir.heartbeat import PHASE_FIRST, PHASE_SAVE, PHASE_TRAIN, PHASE_VAL

if TYPE_CHECKING:  # (type-only: the rank's monitor is handed in by the worker)
    from fsdp_cli.worker.monitor import RankMonitor


class HeartbeatCallback(L.Callback):
    def __init__(self, monitor: RankMonitor) -> None:
        self.monitor = monitor
        self._first_step: int | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._first_step = trainer.global_step
        self.monitor.beat(trainer.global_step, PHASE_FIRST)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        self.monitor.beat(step, PHASE_FIRST if step == self._first_step else PHASE_TRAIN)

    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.monitor.beat(trainer.global_step, PHASE_VAL)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: Any) -> None:
        self.monitor.beat(trainer.global_step, PHASE_SAVE)
