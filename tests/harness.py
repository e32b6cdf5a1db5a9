"""The one way tests start processes: ``fsdp-train`` (or any command) started as a user would,
with its output in files, and everything it started killed when the test ends.

A job is found by three marks, any of which is enough (the second and third only for a process
that carries no job's variable: one exiting reads an empty environment):

* an environment variable naming the job (``FSDP_CLI_TEST_JOB``), which every process it starts
  inherits: torch's agent, the ranks (torch starts each in a session of its own), their
  data-loader workers, a sweep's jobs;
* the sessions it records: the command's own (it is started as a session leader) and each rank's
  (their pids, from the run directory's heartbeat files; torch makes every rank a session leader);
* its run directory named on a command line.

``kill`` SIGKILLs every process so found, again until none is left (a process forked between two
sweeps is caught by the next). Output goes to files, never to pipes: a job nobody reads never
blocks on a full pipe, and reading the output of a job still running never waits for it.

Tests that are not marked ``distributed`` start no process: conftest makes any attempt fail.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SEAMS = Path(__file__).resolve().parent / "seams"
"""The fault-injection seam a job loads when a test hands it FSDP_CLI_TEST_PAUSE_* variables."""
JOB_LOG = "FSDP_CLI_TEST_JOB_LOG"
"""A file each job appends a line to as it is closed (seconds from start to close, the test, the
command): set it to see where the suite's time goes."""
TAG = "FSDP_CLI_TEST_JOB"
"""The environment variable every process of a job inherits: its value names the job."""
ENTRY_MODULES = {
    "fsdp-train": "fsdp_cli.cli.entry",
    "fsdp-ckpt": "fsdp_cli.cli.ckpt",
    "fsdp-plan": "fsdp_cli.cli.plan",
    "fsdp-recipe": "fsdp_cli.cli.recipes",
    "fsdp-data": "fsdp_cli.cli.data",
    "fsdp-generate": "fsdp_cli.cli.generate",
}


def entry_point(name: str) -> list[str]:
    """The installed console script (as a user runs it), or its module when run from a checkout."""
    script = Path(sys.executable).parent / name
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-m", ENTRY_MODULES[name]]


@dataclass
class Result:
    """What a finished command left: its status and its output."""

    args: list[str]
    returncode: int
    stdout: str
    stderr: str

    @property
    def out(self) -> str:
        """stdout then stderr (one stream, in the order written, when started with ``merge_output``)."""
        return self.stdout + self.stderr

    def __str__(self) -> str:  # what pytest shows when an assert on a Result fails
        text = f"exit {self.returncode}\n{self.stdout[-4000:]}\n{self.stderr[-4000:]}"
        first = first_traceback(self.stderr)
        # Last, where a shortened report still shows it: torchrun's summary of the failed ranks
        # comes after the rank's own traceback and pushes it out of the tail.
        return text + (f"\n--- the first traceback in stderr ---\n{first}" if first else "")


def first_traceback(text: str, lines: int = 40) -> str:
    """The first Python traceback in ``text``, up to its exception line (at most ``lines`` lines;
    a rank's lines may carry torch's ``[rank1]: `` prefix)."""
    rows = text.splitlines()
    start = next((i for i, row in enumerate(rows) if "Traceback (most recent call last)" in row), None)
    if start is None:
        return ""
    prefix = rows[start][: rows[start].index("Traceback")]
    block = rows[start : start + lines]
    end = next(
        (
            i
            for i, row in enumerate(block[1:], 1)
            if not row.startswith(prefix) or (row[len(prefix) :] and not row[len(prefix)].isspace())
        ),
        len(block) - 1,
    )
    return "\n".join(block[: end + 1])


