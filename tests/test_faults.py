"""When things go wrong during a run: every failure provoked for real in a small ``fsdp-train`` job
(2-3 CPU ranks on gloo), and its outcome and the time it took checked. The faults come from a
user model that misbehaves on purpose (tests/assets/faulty.py), so fsdp_cli carries no hooks."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import (
    FAST,
    cli_in_process,
    read_summary,
    run,
    run_cli,
    start_cli,
    wait_for,
)
from harness import processes_naming

from fsdp_cli.checkpoint.convert import load
from fsdp_cli.launch.stacks import proc_state
from fsdp_cli.rundir.heartbeat import read_heartbeats

pytestmark = pytest.mark.distributed

FAULTY = [
    "model=custom",
    "model._target_=tests.assets.faulty.FaultyLM",
    "data.vocab_size=256",
    "strategy=fsdp2",
    "accelerator=cpu",
    *FAST,
]


def strict_json_lines(path: Path) -> list[dict[str, Any]]:
    """Parse as a strict reader would: a bare NaN or Infinity token is an error."""

    def refuse(token: str) -> Any:
        raise ValueError(f"{path}: non-standard JSON token {token}")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def _strict(path: Path) -> dict[str, Any]:
    def refuse(token: str) -> Any:
        raise ValueError(f"{path}: non-standard JSON token {token}")

    return json.loads(path.read_text(), parse_constant=refuse)


def last_beat(run_dir: Path, rank: int) -> float:
    """When ``rank`` last made progress (the fault happens right after it)."""
    return read_heartbeats(run_dir)[rank].time


def assert_nothing_left_running(run_dir: Path) -> None:
    assert processes_naming(str(run_dir)) == [], "a process of the job outlived it"


# --------------------------------------------------------------------------- non-finite values


def test_nonfinite_loss_stops_every_rank_and_nothing_is_saved_after_it(tmp_path: Path) -> None:
    """NaN loss on rank 1 at step 3; rows are logged every 5 steps, so it is the save at step 4
    that forces the check: the run fails there, naming step 3, and step 4 is never written."""
    run_dir = tmp_path / "nan"
    args = [
        *FAULTY,
        "devices=2",
        "+model.faults={1:nan_loss}",
        "+model.at_steps=3",
        "trainer.log_every_n_steps=5",
        "checkpoint.every_n_steps=2",
    ]
    started = time.time()
    result = run_cli(args, run_dir)
    assert result.returncode == 1, result.stderr[-3000:]
    summary = _strict(run_dir / "summary.json")
    assert summary["status"] == "failed"
    assert summary["error"].startswith(
        "non-finite loss (rank 1) and gradient norm at step 3 (detected at step 4); nothing was saved after it"
    ), summary["error"]
    assert summary["failure"]["agreed"] is True, "every rank raised it: none left waiting in a collective"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000002"]
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("fsdp-train: error:")]
    assert len(errors) == 1 and "step 3" in errors[0], result.stderr[-2000:]
    assert time.time() - started < 120


def test_skip_nonfinite_steps_zeroes_the_update_then_fails_past_the_budget(tmp_path: Path) -> None:
    """trainer.skip_nonfinite_steps=1: NaN at step 3 is skipped (weights and Adam moments of
    step 3 equal step 2's), training goes on, the second NaN (step 5) fails the run. Also runs,
    and checks, options no other test needs: bf16-true, a cosine schedule, clipping by value
    (so the guard computes the gradient norm itself), the csv logger."""
    run_dir = tmp_path / "skip"
    args = [
        *FAULTY,
        "devices=2",
        "+model.faults={1:nan_loss}",
        "+model.at_steps=[3,5]",
        "trainer.skip_nonfinite_steps=1",
        "checkpoint.every_n_steps=1",
        "checkpoint.keep_last=10",
        "precision=bf16-true",
        "optim.scheduler=cosine",
        "optim.warmup_steps=2",
        "trainer.gradient_clip_algorithm=value",
        "trainer.gradient_clip_val=0.5",
        "logger=csv",
    ]
    result = run_cli(args, run_dir)
    assert result.returncode == 1, result.stderr[-3000:]
    summary = _strict(run_dir / "summary.json")
    assert summary["error"].startswith(
        "non-finite gradient norm at step 5; already skipped 1 step(s) (trainer.skip_nonfinite_steps=1) at 3"
    ), summary["error"]
    assert (summary["skipped_nonfinite_steps"], summary["skipped_nonfinite_at"]) == (1, [3])
    rows = strict_json_lines(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[2]["loss"] is None and all(r["loss"] > 0 for r in rows[:2] + rows[3:])
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert names == [f"step_0000000{i}" for i in (1, 2, 3, 4)], names
    step2, step3, step4 = (load(run_dir / "checkpoints" / n) for n in names[1:])
    for key, weight in step2.state_dict.items():
        assert torch.equal(weight, step3.state_dict[key]), f"{key} changed in the skipped step"
        assert weight.dtype == torch.bfloat16
    moments = step2.optimizer_states[0]["state"], step3.optimizer_states[0]["state"]
    assert all(torch.equal(moments[0][k]["exp_avg"], moments[1][k]["exp_avg"]) for k in moments[0])
    assert any(not torch.equal(w, step4.state_dict[k]) for k, w in step3.state_dict.items()), "step 4 trained"

    # Warm-up over 2 steps, then cosine down to 10% of optim.lr at step 6; a row holds the rate
    # the schedule set after its step (for the next one).
    def rate(step: int) -> float:
        return 3e-3 * ((step + 1) / 2 if step < 2 else 0.1 + 0.45 * (1 + math.cos(math.pi * (step - 2) / 4)))

    assert [r["lr"] for r in rows] == pytest.approx([rate(r["step"]) for r in rows], rel=1e-12)
    csv = (run_dir / "csv" / "metrics.csv").read_text().splitlines()
    assert "loss" in csv[0].split(",") and len(csv) == 1 + len(rows), csv[:3]


# --------------------------------------------------------------------------- a rank dies


def test_a_dead_rank_is_named_and_its_survivors_do_not_wait(tmp_path: Path) -> None:
    """Rank 1 is SIGKILLed (as by the out-of-memory killer) in step 3 while rank 0 sleeps in the
    same step, as a rank blocked in an NCCL collective would (it notices neither the dead peer
    nor SIGTERM): torch's agent would wait 30 s before killing it; the launcher does it in ~5."""
    run_dir = tmp_path / "death"
    args = [
        *FAULTY,
        "devices=2",
        "+model.faults={1:sigkill}",
        "+model.at_steps=3",
        "+model.others_sleep_s=120",
    ]
    result = run_cli(args, run_dir)
    ended = time.time()
    assert result.returncode == 1, result.stderr[-3000:]
    summary = _strict(run_dir / "summary.json")
    failure = summary["failure"]
    assert (failure["rank"], failure["signal"]) == (1, "SIGKILL"), failure
    assert summary["error"] == (
        "rank 1 was killed by SIGKILL at step 3 (the kernel's out-of-memory killer sends this too)"
    )
    assert failure["ranks"]["0"]["collateral"] is True, "the survivor is not blamed"
    assert (summary["status"], summary["steps"], summary["world_size"]) == ("failed", 2, 2)
    took = ended - last_beat(run_dir, 1)
    assert took < 20, f"{took:.1f} s from the death to the end of the job"
    assert_nothing_left_running(run_dir)


@pytest.mark.parametrize(("start_method", "killed"), [("fork", 1), ("forkserver", 0)])
def test_the_killed_rank_is_named_not_the_peer_that_noticed(
    tmp_path: Path, start_method: str, killed: int
) -> None:
    """The other rank keeps training: its next collective fails on "Connection reset by peer"
    within milliseconds, often inside the same poll of torch's agent, which then reports
    whichever of the two it finds first (for forked ranks it reports one only). The report must
    name the rank that was killed, and keep the survivor's error as collateral."""
    run_dir = tmp_path / f"killed{killed}"
    args = [*FAULTY, "devices=2", f"+model.faults={{{killed}:sigkill}}", "+model.at_steps=3"]
    result = run_cli([*args, f"launcher.start_method={start_method}"], run_dir)
    assert result.returncode == 1, result.stderr[-3000:]
    summary = _strict(run_dir / "summary.json")
    assert summary["error"] == (
        f"rank {killed} was killed by SIGKILL at step 3 (the kernel's out-of-memory killer sends this too)"
    ), summary.get("failure")
    survivor = summary["failure"]["ranks"][str(1 - killed)]
    assert survivor["collateral"] is True and survivor["exit_code"] != 0, summary["failure"]["ranks"]
    assert_nothing_left_running(run_dir)


# --------------------------------------------------------------------------- ranks hang


def test_hung_ranks_are_dumped_named_and_killed(tmp_path: Path) -> None:
    """Three ranks: rank 1 hangs in Python, rank 2 is stopped (SIGSTOP: no handler can run),
    rank 0 waits for them in a collective. After launcher.hang_timeout_s every rank's stack is in
    its log, the job is killed without a preemption save, and the error names ranks and step."""
    run_dir = tmp_path / "hang"
    hang_timeout = 3.0
    args = [
        *FAULTY,
        "devices=3",
        "data.global_batch_size=6",
        "+model.faults={1:sleep,2:stop}",
        "+model.at_steps=3",
        f"launcher.hang_timeout_s={hang_timeout}",
        "logger=tensorboard",
    ]
    result = run_cli(args, run_dir)
    ended = time.time()
    assert result.returncode == 1, result.stderr[-3000:]
    summary = _strict(run_dir / "summary.json")
    error = summary["error"]
    assert error.startswith(f"hang: no rank made progress for {hang_timeout:.0f} s; last step 2; stuck: "), (
        error
    )
    assert "rank 1 in misbehave (faulty.py:" in error and "rank 2 stopped (SIGSTOP/SIGTSTP)" in error, error
    assert "waiting for them in a collective: rank 0" in error, error
    assert summary["failure"]["stuck_ranks"] == [1, 2]
    logs = run_dir / "logs"
    rank0 = (logs / "rank0.log").read_text()
    assert "most recent call first" in rank0 and "distributed" in rank0
    assert "in misbehave" in (logs / "rank1.log").read_text(), "faulthandler's dump of the stuck rank"
    rank2 = summary["failure"]["ranks"]["2"]
    assert rank2["state"] == "T"
    if rank2["dumper"] == "py-spy":
        assert "misbehave" in (logs / "rank2.log").read_text()
    else:
        assert any("install py-spy" in note for note in rank2["notes"]), rank2  # (a list of notes)
    assert not (run_dir / "checkpoints").exists(), "no SIGTERM, hence no preemption save"
    assert hang_timeout <= ended - last_beat(run_dir, 0) < hang_timeout + 20
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*")), "the tensorboard logger wrote"
    assert_nothing_left_running(run_dir)


# --------------------------------------------------------------------------- the disk is full


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True)
    if os.geteuid() != 0:
        return False
    return run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], timeout=30).returncode == 0


