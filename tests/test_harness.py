"""The test suite's own rules, checked in this process: the fast tier starts no process, and GPU
tests skip only where there is no GPU (a broken CUDA install fails loudly instead)."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from conftest import gpu_count, start

from fsdp_cli.launch import nvml


@pytest.mark.parametrize(
    "start",
    [
        lambda: subprocess.run([sys.executable, "-c", "pass"], timeout=10),
        lambda: os.system("true"),
        lambda: multiprocessing.get_context("spawn").Process(target=print).start(),
        lambda: multiprocessing.get_context("fork").Process(target=print).start(),
    ],
    ids=["subprocess", "os.system", "spawn", "fork"],
)
def test_a_test_not_marked_distributed_cannot_start_a_process(start: object) -> None:
    with pytest.raises(pytest.fail.Exception, match="starts a process but is not marked distributed"):
        start()  # type: ignore[operator]


def test_a_refused_start_leaves_no_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the harness keeps a job's output
    with pytest.raises(pytest.fail.Exception, match="not marked distributed"):
        start(["true"])
    assert list(tmp_path.iterdir()) == []


def test_no_cuda_device_means_skip_and_a_broken_install_fails_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(nvml, "device_count", lambda: 0)
    assert gpu_count({}) == 0  # no driver, no device: the GPU tests skip
    monkeypatch.setattr(nvml, "device_count", lambda: 2)
    with pytest.raises(RuntimeError, match=r"the driver lists 2 GPU\(s\) but torch .* can use none"):
        gpu_count({})
    assert gpu_count({"CUDA_VISIBLE_DEVICES": ""}) == 0  # GPUs hidden on purpose
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert gpu_count({}) == 2


@pytest.mark.distributed
def test_killing_a_job_spares_another_jobs_process_that_took_a_recorded_pid(tmp_path: Path) -> None:
    """Pids are recycled: a rank recorded in a heartbeat file, long dead, may share its pid with
    the session leader of another test's job started since. Killing the first job spares it."""
    from fsdp_cli.rundir.heartbeat import Heartbeat

    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    other = start(sleep)  # a session leader: its sid is its pid
    run_dir = tmp_path / "run"
    Heartbeat(run_dir, rank=0, local_rank=0)
    beat = run_dir / ".heartbeat" / "rank0"
    header, rest = beat.read_text().split("\n", 1)
    beat.write_text(header.replace(f'"pid": {os.getpid()}', f'"pid": {other.pid}') + "\n" + rest)
    mine = start([*sleep, str(run_dir)], run_dir=run_dir)
    assert other.pid not in mine.processes() and mine.pid in mine.processes()
    mine.kill()
    assert other.poll() is None and mine.poll() is not None
    other.kill()


def test_a_failed_command_reports_its_first_traceback_last() -> None:
    """torchrun prints the failed rank's traceback, then its own summary (a traceback of its own and
    a table of ranks): a report cut to its tail must still show the rank's exception."""
    from harness import Result

    rank = 'Traceback (most recent call last):\n  File "x.py", line 3, in <module>\nValueError: boom'
    agent = "Traceback (most recent call last):\n  File run.py\nChildFailedError:\n" + "summary\n" * 50
    report = str(Result(["torchrun"], 1, "", f"noise\n{rank}\nW1207 SIGTERM\n{agent}"))
    assert report.endswith(f"--- the first traceback in stderr ---\n{rank}")
    assert str(Result(["true"], 1, "out", "no traceback")) == "exit 1\nout\nno traceback"
    prefixed = "\n".join(f"[rank1]: {line}" for line in rank.splitlines())  # (torch's, once a group is up)
    assert str(Result(["torchrun"], 1, "", f"{prefixed}\n[rank0]: other\n{agent}")).endswith(prefixed)