class Job:
    """A started command (in a session of its own) and everything it starts."""

    def __init__(
        self,
        cmd: list[str],
        *,
        run_dir: Path | None = None,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        merge_output: bool = False,
    ) -> None:
        self.tag = uuid.uuid4().hex
        self.run_dir = run_dir
        self._logs = Path(tempfile.mkdtemp(prefix="fsdp-cli-test-"))
        full_env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
        full_env.setdefault("OMP_NUM_THREADS", "1")
        full_env.update(env or {})
        if any(key.startswith("FSDP_CLI_TEST_") for key in env or {}):
            # The fault-injection seam (tests/seams/sitecustomize.py) acts on these variables.
            full_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SEAMS), full_env.get("PYTHONPATH")) if p)
        full_env[TAG] = self.tag
        try:
            with open(self._logs / "stdout", "w") as out, open(self._logs / "stderr", "w") as err:
                self.proc = subprocess.Popen(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT if merge_output else err,
                    text=True,
                    env=full_env,
                    cwd=cwd or REPO,
                    start_new_session=True,
                )
        except BaseException:  # nothing started (a missing program, the fast tier's refusal)
            self._remove_logs()
            raise
        self.args = cmd
        self._started = time.monotonic()
        self._ended: float | None = None

    # ------------------------------------------------------------------ as a Popen

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def poll(self) -> int | None:
        return self.proc.poll()

    def send_signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def communicate(self, timeout: float) -> tuple[str, str]:
        """Wait for the command to end (killing the job on a timeout) and return its output."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        self._ended = time.monotonic()
        return self.output()

    def output(self) -> tuple[str, str]:
        """stdout and stderr so far (the job may still run)."""
        return tuple((self._logs / name).read_text(errors="replace") for name in ("stdout", "stderr"))  # type: ignore[return-value]

    def result(self, timeout: float) -> Result:
        stdout, stderr = self.communicate(timeout)
        return Result(self.args, self.proc.returncode, stdout, stderr)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ everything it started

    def processes(self) -> list[int]:
        """Live processes of this job (zombies are dead: only their parent's wait is missing)."""
        table = _process_table()
        sessions = {self.proc.pid, *self._recorded_sessions()}
        sessions |= {p.sid for p in table if p.tag == self.tag}
        named = str(self.run_dir) if self.run_dir is not None else None
        # The other marks never take a process that carries another job's tag: pids are recycled
        # (pid_max is 32,768 here, and every thread takes one), so a recorded rank's pid, long
        # dead, can lead the session of another test's job started since.
        return [
            p.pid
            for p in table
            if p.tag == self.tag
            or (p.tag is None and (p.sid in sessions or (named is not None and named in p.cmdline)))
        ]

    def _recorded_sessions(self) -> set[int]:
        """The ranks' sessions, as the run directory records them (each rank leads its own)."""
        if self.run_dir is None:
            return set()
        from fsdp_cli.rundir.heartbeat import read_heartbeats

        try:
            return {beat.pid for beat in read_heartbeats(self.run_dir).values()}
        except (OSError, ValueError):
            return set()

    def kill(self) -> None:
        """SIGKILL every process of the job until none is left, then reap the command."""
        deadline = time.monotonic() + 30
        killed: set[int] = set()
        while True:
            pids = self.processes()
            if self.proc.poll() is None:
                pids.append(self.proc.pid)
            # A killed process is gone once it is a zombie: while it exits (a large address space
            # takes a while to free) its environment reads empty and it may match no mark.
            if not pids and not alive(sorted(killed)):
                break
            killed.update(pids)
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"could not kill processes {pids} of {self.args}")
            time.sleep(0.05)
        self.proc.wait()

    def close(self) -> None:
        self.kill()
        self._remove_logs()
        log = os.environ.get(JOB_LOG)
        if log:  # one line per job: what the suite's time is spent on
            with open(log, "a") as f:
                f.write(
                    f"{(self._ended or time.monotonic()) - self._started:8.2f} {os.environ.get('PYTEST_CURRENT_TEST', '?').split(' ')[0]} {' '.join(self.args[1:])[:300]}\n"
                )

    def _remove_logs(self) -> None:
        for name in ("stdout", "stderr"):
            (self._logs / name).unlink(missing_ok=True)
        self._logs.rmdir()


@dataclass(frozen=True)
class _Process:
    pid: int
    sid: int
    cmdline: str
    tag: str | None


def _process_table() -> list[_Process]:
    """Every live process this user may inspect, but this one (and never a zombie)."""
    found = []
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
            if fields[0] in ("Z", "X"):
                continue
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError):
            continue
        prefix = f"{TAG}=".encode()
        tag = next((v[len(prefix) :].decode() for v in environ if v.startswith(prefix)), None)
        found.append(_Process(int(entry.name), int(fields[3]), cmdline, tag))
    return found


def processes_naming(text: str) -> list[int]:
    """Live processes whose command line contains ``text``."""
    return [p.pid for p in _process_table() if text in p.cmdline]


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


def gone(job: Job, pids: list[int], within: float = 30) -> float:
    """Seconds until no process of ``job`` (nor any of ``pids``) is left; fails after ``within``."""
    started = time.monotonic()
    while alive(pids) or job.processes():
        elapsed = time.monotonic() - started
        assert elapsed < within, f"still alive after {elapsed:.0f} s: {alive(pids) or job.processes()}"
        time.sleep(0.2)
    return time.monotonic() - started
