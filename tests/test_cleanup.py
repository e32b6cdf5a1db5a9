"""Nothing of a run outlives it: neither when fsdp-train or torch's agent is killed outright (a
scheduler's hard kill, the out-of-memory killer), nor when a test ends (the harness kills it all).

The ranks of a run lead sessions of their own (torch starts a new process with
``start_new_session``; a rank forked from the agent or its forkserver calls ``setsid``), so killing the
command's process group never reaches them: they must die with their agent (the parent-death
signal, or a forked rank's watch on its agent, launch/environment.py), and the test harness finds
them by the marks every process of a job carries (tests/harness.py).

The hard kills of fsdp-train and of the agent alone are made during a checkpoint save, where what
they leave on disk is checked too: test_checkpoints.py's
``test_sigkill_during_a_save_leaves_the_previous_checkpoint[after_rename_agent_killed]`` and
``[full_format_fsdp_train_killed]`` (every process of the run gone within 30 s, fsdp-train
reporting the agent's death)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import end_jobs, start_cli, wait_for
from harness import Job, alive, processes_naming

from fsdp_cli.rundir.heartbeat import read_heartbeats

pytestmark = pytest.mark.distributed

ENDLESS = ["devices=2", "accelerator=cpu", "data.seq_len=32", "trainer.max_steps=100000"]


def training(run_dir: Path, job: Job) -> dict[int, int]:
    """Once both ranks have finished a step: {rank: pid}."""

    def ranks() -> dict[int, int] | None:
        beats = read_heartbeats(run_dir)
        if len(beats) == 2 and all(b.step >= 1 for b in beats.values()):
            return {rank: beat.pid for rank, beat in beats.items()}
        return None

    return wait_for(ranks, job, timeout=180)


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