def test_a_full_disk_during_a_save_fails_in_one_line_and_keeps_the_previous_checkpoint(
    tmp_path: Path,
) -> None:
    """A real ENOSPC: checkpoint.dir is a 15 MiB tmpfs; the tiny model's first checkpoint (9.7
    MiB) fits, the second does not."""
    disk = tmp_path / "small_disk"
    if not _mount_tmpfs(disk, "15m"):
        pytest.skip("mounting a tmpfs needs root (CAP_SYS_ADMIN)")
    try:
        run_dir = tmp_path / "full"
        args = ["strategy=fsdp2", "devices=2", "accelerator=cpu", *FAST, "checkpoint.every_n_steps=2"]
        extra = ["trainer.log_every_n_steps=2", "optim.scheduler=linear"]
        result = run_cli([*args, *extra, f"checkpoint.dir={disk}"], run_dir)
        assert result.returncode == 1, result.stderr[-3000:]
        error = _strict(run_dir / "summary.json")["error"]
        assert error.startswith(
            f"checkpoint save of step 4 to {disk}/step_00000004 failed: the disk is full ("
        ), error
        assert error.endswith("the previous checkpoint is intact; free space or set checkpoint.dir elsewhere")
        assert "Traceback" not in result.stderr
        assert sorted(p.name for p in disk.iterdir()) == ["step_00000002"], "no .partial left behind"
        assert not (run_dir / "checkpoints").exists(), "checkpoint.dir moved them"
        # A row every 2 steps, the rate decaying linearly to 10% at step 6.
        rows = strict_json_lines(run_dir / "metrics.jsonl")
        assert [r["step"] for r in rows] == [2, 4]
        assert [r["lr"] for r in rows] == pytest.approx([3e-3 * (0.1 + 0.9 * (1 - s / 6)) for s in (2, 4)])
        check = cli_in_process(["verify", "--deep", str(disk / "step_00000002")], prog="fsdp-ckpt")
        assert check.returncode == 0, check
    finally:
        run(["umount", "-l", str(disk)], timeout=30)


