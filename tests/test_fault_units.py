"""The pieces behind fault handling, in-process (no ranks started): the agent's choice of the first
failure, the hang watchdog's clock, where a stack dump says a rank is, the non-finite guard,
strict JSON, heartbeat files, and checkpoint verification."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from fsdp_cli.callbacks.nonfinite import NonFiniteError, NonFiniteGuard
from fsdp_cli.checkpoint.atomic import file_record, file_records
from fsdp_cli.checkpoint.format import CheckpointFormatError
from fsdp_cli.checkpoint.run import newest_verified
from fsdp_cli.checkpoint.verify import verify_checkpoint
from fsdp_cli.launch.stacks import where_from_faulthandler, where_from_py_spy
from fsdp_cli.launch.watchdog import HangWatchdog
from fsdp_cli.rundir.failure import merge_failure
from fsdp_cli.rundir.heartbeat import Heartbeat, PhaseLimits, RankBeat, read_heartbeats
from fsdp_cli.rundir.summary import dumps_strict

# --------------------------------------------------------------------------- the agent's report


def _failure(rank: int, exitcode: int, message: str, timestamp: int, tmp_path: Path) -> object:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    error_file = tmp_path / f"error{rank}.json"
    if message:
        error_file.write_text(json.dumps({"message": message, "timestamp": timestamp}))
    failure = ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(error_file))
    failure.timestamp = timestamp
    return failure


def test_first_failure_sets_collateral_errors_aside(tmp_path: Path) -> None:
    """The survivor's "connection reset" carries an earlier whole-second timestamp than the
    SIGKILL the agent saw on its next poll: it must still not be named as the cause."""
    from fsdp_cli.launch.agent import failure_report

    failures = {
        0: _failure(0, 1, "RuntimeError: [gloo] Read error: Connection reset by peer", 99, tmp_path),
        1: _failure(1, -signal.SIGKILL, "", 100, tmp_path),
    }
    report = failure_report(failures)
    assert (report["rank"], report["signal"], report["agreed"]) == (1, "SIGKILL", False)
    assert (
        report["error"] == "rank 1 was killed by SIGKILL (the kernel's out-of-memory killer sends this too)"
    )
    assert report["ranks"]["0"]["collateral"] is True
    # A pid the launcher killed after the death is collateral too, whatever its exit.
    failures = {
        0: _failure(0, -signal.SIGKILL, "", 99, tmp_path),
        1: _failure(1, -signal.SIGSEGV, "", 100, tmp_path),
    }
    report = failure_report(failures, killed=frozenset({1000}))
    assert report["error"] == "rank 1 was killed by SIGSEGV (segmentation fault)"


def test_failure_descriptions(tmp_path: Path) -> None:
    from fsdp_cli.launch.agent import describe, failure_report

    assert describe(_failure(2, 137, "", 1, tmp_path)).startswith("exit code 137 (128+9: SIGKILL")
    assert describe(_failure(2, 1, "ValueError: bad\nsecond line", 1, tmp_path)) == "exit code 1: second line"
    same = "non-finite loss (rank 1) at step 3"
    report = failure_report({0: _failure(0, 1, same, 5, tmp_path), 1: _failure(1, 1, same, 5, tmp_path)})
    assert report["agreed"] and report["error"] == f"ranks 0,1 failed: exit code 1: {same}"


def test_merge_keeps_the_cause_first() -> None:
    rank_summary = {"status": "failed", "error": "RuntimeError: Connection reset by peer", "steps": 2}
    failure = {"error": "rank 1 failed first: killed by SIGKILL", "agreed": False}
    merged = merge_failure(rank_summary, failure)
    assert merged["error"] == failure["error"] and merged["rank_error"] == rank_summary["error"]
    agreed = merge_failure(
        {"error": "non-finite loss at step 3"}, {"error": "ranks 0,1 failed: ...", "agreed": True}
    )
    assert agreed["error"] == "non-finite loss at step 3" and agreed["status"] == "failed"


# --------------------------------------------------------------------------- watchdog, stacks


def _beat(rank: int, beats: int, phase: str = "train") -> RankBeat:
    return RankBeat(
        rank=rank, pid=100 + rank, parent=99, host="h", beats=beats, step=beats, time=0.0, phase=phase
    )


def test_hang_watchdog_times_the_phase_ranks_are_in(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    watchdog = HangWatchdog(PhaseLimits(hang_s=10, startup_s=100, first_step_s=30))
    assert not watchdog.check({0: _beat(0, 5), 1: _beat(1, 5)})
    now[0] += 9
    assert not watchdog.check({0: _beat(0, 5), 1: _beat(1, 5)})
    now[0] += 2  # 11 s without a beat
    assert watchdog.check({0: _beat(0, 5), 1: _beat(1, 5)})
    assert not watchdog.check({0: _beat(0, 6), 1: _beat(1, 5)}), "any rank's progress resets the clock"
    now[0] += 50  # a rank in a save gets the start-up timeout
    assert not watchdog.check({0: _beat(0, 6, "save"), 1: _beat(1, 5)})
    now[0] += 60
    assert watchdog.check({0: _beat(0, 6, "save"), 1: _beat(1, 5)})
    assert watchdog.limit == ("launcher.startup_timeout_s", 100)
    # From the start of training to the end of the first step: a limit of its own.
    assert not watchdog.check({0: _beat(0, 7, "first"), 1: _beat(1, 5, "first")})
    now[0] += 29
    assert not watchdog.check({0: _beat(0, 7, "first"), 1: _beat(1, 5, "first")})
    now[0] += 2
    assert watchdog.check({0: _beat(0, 7, "first"), 1: _beat(1, 5, "first")})
    assert watchdog.limit == ("launcher.first_step_timeout_s", 30)
    now[0] += 1  # a rank still starting up: the longest limit of the phases ranks are in
    assert not watchdog.check({0: _beat(0, 7, "first"), 1: _beat(1, 5, "start")})
    off = HangWatchdog(PhaseLimits(hang_s=None, startup_s=None, first_step_s=None))
    now[0] += 1e6
    assert not off.check({})


FAULTHANDLER_DUMP = """Thread 0x00007f8b (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 327 in wait
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

Current thread 0x00007f8c (most recent call first):
  File "/site-packages/torch/distributed/distributed_c10d.py", line 4394 in all_gather_single
  File "/site-packages/torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py", line 119 in __call__
  File "/work/fsdp_cli/worker.py", line 155 in fit
  File "<frozen runpy>", line 88 in _run_code
  File "/work/fsdp_cli/worker.py", line 278 in <module>
"""


def test_where_a_stack_dump_says_a_rank_is() -> None:
    assert where_from_faulthandler(FAULTHANDLER_DUMP) == "waiting in a collective (all_gather_single)"
    loader = FAULTHANDLER_DUMP.replace(
        "torch/distributed/distributed_c10d.py", "torch/utils/data/dataloader.py"
    )
    assert where_from_faulthandler(loader) == "waiting for the data loader"
    spy = 'Thread 12 (idle): "MainThread"\n    misbehave (tests/assets/faulty.py:69)\n    forward (faulty.py:58)\n'
    assert where_from_py_spy(spy) == "in misbehave (faulty.py:69)"


def test_heartbeat_is_read_back_and_torn_files_are_skipped(tmp_path: Path) -> None:
    beat = Heartbeat(tmp_path, rank=1, local_rank=1)
    beat.beat(7, "train")
    read = read_heartbeats(tmp_path)[1]
    assert (read.pid, read.step, read.beats, read.phase) == (os.getpid(), 7, 1, "train")
    (tmp_path / ".heartbeat" / "rank2").write_text('{"rank": 2, "pid"')  # being written
    assert set(read_heartbeats(tmp_path)) == {1}


# --------------------------------------------------------------------------- non-finite values


def test_nonfinite_guard_names_the_first_bad_step() -> None:
    guard = NonFiniteGuard()
    for step, loss in ((1, 2.0), (2, math.nan), (3, 1.5)):
        guard.record_loss(step, torch.tensor(loss))
    with pytest.raises(NonFiniteError, match=r"non-finite loss \(rank 0\) at step 2 \(detected at step 3\)"):
        guard.check(3)
    guard.record_loss(4, torch.tensor(1.25))
    assert guard.check(4) == 1.25 and not guard.pending


class _Optimizer:
    def __init__(self) -> None:
        self.cleared = 0

    def zero_grad(self, set_to_none: bool = False) -> None:
        assert set_to_none, "parameters without gradients are what optimizers leave alone"
        self.cleared += 1


class _Clipping:
    grad_norm: torch.Tensor | None = None


def test_skipping_drops_the_gradients_until_the_budget_is_spent() -> None:
    clipping, optimizer = _Clipping(), _Optimizer()
    guard = NonFiniteGuard(skip_budget=1, clipping=clipping)

    class Trainer:
        global_step = 0

    for step, norm in enumerate((0.5, math.inf, 0.25), start=1):
        Trainer.global_step, clipping.grad_norm = step - 1, torch.tensor(norm)
        guard.on_before_optimizer_step(Trainer, None, optimizer)
        guard.record_loss(step, torch.tensor(1.0))
    assert guard.skipped == [2] and optimizer.cleared == 1
    assert guard.check(3) == 1.0, "a skipped step's non-finite norm does not fail the run"
    Trainer.global_step, clipping.grad_norm = 3, torch.tensor(math.nan)
    with pytest.raises(NonFiniteError, match=r"step 4; already skipped 1 step\(s\) .* at 2"):
        guard.on_before_optimizer_step(Trainer, None, optimizer)
    assert guard.state_dict() == {"skipped": [2]}


def test_json_written_by_a_run_is_strict() -> None:
    text = dumps_strict({"loss": math.nan, "norms": [1.0, math.inf], "ok": 2.5})
    assert json.loads(text) == {"loss": None, "norms": [1.0, None], "ok": 2.5}


# --------------------------------------------------------------------------- verification


def _sharded(folder: Path, step: int, shard: bytes = b"x" * 100) -> Path:
    """A sharded checkpoint's files (contents are opaque to the size and checksum check)."""
    folder.mkdir(parents=True)
    for name, data in ((".metadata", b"meta"), ("__0_0.distcp", shard), ("meta.pt", b"pt")):
        (folder / name).write_bytes(data)
    files = {name: file_record(folder / name) for name in (".metadata", "__0_0.distcp", "meta.pt")}
    (folder / "manifest.json").write_text(json.dumps({"step": step, "files": files}))
    return folder


def _dcp_sharded(folder: Path, step: int) -> Path:
    """A sharded checkpoint as fsdp-train writes one (DCP files, meta.pt, manifest), tiny."""
    import torch
    import torch.distributed.checkpoint as dcp

    dcp.save({"state_dict": {"w": torch.arange(4.0)}}, checkpoint_id=str(folder), no_dist=True)
    torch.save({"global_step": step}, folder / "meta.pt")
    names = sorted(p.name for p in folder.iterdir())
    (folder / "manifest.json").write_text(json.dumps({"step": step, "files": file_records(folder, names)}))
    return folder


def test_verify_finds_missing_truncated_and_corrupted_files(tmp_path: Path) -> None:
    good = _sharded(tmp_path / "good", 3)
    assert (
        verify_checkpoint(good, deep=True)
        .describe()
        .endswith("(sharded, step 3, 3 file(s), 0.0 MiB, sizes and checksums checked)")
    )
    truncated = _sharded(tmp_path / "truncated", 3)
    (truncated / "__0_0.distcp").write_bytes(b"x" * 10)
    with pytest.raises(CheckpointFormatError, match="__0_0.distcp has 10 bytes, the manifest records 100"):
        verify_checkpoint(truncated)
    corrupted = _sharded(tmp_path / "corrupted", 3)
    (corrupted / "__0_0.distcp").write_bytes(b"y" * 100)
    verify_checkpoint(corrupted)  # same size: only --deep can tell
    with pytest.raises(CheckpointFormatError, match="does not match its recorded checksum"):
        verify_checkpoint(corrupted, deep=True)
    missing = _sharded(tmp_path / "missing", 3)
    (missing / "meta.pt").unlink()
    with pytest.raises(CheckpointFormatError, match="meta.pt is missing"):
        verify_checkpoint(missing)
    unreadable = _sharded(tmp_path / "unreadable", 3)
    (unreadable / "manifest.json").write_text('{"step": 3, "fi')
    with pytest.raises(CheckpointFormatError, match="manifest.json is unreadable"):
        verify_checkpoint(unreadable)


def test_verify_full_files(tmp_path: Path) -> None:
    path = tmp_path / "step_00000003.pt"
    torch.save({"state_dict": {"w": torch.ones(3)}, "fsdp_cli_manifest": {"step": 3}}, path)
    assert verify_checkpoint(path, deep=True).step == 3
    path.write_bytes(path.read_bytes()[:-40])  # truncated: the zip directory at the end is gone
    with pytest.raises(CheckpointFormatError, match="truncated"):
        verify_checkpoint(path)


def test_resume_auto_falls_back_past_damaged_checkpoints(tmp_path: Path) -> None:
    _sharded(tmp_path / "step_00000002", 2)
    _sharded(tmp_path / "step_00000004", 4)
    (tmp_path / "step_00000004" / "__0_0.distcp").write_bytes(b"")
    _sharded(tmp_path / "step_00000006", 6)
    (tmp_path / "step_00000006" / "manifest.json").unlink()
    found, notices = newest_verified(tmp_path)
    assert found == tmp_path / "step_00000002"
    assert notices == [
        "note: resume=auto: skipping step_00000006: no manifest.json (the save did not finish, or not "
        "written by fsdp-train); trying the next newest (step_00000004)",
        "note: resume=auto: skipping step_00000004: __0_0.distcp has 0 bytes, the manifest records 100; "
        "trying the next newest (step_00000002)",
    ]


@pytest.mark.distributed
def test_without_a_launcher_a_rank_dumps_its_stack_and_exits_when_stuck(tmp_path: Path) -> None:
    """Inside torchrun or srun nobody watches the heartbeat: the rank's own faulthandler timer
    (re-armed by each beat) writes its stack into its log and ends it. (A process of its own:
    the timer ends the process it runs in.)"""
    import sys

    from conftest import run

    script = (
        "import time\n"
        "from fsdp_cli.rundir.heartbeat import PhaseLimits\n"
        "from fsdp_cli.worker.monitor import RankMonitor\n"
        f"monitor = RankMonitor({str(tmp_path)!r}, 1, 1, limits=PhaseLimits(0.5, 0.5, 0.5))\n"
        "monitor.beat(1, 'train')\n"
        "def stuck_in_a_collective():\n"
        "    time.sleep(30)\n"
        "stuck_in_a_collective()\n"
    )
    started = time.monotonic()
    result = run([sys.executable, "-c", script], env={"FSDP_CLI_WATCHDOG": ""}, timeout=60)
    assert result.returncode == 1 and time.monotonic() - started < 20
    log = (tmp_path / "logs" / "rank1.log").read_text()
    assert "Timeout (0:00:00.500000)!" in log and "stuck_in_a_collective" in log


def test_fsdp_ckpt_verify_exits_1_naming_each_damaged_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from fsdp_cli.cli.ckpt import main as fsdp_ckpt

    # (real DCP files: verify also reads what loading would unpickle, through its allowlist)
    _dcp_sharded(tmp_path / "step_00000002", 2)
    shard = _dcp_sharded(tmp_path / "step_00000004", 4) / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # same size, another checksum
    shard.write_bytes(bytes(data))
    with pytest.raises(SystemExit) as stop:
        fsdp_ckpt(["verify", str(tmp_path), "--deep"])  # a run's checkpoint folder: each of them
    out = capsys.readouterr()
    assert stop.value.code == 1
    assert "step_00000002: ok (sharded, step 2" in out.out
    assert out.err.strip() == (
        f"fsdp-ckpt: damaged: {tmp_path}/step_00000004: __0_0.distcp does not match its recorded checksum (corrupted)"
    )
    with pytest.raises(SystemExit) as stop:
        fsdp_ckpt(["verify", str(tmp_path / "step_00000002")])
    assert stop.value.code == 0


def test_a_launcher_watches_only_the_ranks_its_agent_started() -> None:
    """Nodes sharing a run directory (on one host, as in the two-node test) see each other's files."""
    from dataclasses import replace

    from fsdp_cli.launch.watchdog import own_beats

    beats = {0: _beat(0, 3), 1: replace(_beat(1, 3), parent=42)}
    assert set(own_beats(beats, agent_pid=99)) == {0} and set(own_beats(beats, agent_pid=42)) == {1}


def test_merge_keeps_the_line_the_failing_rank_wrote_itself() -> None:
    own = {"error": "RuntimeError: out of memory"}
    first = {
        "error": "rank 0 failed first: exit code 1: RuntimeError: out of memory",
        "message": own["error"],
    }
    assert merge_failure(own, first)["error"] == own["error"]


TEARDOWN_WITNESS = (
    "class Witness:\n"
    "    def __del__(self):\n"  # runs when the interpreter frees __main__'s globals at exit
    "        print('torn down', flush=True)\n"
    "witness = Witness()\n"
)


@pytest.mark.distributed
def test_agent_and_forkserver_end_without_tearing_down_their_interpreters(tmp_path: Path) -> None:
    """The agent (exit_now) and the forkserver (the hook fsdp_cli.worker.preload registers) end
    without freeing what they imported, which took 1-4 s of CPU after each run, fsdp-train's
    stdout held open meanwhile. The agent still runs every exit handler a normal exit runs:
    multiprocessing removes its temporary directory (the forkserver's socket lies there)."""
    import sys

    from conftest import run

    plain = run([sys.executable, "-c", TEARDOWN_WITNESS], timeout=60)
    assert (plain.returncode, plain.stdout) == (0, "torn down\n"), plain  # the witness sees a teardown
    agent = run(
        [
            sys.executable,
            "-c",
            "import multiprocessing.util\n"
            "from fsdp_cli.launch.environment import exit_now\n"
            "print(multiprocessing.util.get_temp_dir(), flush=True)\n" + TEARDOWN_WITNESS + "exit_now(3)\n",
        ],
        timeout=60,
    )
    temp_dir = Path(agent.stdout.splitlines()[0])
    assert (agent.returncode, agent.stdout.splitlines()[1:]) == (3, []), agent
    assert temp_dir.name.startswith("pymp-") and not temp_dir.exists()
    # Imported by a child of the agent (the forkserver is one): its parent's pid in the variable.
    server = run(
        [sys.executable, "-c", "import fsdp_cli.worker.preload\n" + TEARDOWN_WITNESS],
        env={"FSDP_CLI_AGENT_PID": str(os.getpid())},
        timeout=120,
    )
    assert (server.returncode, server.stdout) == (0, ""), server


FORKED_RANK_START = """
import logging, signal
from fsdp_cli.launch.environment import AGENT_LOGGER
from fsdp_cli.worker import process

def torch_agents_handler(signum, frame):  # what torch's agent installs before it forks ranks
    raise RuntimeError(signum)

for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
    signal.signal(signum, torch_agents_handler)
logging.getLogger(AGENT_LOGGER).setLevel(logging.CRITICAL)
process.leave_the_process_it_was_forked_from()
print([signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)] == [signal.SIG_DFL] * 3)
print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)
print(logging.getLogger(AGENT_LOGGER).level == logging.NOTSET)
"""


@pytest.mark.distributed
def test_a_forked_rank_leaves_the_agents_signal_handlers_and_log_levels(tmp_path: Path) -> None:
    """A rank forked from the agent (``launcher.start_method=fork``) starts as a copy of it: torch's
    agent turns SIGTERM, SIGINT, SIGHUP and SIGQUIT into its own exception, and ours silences
    torch's elastic logs. The rank starts with Python's defaults instead (a Ctrl-C is Lightning's
    KeyboardInterrupt: test_faults' Ctrl-C test fails without this). The process here stands for
    such a copy; its parent stands for the agent."""
    import sys

    from conftest import run

    r = run(
        [sys.executable, "-c", FORKED_RANK_START],
        env={"FSDP_CLI_AGENT_PID": str(os.getpid())},
        timeout=60,
    )
    assert (r.returncode, r.stdout.split()) == (0, ["True", "True", "True"]), r


PRELOADED_THEN_FORKED = """
import gc, os, sys
import fsdp_cli.worker.preload  # what the agent imports before it forks ranks

class Cycle:
    pass

frozen = gc.get_freeze_count()
assert gc.isenabled()
if os.fork() == 0:  # a rank
    garbage = Cycle()
    garbage.self = garbage
    del garbage
    print(gc.isenabled(), frozen > 100_000, gc.get_freeze_count() > 100_000, gc.collect() >= 1)
    sys.stdout.flush()
    os._exit(0)
os.wait()
"""


@pytest.mark.distributed  # a Python process that imports torch and Lightning
def test_what_the_agent_preloads_is_frozen_and_its_ranks_still_collect_garbage(tmp_path: Path) -> None:
    """The objects made by the agent's import of torch and Lightning (over 100,000) are frozen out
    of the collector's passes, in the agent and in every rank forked from it; the collector stays
    on in the rank and collects the rank's own garbage (a reference cycle here)."""
    import sys

    from conftest import run

    r = run([sys.executable, "-c", PRELOADED_THEN_FORKED], timeout=120)
    assert (r.returncode, r.stdout.split()) == (0, ["True", "True", "True", "True"]), r


class _Agent:
    """torch's elastic agent as the launcher sees it: alive until its ranks are killed (it would
    wait ``launcher.shutdown_timeout_s`` for their save on SIGTERM)."""

    pid = os.getppid()  # this test process is then its "rank" (kill_groups is replaced: nothing is killed)

    def __init__(self) -> None:
        self.code: int | None = None
        self.signals: list[int] = []

    def send_signal(self, signum: int) -> None:
        self.signals.append(signum)

    def wait(self, timeout: float | None = None) -> int:
        if self.code is None:
            time.sleep(min(timeout or 0.0, 0.05))
            raise subprocess.TimeoutExpired("agent", timeout or 0.0)
        return self.code

    def kill(self) -> None:
        self.code = -signal.SIGKILL


@pytest.mark.parametrize("phase", ["train", "save"])
def test_sigterm_ends_a_run_within_the_ctrl_c_grace_unless_the_save_is_under_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], phase: str
) -> None:
    """A rank inside a long step (a 124M model on CPU: minutes) is killed once
    launcher.interrupt_grace_s has passed since SIGTERM, and the launcher says the save did not
    finish; a rank already saving is left to finish."""
    from conftest import composed

    from fsdp_cli.launch import launcher
    from fsdp_cli.rundir.heartbeat import Heartbeat

    cfg = composed("launcher.interrupt_grace_s=0.5")
    cfg = dataclasses.replace(cfg, run_dir=str(tmp_path))
    agent = _Agent()
    Heartbeat(tmp_path, rank=0, local_rank=0, parent=agent.pid).beat(3, phase)
    killed: list[int] = []

    def kill_groups(pids: Any) -> None:
        killed.extend(pids)
        agent.code = 1  # the agent sees its rank die and exits

    monkeypatch.setattr(launcher, "kill_groups", kill_groups)
    supervisor = launcher.Supervisor(cfg, agent)  # type: ignore[arg-type]
    save_ends = threading.Timer(3.0, lambda: setattr(agent, "code", agent.code or 143))
    save_ends.start()
    started = time.monotonic()
    supervisor.terminate()
    code = supervisor.run()
    elapsed = time.monotonic() - started
    save_ends.cancel()
    assert agent.signals == [signal.SIGTERM]
    err = capsys.readouterr().err
    if phase == "train":
        assert (code, killed) == (143, [os.getpid()]) and 0.5 <= elapsed < 2.0, (code, killed, elapsed)
        assert (
            "SIGTERM: the ranks did not reach a step boundary within launcher.interrupt_grace_s=0.5 s" in err
        )
        assert "nothing was saved by this stop" in err
    else:
        assert (code, killed) == (143, []) and elapsed >= 2.5, (code, killed, elapsed)
        assert "did not reach a step boundary" not in err
    assert "SIGTERM: the ranks save at the next step boundary; waiting up to 0.5 s" in err


