"""Nothing of a run outlives it: neither when fsdp-train or torch's agent is killed outright (a
scheduler's hard kill, the out-of-memory killer), nor when a test ends (the harness kills it all).

The ranks of a run lead sessions of their own (torch starts them with ``start_new_session``), so
killing the command's process group never reaches them: they must die with their agent (the
parent-death signal, launch/environment.py), and the test harness finds them by the marks every
process of a job carries (tests/harness.py)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from conftest import end_jobs, start_cli, wait_for
from harness import Job, processes_naming

from fsdp_cli.rundir.heartbeat import read_heartbeats

pytestmark = pytest.mark.distributed

ENDLESS = ["devices=2", "accelerator=cpu", "data.seq_len=32", "trainer.max_steps=100000"]
GONE_WITHIN_S = 30


def training(run_dir: Path, job: Job) -> dict[int, int]:
    """Once both ranks have finished a step: {rank: pid}."""

    def ranks() -> dict[int, int] | None:
        beats = read_heartbeats(run_dir)
        if len(beats) == 2 and all(b.step >= 1 for b in beats.values()):
            return {rank: beat.pid for rank, beat in beats.items()}
        return None

    return wait_for(ranks, job, timeout=180)


def alive(pids: list[int]) -> list[int]:
    """Those of ``pids`` still running (a zombie is dead: only its parent's wait is missing)."""
    living = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            continue
        if state not in ("Z", "X"):
            living.append(pid)
    return living


def gone(job: Job, pids: list[int]) -> float:
    """Seconds until no process of the job (nor any of ``pids``) is left; fails after 30 s."""
    started = time.monotonic()
    while alive(pids) or job.processes():
        elapsed = time.monotonic() - started
        assert elapsed < GONE_WITHIN_S, f"still alive after {elapsed:.0f} s: {alive(pids) or job.processes()}"
        time.sleep(0.2)
    return time.monotonic() - started


def test_sigkill_of_fsdp_train_ends_its_agent_and_ranks(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    job = start_cli(ENDLESS, run_dir)
    ranks = training(run_dir, job)
    agent = read_heartbeats(run_dir)[0].parent
    everything = job.processes()
    assert {job.pid, agent, *ranks.values()} <= set(everything), everything
    os.kill(job.pid, signal.SIGKILL)  # fsdp-train alone, as a scheduler's hard kill does
    job.wait(timeout=10)
    print(f"SIGKILL of fsdp-train: its run gone after {gone(job, everything):.1f} s")


def test_sigkill_of_the_agent_alone_ends_its_ranks_and_fsdp_train(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    job = start_cli(ENDLESS, run_dir)
    ranks = training(run_dir, job)
    agent = read_heartbeats(run_dir)[0].parent
    everything = job.processes()
    os.kill(agent, signal.SIGKILL)  # torch's agent alone (the out-of-memory killer's pick)
    print(f"SIGKILL of the agent: its run gone after {gone(job, everything):.1f} s")
    assert job.wait(timeout=10) != 0, "fsdp-train reports the failure"
    assert set(ranks.values()) <= set(everything)


def test_the_harness_leaves_nothing_of_a_run_behind(tmp_path: Path) -> None:
    """What every test gets when it ends, passed or not: its jobs killed, ranks included."""
    run_dir = tmp_path / "run"
    job = start_cli(ENDLESS, run_dir)
    ranks = training(run_dir, job)
    everything = job.processes()
    assert len(everything) >= 4 and {job.pid, *ranks.values()} <= set(everything), everything
    # Out of reach of the command's process group: each rank leads a session of its own.
    assert all(os.getsid(pid) == pid != os.getpgid(job.pid) for pid in ranks.values())
    end_jobs()
    assert alive(everything) == [] and processes_naming(str(run_dir)) == []
    assert job.returncode is not None