def test_ctrl_c_stops_every_rank_and_is_reported_as_interrupted_not_failed(tmp_path: Path) -> None:
    """Ctrl-C in a terminal signals the foreground process group (fsdp-train and torch's agent;
    the ranks run in sessions of their own and are stopped by the agent). The directory holds an
    earlier run's summary (a resume reuses its directory): the report is this run's, not that one."""
    import signal

    run_dir = tmp_path / "interrupted"
    run_dir.mkdir()
    (run_dir / "summary.json").write_text(json.dumps({"status": "preempted", "steps": 5, "exit_code": 143}))
    proc = start_cli(["devices=2", "accelerator=cpu", "trainer.max_steps=100000"], run_dir)
    # The summary counts the steps the heartbeats report (a metrics row is written just before).
    wait_for(lambda: min((b.step for b in read_heartbeats(run_dir).values()), default=-1) >= 2, proc)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    summary = read_summary(run_dir)
    assert summary["status"] == "interrupted" and "failure" not in summary, summary
    assert summary["error"].endswith("resume=auto would start over") and summary["steps"] >= 2, summary
    assert "interrupted" in out and "Traceback" not in out + err
    assert processes_naming(str(run_dir)) == []


def test_sigterm_during_a_long_step_ends_the_run_within_the_grace(tmp_path: Path) -> None:
    """Every rank spends 10 minutes in step 3 (a 124M model's step on CPU): a SIGTERM to
    fsdp-train (what `kill` or a scheduler sends) would wait for the save at the step's end; the
    launcher kills the ranks launcher.interrupt_grace_s later, says the save did not finish, and
    the run is reported preempted (exit 143) with nothing left running."""
    import signal

    grace = 3.0
    run_dir = tmp_path / "slow"
    args = [
        *FAULTY,
        "devices=2",
        "+model.others_sleep_s=600",
        "+model.at_steps=3",
        "checkpoint.every_n_steps=2",
    ]
    proc = start_cli([*args, f"launcher.interrupt_grace_s={grace:g}", "trainer.max_steps=100"], run_dir)
    wait_for(lambda: min((b.step for b in read_heartbeats(run_dir).values()), default=-1) >= 2, proc)
    time.sleep(1.0)  # inside step 3
    proc.send_signal(signal.SIGTERM)
    terminated = time.monotonic()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-2000:]
    assert grace <= time.monotonic() - terminated < grace + 30
    assert "SIGTERM: the ranks did not reach a step boundary within launcher.interrupt_grace_s=3 s" in err
    summary = read_summary(run_dir)
    assert summary["status"] == "preempted", summary
    assert summary["error"] == (
        "SIGTERM: the ranks were killed inside a step, so the save on SIGTERM did not happen; nothing was "
        f"saved by this stop: resume=auto hydra.run.dir={run_dir} continues from "
        f"{run_dir}/checkpoints/step_00000002 (step 2), repeating the steps after it"
    )
    assert processes_naming(str(run_dir)) == []


