"""fsdp-train's own per-step host time, measured inside one run.

Wall and CPU ratios against another program (``compare_loop.py``) move by 10% between runs on a
shared 2-core machine: the machine's speed changes from one run to the next. What fsdp-train adds
per step can instead be timed inside the run itself, against that run's own steps, so that a
slower or faster machine scales both alike. This callback, given through the ``callbacks``
config group, times over steps ``start``..``stop`` on every rank:

* the body of every per-step hook of every other callback that overrides it (fsdp-train's own:
  clipping, the non-finite guard, the metrics row, the progress line, checkpoints' stop flag,
  the heartbeat);
* the collective in the metrics row (the loss averaged over ranks, which a hand-written loop that
  logs as often makes too), apart;
* Lightning's callback dispatch around them: ``_call_callback_hooks`` (a private function of
  Lightning, wrapped for this measurement only) minus the bodies: what the loop spends reaching
  the callbacks;

and writes ``hook_time.rank<R>.json`` (microseconds per step) in the run directory. ``own_us`` is
fsdp-train's part: the hook bodies less clipping and the loss collective's wait (a hand-written
loop that clips and logs as often does both), plus the dispatch less this callback's share::

    fsdp-train strategy=ddp model=custom model._target_=benchmarks.gpt.GPT +model.dim=64 \\
        +model.n_layers=2 +model.n_heads=4 +model.max_seq_len=128 +model.vocab_size=256 \\
        devices=2 precision=32-true trainer.max_steps=200 data.global_batch_size=8 data.seq_len=128 \\
        checkpoint.save_last=false +callbacks.hooks._target_=benchmarks.hook_time.HookTime

Its own wrappers add about a microsecond per timed call.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
import torch.distributed as dist

from benchmarks.step_parts import Phases

STEP_HOOKS = (
    "on_train_batch_start",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
    "on_train_batch_end",
)

SHARED_WITH_A_HAND_LOOP = ("GradientClipping.on_before_optimizer_step",)


class HookTime(L.Callback):
    def __init__(self, start: int = 20, stop: int = 180, out: str | None = None) -> None:
        self.phases = Phases(start, stop)  # the window and the timed wrappers of step_parts.py
        self.out = out
        self._timed = self.phases.timed

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        from lightning.pytorch.trainer import call

        import fsdp_cli.callbacks.nonfinite as nonfinite

        # Private names, wrapped for this measurement only (the fsdp_cli package fences Lightning's
        # private names in compat/; a benchmark that times them has to reach them).
        dispatch = call._call_callback_hooks  # noqa: SLF001
        call._call_callback_hooks = self._timed("dispatch", dispatch)  # noqa: SLF001
        nonfinite._sum_over_ranks = self._timed("loss collective", nonfinite._sum_over_ranks)  # noqa: SLF001
        nonfinite._gather_rows = self._timed("loss collective", nonfinite._gather_rows)  # noqa: SLF001
        for callback in trainer.callbacks:
            if callback is self:
                continue
            for hook in STEP_HOOKS:
                if getattr(type(callback), hook) is not getattr(L.Callback, hook):
                    name = f"{type(callback).__name__}.{hook}"
                    setattr(callback, hook, self._timed(name, getattr(callback, hook)))

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.phases.step_begins(trainer.global_step)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        steps = self.phases.stop - self.phases.start
        if not self.phases.wall_ns:
            raise RuntimeError(f"hook_time: the run ended before step {self.phases.stop}")
        per_step = {k: v / 1e3 / steps for k, v in self.phases.ns.items()}
        hooks = dict(sorted(((k, v) for k, v in per_step.items() if "." in k), key=lambda kv: -kv[1]))
        callbacks = [type(c).__name__ for c in trainer.callbacks]
        dispatch = per_step.get("dispatch", 0.0) - sum(hooks.values())
        loss_collective = per_step.get("loss collective", 0.0)
        # What a hand-written loop that clips and logs as often does too: the clipping, the wait in
        # the loss reduction. This callback's own share of the dispatch is not fsdp-train's.
        own = (
            sum(v for k, v in hooks.items() if k not in SHARED_WITH_A_HAND_LOOP)
            - loss_collective
            + dispatch * (len(callbacks) - 1) / len(callbacks)
        )
        step = self.phases.wall_ns / 1e3 / steps
        report = {
            "steps": steps,
            "step_us": step,
            "hooks_us": hooks,
            "loss_collective_us": loss_collective,
            "dispatch_us": dispatch,
            "callbacks": callbacks,
            "own_us": own,
            "own_fraction": own / step,
        }
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        out = Path(self.out or trainer.default_root_dir)
        (out / f"hook_time.rank{rank}.json").write_text(json.dumps(report, indent=1))