def test_the_grace_of_a_stop_follows_the_steps_measured(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """launcher.interrupt_grace_s=null: 1.5 x the longest step the heartbeats showed (the first
    step, with its compilation and first batches, not counted), at least 20 s; a step and a save
    longer than launcher.shutdown_timeout_s are warned about once, before a stop finds out."""
    from conftest import composed

    from fsdp_cli.builders.callbacks import stop_notes
    from fsdp_cli.launch import launcher
    from fsdp_cli.launch.watchdog import StepTimes

    def beat(step: int, when: float, phase: str) -> dict[int, RankBeat]:
        return {0: RankBeat(rank=0, pid=1, parent=2, host="h", beats=step, step=step, time=when, phase=phase)}

    cfg = dataclasses.replace(composed("launcher.shutdown_timeout_s=40"), run_dir=str(tmp_path))
    supervisor = launcher.Supervisor(cfg, _Agent())  # type: ignore[arg-type]
    assert supervisor.interrupt_grace_s == 20.0, "nothing measured yet: the floor"
    times = supervisor.times
    for step, when, phase in [(0, 100, "first"), (1, 160, "train"), (2, 197, "train"), (3, 227, "train")]:
        times.update(beat(step, when, phase))
    assert times.step_s == 37.0 and supervisor.interrupt_grace_s == 55.5
    assert StepTimes().grace_s(3.0) == 3.0 and times.grace_s(3.0) == 3.0, "a value given is kept"
    supervisor._warn_if_a_stop_cannot_save()
    assert capsys.readouterr().err == ""
    times.update(beat(3, 228, "save"))
    times.update(beat(4, 270, "train"))  # the save and the step after it: 42 s
    assert times.save_s == 42.0 and times.stop_s == 42.0
    supervisor._warn_if_a_stop_cannot_save()
    supervisor._warn_if_a_stop_cannot_save()
    err = capsys.readouterr().err
    assert err.count("warning: a step and a save take 42 s here") == 1, err
    assert "launcher.shutdown_timeout_s=40" in err
    # Said at the run's start, by rank 0's setup report.
    (note,) = stop_notes(cfg)
    assert note.startswith("on SIGTERM: a checkpoint at the next step boundary, waited for up to 1.5 x")
    assert stop_notes(composed("checkpoint.save_on_sigterm=false")) == ()


def test_fsdp_ckpt_inspect_and_verify_agree_on_every_file_fsdp_ckpt_writes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A full file, its sharded and safetensors conversions, and the folder holding them: both
    tools take each, and say the same step (verify said "step ?" of a full file; inspect refused
    the folder and the safetensors export)."""
    from fsdp_cli.checkpoint.format import MANIFEST_KEY
    from fsdp_cli.cli.ckpt import main as fsdp_ckpt

    def run(*args: str) -> tuple[int, str]:
        code = 0
        try:
            fsdp_ckpt(list(args))
        except SystemExit as exit_:
            code = int(exit_.code or 0)
        out, err = capsys.readouterr()
        return code, out + err

    full = tmp_path / "step_00000030.pt"
    state = {"state_dict": {"w": torch.ones(3, 2)}, "optimizer_states": [], "global_step": 30}
    torch.save({**state, MANIFEST_KEY: {"step": 30}}, full)
    for name, to in (("step_00000030", "sharded"), ("weights.safetensors", "safetensors")):
        fsdp_ckpt(["convert", str(full), str(tmp_path / name), "--to", to])
    capsys.readouterr()
    for path in (full, tmp_path / "step_00000030", tmp_path / "weights.safetensors"):
        code, out = run("verify", str(path))
        assert code == 0 and "step 30," in out, out
        code, out = run("inspect", str(path), "--json")
        assert code == 0 and json.loads(out)["step"] == 30, out
    code, out = run("verify", str(tmp_path))
    verified = sorted(line.split(": ok")[0].rsplit("/", 1)[-1] for line in out.splitlines())
    code_inspect, listing = run("inspect", str(tmp_path), "--json")
    inspected = sorted(Path(info["path"]).name for info in json.loads(listing))
    assert (code, code_inspect) == (0, 0) and verified == inspected == ["step_00000030", "step_00000030.pt"]
    assert all(info["step"] == 30 for info in json.loads(listing))


def test_rank0s_console_copy_that_fails_is_dropped_not_the_run() -> None:
    """Rank 0's console is copied into logs/rank0.log; a copy that cannot be written (a full disk)
    stops being written, while the console keeps every line and training goes on."""
    import io

    from fsdp_cli.worker.process import Tee

    class FullDisk(io.StringIO):
        def write(self, text: str) -> int:
            raise OSError(28, "No space left on device")

    console, log = io.StringIO(), io.StringIO()
    Tee(console, log).write("step 1\n")
    assert console.getvalue() == log.getvalue() == "step 1\n"
    console = io.StringIO()
    tee = Tee(console, FullDisk())
    tee.write("step 1\n")
    tee.write("step 2\n")
    tee.flush()
    assert console.getvalue() == "step 1\nstep 2\n"
