"""The preemption flag exchange: how often ranks exchange it and how soon a signal is seen.

Agreement between ranks (all stop and save after the same step) is shown by a real two-rank
run in tests/test_checkpoints.py::test_sigterm_saves_then_exits_preempted_and_resume_continues;
here one in-process gloo rank drives the schedule with a clock the test controls."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

from fsdp_cli.checkpoint.stop_flag import StopFlagExchange


@pytest.fixture
def gloo_group(tmp_path: Path) -> Iterator[object]:
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield dist.new_group(backend="gloo")
    finally:
        dist.destroy_process_group()


def drive(
    exchange: StopFlagExchange,
    clock: list[float],
    *,
    steps: int,
    step_s: float,
    signal_at: int,
    first: int = 1,
) -> list[int]:
    """Run step boundaries ``first`` .. ``steps`` of ``step_s`` each, signalled from step
    ``signal_at`` on; returns the steps at which the exchange answered "stop"."""
    stops = []
    for step in range(first, steps + 1):
        clock[0] += step_s
        if exchange.any_rank_signalled(step, signalled=step >= signal_at):
            stops.append(step)
    return stops


def test_short_steps_exchange_about_every_interval_and_still_see_the_signal_soon(gloo_group: object) -> None:
    clock = [0.0]
    exchange = StopFlagExchange(gloo_group, interval_s=0.25, clock=lambda: clock[0])
    stops = drive(exchange, clock, steps=1000, step_s=0.005, signal_at=10_000)  # 5 ms steps, no signal
    assert stops == []
    assert 18 <= exchange.exchanges <= 30, exchange.exchanges  # about every 50 steps, not 1000 times

    stops = drive(exchange, clock, steps=1400, step_s=0.005, signal_at=1200, first=1001)
    assert stops and stops[0] >= 1200
    assert (stops[0] - 1200) * 0.005 <= 2 * 0.25 + 0.01, stops[0]  # seen within two intervals
    exchange.finish()


def test_steps_longer_than_the_interval_exchange_every_step(gloo_group: object) -> None:
    clock = [0.0]
    exchange = StopFlagExchange(gloo_group, interval_s=0.25, clock=lambda: clock[0])
    stops = drive(exchange, clock, steps=20, step_s=1.0, signal_at=10)
    assert exchange.exchanges == 20
    assert stops[0] == 11  # sent at the boundary of step 10, read at the next one
    exchange.finish()


def test_instant_steps_still_exchange_at_the_cap(gloo_group: object) -> None:
    clock = [0.0]
    exchange = StopFlagExchange(gloo_group, interval_s=0.25, max_steps_between=100, clock=lambda: clock[0])
    stops = drive(exchange, clock, steps=1000, step_s=0.0, signal_at=500)
    assert 10 <= exchange.exchanges <= 15, exchange.exchanges
    assert stops and 500 <= stops[0] <= 500 + 2 * 100
    exchange.finish()
