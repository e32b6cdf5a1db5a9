"""Periodic saves, retention, preemption, and the state Lightning does not checkpoint by itself.

* ``checkpoint.every_n_steps``: save after every N-th optimizer step (through the strategy, so
  in the configured format, atomically).
* ``checkpoint.keep_last``: after each save, delete the oldest complete checkpoints of this run
  beyond N (a save is this run's when its manifest carries the run's id, ``run_id``; a resumed run
  keeps the id of the run it resumes); the newest complete one is never deleted, a save that did
  not finish never counts, and another run's saves in the same folder are never touched.
* SIGTERM (preemption), or SIGUSR1 (what Lightning's SLURM docs ask schedulers to send before a
  time limit, ``#SBATCH --signal=SIGUSR1@90``): the signal only sets a flag. Ranks agree on it
  without waiting, through a non-blocking exchange on a gloo group of its own, every step or,
  when steps are short, about every quarter second (:mod:`fsdp_cli.checkpoint.stop_flag`). All
  ranks therefore stop after the same step (within about half a second of the signal, or two
  steps when steps are longer), save there (inside that step, so a resume continues its epoch
  mid-way), and the worker exits with status ``preempted``.
* Per-rank RNG states (torch, CUDA, numpy, python) travel in the checkpoint, so a model with
  dropout resumes exactly too.
"""

from __future__ import annotations

import random
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.distributed as dist

from fsdp_cli.callbacks.metrics import planned_steps
from fsdp_cli.checkpoint.format import remove_path
from fsdp_cli.checkpoint.run import checkpoint_name, own_checkpoints, own_leftovers
from fsdp_cli.checkpoint.stop_flag import StopFlagExchange
from fsdp_cli.checkpoint_format import CheckpointFormat
from fsdp_cli.compat.lightning_internals import disable_lightning_sigterm_handling
from fsdp_cli.config.schema import CheckpointConfig

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
"""Save, then stop: preemption, or a scheduler's warning before the time limit."""


class CheckpointCallback(L.Callback):
    def __init__(
        self,
        config: CheckpointConfig,
        directory: Path,
        max_steps: int,
        checkpoint_format: CheckpointFormat | None = None,
        run_id: str | None = None,
    ) -> None:
        """``checkpoint_format``: the format the strategy writes (the run's resolved one);
        None = ``config.format``. ``run_id``: the id this run's manifests carry; retention
        removes only saves with it (None: nothing is removed)."""
        self.run_id = run_id
        self.config = config
        self.format = checkpoint_format or config.format
        self.directory = Path(directory)
        self.max_steps = max_steps
        self.preempted = False
        self.last_saved: Path | None = None
        self._stop_requested = False
        self.stop_signal: str | None = None
        """The signal that asked this rank to stop; None when another rank was the one signalled."""
        self._stop_flags: StopFlagExchange | None = None
        self._seen_step = 0
        self.before_save: list[Callable[[L.Trainer], None]] = []
        """Run on every rank before each save (the non-finite check: never save a damaged state)."""

    # ------------------------------------------------------------------ preemption

    def install_signal_handler(self) -> None:
        """SIGTERM or SIGUSR1 marks the run for a save at the next step boundary. Installed in
        :meth:`setup`, once the process group is up: during the rendezvous a handler never runs
        (torch retries its connection in C++ when a signal interrupts it), and the default
        action ends a rank that has nothing to save yet."""
        if self.config.save_on_sigterm:
            for stop_signal in STOP_SIGNALS:
                signal.signal(stop_signal, self._on_stop_signal)

    def _on_stop_signal(self, signum: int, frame: Any) -> None:
        self._stop_requested = True
        self.stop_signal = signal.Signals(signum).name

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # Lightning's own SIGTERM handling broadcasts from inside the signal handler (a collective
        # at a random point of the other ranks' program: mismatched, it kills the job) and from
        # every training batch (a device sync per step on GPUs); this callback replaces both.
        # (setup runs before the Trainer registers its handlers, so the override takes effect.)
        disable_lightning_sigterm_handling(trainer)
        self.install_signal_handler()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self._stop_flags = StopFlagExchange(dist.new_group(backend="gloo"))

    def _any_rank_signalled(self, step: int) -> bool:
        """Whether any rank has been signalled (the same answer on every rank, at the same step)."""
        if self._stop_flags is None:
            return self._stop_requested
        return self._stop_flags.any_rank_signalled(step, self._stop_requested)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._stop_flags is not None:
            self._stop_flags.finish()

    # ------------------------------------------------------------------ periodic saves

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._seen_step = trainer.global_step
        self.max_steps = planned_steps(trainer) or self.max_steps  # max_epochs may end the run first

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if step == self._seen_step:  # between micro-batches of one step
            return
        self._seen_step = step
        if self.config.save_on_sigterm and self._any_rank_signalled(step):
            self.preempted = True
            # Saved here, inside the step as a periodic save is, so that a resume continues the
            # epoch where it stopped; saved after fit, Lightning would count the epoch as done.
            self.save(trainer)
            trainer.should_stop = True
            return
        every = self.config.every_n_steps
        last = 0 < self.max_steps <= step  # the last step is saved by the worker
        if every and step % every == 0 and not last:
            self.save(trainer)

    def save(self, trainer: L.Trainer) -> Path:
        for hook in self.before_save:
            hook(trainer)
        path = self.directory / checkpoint_name(trainer.global_step, self.format)
        trainer.save_checkpoint(path, weights_only=False)
        self.last_saved = path
        if trainer.is_global_zero:
            self.prune()
        return path

    def finish(self, trainer: L.Trainer) -> None:
        """End of training: wait for a background save, then apply retention to it too."""
        wait = getattr(trainer.strategy, "wait_for_checkpoint", None)
        if wait is not None:
            wait()
        if trainer.is_global_zero:
            self.prune()

    def prune(self) -> list[Path]:
        """Delete this run's complete checkpoints beyond ``keep_last`` (oldest first) and this
        run's leftovers of interrupted saves older than its newest checkpoint. A save belongs to
        the run whose id its manifest carries: another run sharing the folder keeps all of its
        own, finished or being written."""
        own = own_checkpoints(self.directory, self.run_id)
        removed = []
        for _, path in own[: max(0, len(own) - max(1, self.config.keep_last))]:
            remove_path(path)
            removed.append(path)
        if own:
            newest = own[-1][1].stat().st_mtime
            for leftover in own_leftovers(self.directory, self.run_id, own):
                if leftover.stat().st_mtime < newest:
                    remove_path(leftover)
        return removed

    # ------------------------------------------------------------------ RNG state

    def state_dict(self) -> dict[str, Any]:
        mine = _rng_state()
        if dist.is_available() and dist.is_initialized():
            everyone: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
            return {"rng": everyone}
        return {"rng": [mine]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        states = state.get("rng") or []
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        # Per-rank streams only mean something on the same layout; elsewhere keep the fresh seeds.
        if len(states) == world:
            _set_rng_state(states[rank])


def _rng_state() -> dict[str, Any]:
    # Plain types and tensors only: checkpoints are read back with torch.load(weights_only=True).
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    numpy_state = [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)]
    state = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
