"""The preemption flag exchange: how often ranks exchange it and how soon a signal is seen.

Agreement between ranks (all stop and save after the same step) is shown by a real two-rank
run in tests/test_checkpoints.py::test_sigterm_saves_then_exits_preempted_and_resume_continues;
here one in-process gloo rank drives the schedule with a clock the test controls."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from fsdp_cli.checkpoint.stop_flag import StopFlagExchange


@pytest.fixture
def gloo_group(gloo_rank: None) -> object:
    return dist.new_group(backend="gloo")


def drive(
    exchange: StopFlagExchange,
    clock: list[float],
    *,
    steps: int,
    step_s: float,
    signal_at: int,
    first: int = 1,
) -> tuple[list[int], list[int]]:
    """Run step boundaries ``first`` .. ``steps`` of ``step_s`` each, signalled from step
    ``signal_at`` on; returns the steps at which the exchange answered "stop" and those at which
    it exchanged."""
    stops, exchanged = [], []
    for step in range(first, steps + 1):
        clock[0] += step_s
        before = exchange.exchanges
        if exchange.any_rank_signalled(step, signalled=step >= signal_at):
            stops.append(step)
        if exchange.exchanges > before:
            exchanged.append(step)
    return stops, exchanged


STEP_S = 2**-8
"""About 4 ms, exact in binary: ``interval_s=0.25`` is exactly 64 such steps."""


def test_short_steps_exchange_every_interval_and_see_the_signal_within_two(gloo_group: object) -> None:
    clock = [0.0]
    exchange = StopFlagExchange(gloo_group, interval_s=0.25, clock=lambda: clock[0])
    stops, exchanged = drive(exchange, clock, steps=1000, step_s=STEP_S, signal_at=10_000)
    # The first two exchanges measure the step time (one step apart), then every 64th step.
    assert stops == [] and exchanged == [1, 2, 3, *range(67, 1001, 64)], exchanged

    stops, exchanged = drive(exchange, clock, steps=1400, step_s=STEP_S, signal_at=1200, first=1001)
    assert exchanged == list(range(1027, 1401, 64)), exchanged
    # Sent with the first exchange after the signal (1219), read at the next (1283).
    assert stops == [1283, 1347], stops
    assert (stops[0] - 1200) * STEP_S <= 2 * 0.25
    exchange.finish()


def test_steps_longer_than_the_interval_exchange_every_step(gloo_group: object) -> None:
    clock = [0.0]
    exchange = StopFlagExchange(gloo_group, interval_s=0.25, clock=lambda: clock[0])
    stops, exchanged = drive(exchange, clock, steps=20, step_s=1.0, signal_at=10)
    assert exchanged == list(range(1, 21))
    assert stops == list(range(11, 21))  # sent at the boundary of step 10, read at the next one
    exchange.finish()


def test_instant_steps_exchange_at_the_cap_and_see_the_signal_within_twice_the_cap(
    gloo_group: object,
) -> None:
    clock = [0.0]
    exchange = StopFlagExchange(gloo_group, interval_s=0.25, max_steps_between=100, clock=lambda: clock[0])
    stops, exchanged = drive(exchange, clock, steps=1000, step_s=0.0, signal_at=500)
    assert exchanged == [1, 2, 3, *range(103, 1001, 100)], exchanged
    # Sent with the first exchange after the signal (503), read at the next (603): 103 steps
    # after it, within the 2 x max_steps_between the class promises (never more).
    assert stops == [603, 703, 803, 903], stops
    assert stops[0] - 500 <= 2 * 100
    exchange.finish()