def test_ctrl_c_kills_ranks_that_cannot_stop(tmp_path: Path) -> None:
    """Both ranks are stopped (SIGSTOP) in step 3: neither can act on Ctrl-C. The launcher kills
    them after its grace period (torch's agent alone would wait for them) and reports the run
    interrupted. (One stopped rank and its peer waiting in a collective is the same to the
    launcher, but the peer may not have reached the collective when the Ctrl-C comes: it then
    stops on it, and the launcher's dead-rank watch ends the run after 5 s, as a CI run under
    load once showed.)"""
    import signal

    grace = 3.0  # launcher.interrupt_grace_s: 20 s by default
    run_dir = tmp_path / "stuck"
    args = [
        *FAULTY,
        "devices=2",
        "+model.faults={0:stop,1:stop}",
        "+model.at_steps=3",
        f"launcher.interrupt_grace_s={grace:g}",
    ]
    proc = start_cli(args, run_dir)

    def both_stopped() -> list[int] | None:
        pids = [b.pid for b in read_heartbeats(run_dir).values() if proc_state(b.pid) == "T"]
        return pids if len(pids) == 2 else None

    stopped = wait_for(both_stopped, proc)
    os.killpg(proc.pid, signal.SIGINT)
    interrupted = time.monotonic()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert grace <= time.monotonic() - interrupted < grace + 30
    assert "still running 3 s after Ctrl-C: killing them" in err
    assert read_summary(run_dir)["status"] == "interrupted"
    assert [proc_state(pid) for pid in stopped] == [None, None] and processes_naming(str(run_dir)) == []
