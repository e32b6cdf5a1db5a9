"""CPU time per step, the second measure of ``compare_loop.py`` beside wall time.

On a machine whose cores the ranks fill (2 CPU processes on 2 cores), anything else that runs
(another process, a kernel thread, the other rank's gloo threads) stretches a step's wall time
and moves a pair's wall ratio by 5-15% between repeats. The CPU seconds a rank's process spends
per step (all its threads: ``time.process_time``) are what fsdp-train adds to or saves from a
step, barely moved by such load. Each side measures the same window: from the end of the
warm-up's last step to the end of the last step, every rank, averaged over the ranks.

* the hand-written and plain-Lightning loops call :class:`CpuWindow` themselves (this module
  imports no Lightning: the hand loop's process holds none);
* fsdp-train gets ``lightning_loop.CpuClock``, a Lightning callback given through its
  ``callbacks`` config group, as a user's callback is. It costs fsdp-train's side one callback's
  hook calls per step (a few microseconds), which the other sides do not pay.
"""

from __future__ import annotations

import time
from typing import Any

import torch.distributed as dist


class CpuWindow:
    """CPU seconds of this process per step, from the end of step ``warmup`` to the last step seen."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self._start: float | None = None
        self._last: tuple[int, float] | None = None

    def step_done(self, step: int) -> None:
        """Call at the end of every step (``step``: steps done so far)."""
        now = time.process_time()
        if step == self.warmup:
            self._start = now
        elif step > self.warmup:
            self._last = (step, now)

    def per_step_s(self) -> float:
        if self._start is None or self._last is None:
            raise RuntimeError(f"no step after the warm-up ({self.warmup} steps) was measured")
        step, now = self._last
        return (now - self._start) / (step - self.warmup)

    def over_ranks(self) -> dict[str, Any]:
        """Every rank's CPU seconds per step and their mean (a collective: call on every rank)."""
        mine = self.per_step_s()
        every = [mine]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            every = [0.0] * dist.get_world_size()
            dist.all_gather_object(every, mine)
        return {"cpu_step_s": sum(every) / len(every), "cpu_step_s_per_rank": every}
