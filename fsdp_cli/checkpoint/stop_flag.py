"""Ranks agreeing that one of them was asked to stop (SIGTERM), without waiting and without an
exchange on every short step.

Each exchange is a non-blocking all-reduce (MAX) of a small CPU tensor over a gloo group of its
own: never queued in front of the training collectives, no GPU synchronisation. A step boundary
that exchanges starts this boundary's exchange and reads the previous one, long finished. The
tensor carries two numbers: whether this rank was signalled, and (negated, so MAX gives the
smallest) how many steps this rank proposes until the next exchange, so that exchanges take
about ``interval_s`` of training. Every rank reads the same result, so every rank knows both
the answer and the step of the next exchange: all stop after the same step. With steps longer
than ``interval_s`` that is every step, as before; with 5 ms steps every 50th.

A signal is seen by the second exchange after it (sent with the first, read at the next): within
about ``2 * interval_s``, two steps when steps are longer, and at most ``2 * max_steps_between``
steps when steps are very short.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

INTERVAL_S = 0.25
MAX_STEPS_BETWEEN = 100


class StopFlagExchange:
    """Arguments:
    group: a gloo process group used for nothing else.
    interval_s: the training time aimed for between two exchanges.
    max_steps_between: at most this many steps between two exchanges, so a signal is seen within
        twice as many steps however short the steps are.
    clock: seconds, monotonic (a test passes its own).
    """

    def __init__(
        self,
        group: Any,
        *,
        interval_s: float = INTERVAL_S,
        max_steps_between: int = MAX_STEPS_BETWEEN,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.group = group
        self.interval_s = interval_s
        self.max_steps_between = max_steps_between
        self.clock = clock
        self.exchanges = 0
        self._in_flight: tuple[torch.Tensor, Any] | None = None
        self._next_step: int | None = None  # the step boundary of the next exchange (None: the first one met)
        self._last: tuple[int, float] | None = None  # step and time of the last exchange

    def any_rank_signalled(self, step: int, signalled: bool) -> bool:
        """Call at every optimizer-step boundary (``step``: steps done), on every rank; returns
        the same answer on every rank, at the same step."""
        if self._next_step is not None and step < self._next_step:
            return False
        now = self.clock()
        proposal = self._proposal(step, now)
        self._last = (step, now)
        mine = torch.tensor([1 if signalled else 0, -proposal], dtype=torch.int64)
        work = dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        previous, self._in_flight = self._in_flight, (mine, work)
        self.exchanges += 1
        if previous is None:
            self._next_step = step + 1
            return False
        previous[1].wait()
        flag, negated_steps = previous[0].tolist()
        self._next_step = step + max(1, -int(negated_steps))
        return bool(flag)

    def _proposal(self, step: int, now: float) -> int:
        """Steps until the next exchange this rank asks for, from its recent step time."""
        if self._last is None or step <= self._last[0]:
            return 1
        step_s = (now - self._last[1]) / (step - self._last[0])
        if step_s <= 0:
            return self.max_steps_between
        return max(1, min(self.max_steps_between, math.floor(self.interval_s / step_s)))

    def finish(self) -> None:
        """Every rank started the last exchange: wait for it before the group is torn down."""
        if self._in_flight is not None:
            self._in_flight[1].wait()
            self._in_flight = None
