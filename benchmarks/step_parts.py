"""Where a step's time goes, split into the model's work and the rest, inside each run.

A step's wall time on a shared machine moves by 10% from one run to the next, because the
machine's speed does; comparing two programs by their step times (``compare_loop.py``'s ratio)
inherits that noise twice. Splitting each step, inside the run, into the model's work and
everything else lets the programs be compared on the part that differs:

* **model work**: forward and loss, backward (with the gradient collectives it waits for),
  clipping, the optimizer's arithmetic, zeroing gradients, and the loss reduction of a logged
  step (the same in every side);
* **framework**: the step's wall time minus the model work: the data loader, the training
  loop (Lightning's hooks, closure and progress tracking), and every callback's own work.

The hand-written loop times its phases inline (``hand_loop.py``); a Lightning side (fsdp-train,
given it through its ``callbacks`` config group, and ``lightning_loop.py``) gets
``lightning_loop.StepParts``, a callback which wraps the module's ``training_step`` and ``backward``, the optimizer's
``step`` (and the closure Lightning hands it: the optimizer's own arithmetic is its ``step``
less the closure) and ``zero_grad``, clipping (fsdp-train's clipping callback or the module's
``configure_gradient_clipping``) and the loss reduction (fsdp-train's non-finite check, or
``lightning_loop.py``'s). Rank 0 is reported: it also writes the metrics, so the others wait for it.

``compare_loop.py --parts`` reports each side's framework time per step, and the ratio it
implies: (hand-loop step + fsdp-train's framework time - the hand loop's) / hand-loop step.
"""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path
from typing import Any

MODEL_WORK = ("forward_loss", "backward", "clip", "optimizer", "zero_grad", "loss_reduction")


class Phases:
    """Nanoseconds per named phase over a window of steps, and the window's wall time."""

    def __init__(self, start: int, stop: int) -> None:
        self.start, self.stop = start, stop
        self.ns: dict[str, int] = {}
        self.on = False
        self._t0 = 0
        self._lap = 0
        self.wall_ns = 0

    def step_begins(self, step: int) -> None:
        """Call before step ``step + 1`` (``step``: steps done)."""
        self._lap = time.perf_counter_ns()
        if step == self.start and not self.wall_ns:
            self.on, self._t0 = True, time.perf_counter_ns()
        elif step == self.stop and self.on:
            self.on, self.wall_ns = False, time.perf_counter_ns() - self._t0

    def lap(self, name: str) -> None:
        """The time since the previous lap (or :meth:`step_begins`) is ``name``'s (the hand loop's
        inline timing: one clock read per phase)."""
        now = time.perf_counter_ns()
        self.add(name, now - self._lap)
        self._lap = now

    def add(self, name: str, ns: int) -> None:
        if self.on:
            self.ns[name] = self.ns.get(name, 0) + ns

    def timed(self, name: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(name, time.perf_counter_ns() - began)

        return wrapper

    def report(self) -> dict[str, Any]:
        if not self.wall_ns:
            raise RuntimeError(f"step_parts: the run ended before step {self.stop}")
        steps = self.stop - self.start
        parts = {k: v / 1e6 / steps for k, v in self.ns.items()}
        if "optimizer_with_closure" in parts:
            # Lightning: the optimizer's step ran the closure (forward, backward, clipping), unless
            # a gradient scaler ran it before the step.
            parts["optimizer"] = parts.pop("optimizer_with_closure") - parts.pop("closure", 0.0)
        step = self.wall_ns / 1e6 / steps
        model = sum(parts.get(k, 0.0) for k in MODEL_WORK)
        data = parts.get("data", 0.0)  # the data loader and the move to the device (framework time)
        return {
            "step_ms": step,
            "parts_ms": parts,
            "model_ms": model,
            "framework_ms": step - model,
            "loop_ms": step - model - data,  # the framework less the data: the loop, hooks, callbacks
        }


def write_report(phases: Phases, out: Path) -> None:
    out.write_text(json.dumps(phases.report(), indent=1))
