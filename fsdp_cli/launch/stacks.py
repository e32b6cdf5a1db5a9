"""Python stacks of stuck ranks: a faulthandler signal handler in every rank, a dumper in the launcher.

Rank side: :func:`install_stack_dumps` registers ``faulthandler`` for :data:`STACK_SIGNAL` on the
rank's log. faulthandler's handler is C code that walks the interpreter's thread states itself,
so it dumps even while the main thread is blocked inside a C call (a gloo or NCCL collective, a
data-loader queue, ``time.sleep``) and never needs the GIL, unlike a ``signal.signal`` handler,
which runs only once the blocking call returns.

Launcher side: :func:`dump_stacks` signals each live rank (pids from the heartbeat files, written
only after the handler is installed), reads what each log gained, and says in one phrase where
each rank is (:func:`where_from_faulthandler`). A stopped rank (SIGSTOP) runs no handler: it is
reported as stopped and, when ``py-spy`` is installed, dumped with it (py-spy reads a stopped
process's memory without resuming it).

Torch-free.
"""

from __future__ import annotations

import faulthandler
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

STACK_SIGNAL = signal.SIGUSR2
"""Not SIGUSR1: SLURM jobs written for Lightning ask for ``--signal=SIGUSR1@90`` before their
time limit, and a rank treats that as a request to save and stop (see
:mod:`fsdp_cli.checkpoint.callback`)."""
_KEEP_OPEN: list[IO[Any]] = []  # faulthandler keeps only the file descriptor: the file must stay open


def install_stack_dumps(log_path: Path) -> IO[Any]:
    """Rank side: dump every thread's Python stack into ``log_path`` on :data:`STACK_SIGNAL`.

    Must run before the rank publishes its pid (the signal's default action terminates)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    stream = open(log_path, "a")  # open for the life of the process
    _KEEP_OPEN.append(stream)
    faulthandler.register(STACK_SIGNAL, file=stream, all_threads=True, chain=False)
    return stream


# ------------------------------------------------------------------------------- launcher side

_STATE_NAMES = {
    "R": "running",
    "S": "sleeping",
    "D": "in uninterruptible sleep (D state: I/O or a driver call)",
    "T": "stopped (SIGSTOP/SIGTSTP)",
    "t": "stopped by a tracer",
    "Z": "exited",
}


def proc_state(pid: int) -> str | None:
    """The one-letter state in ``/proc/<pid>/stat``; None when the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[0]  # the command name may hold spaces and ')'


def parent_pid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return None


@dataclass
class RankStack:
    """One rank's stack and where it was when the launcher looked."""

    rank: int
    pid: int
    state: str | None
    where: str = ""
    """One phrase: ``waiting in a collective (all_reduce)``, ``in forward (model.py:12)``, ..."""
    dumper: str = ""
    """``faulthandler``, ``py-spy`` or empty when no stack could be taken."""
    notes: list[str] = field(default_factory=list)

    @property
    def waiting_on_others(self) -> bool:
        return self.where.startswith("waiting in a collective")


def dump_stacks(pids: dict[int, int], log_dir: Path, *, wait_s: float = 2.0) -> dict[int, RankStack]:
    """Dump every rank's stack into ``log_dir/rank<N>.log``; ``pids`` maps rank -> pid."""
    reports: dict[int, RankStack] = {}
    sizes: dict[int, int] = {}
    for rank, pid in sorted(pids.items()):
        state = proc_state(pid)
        reports[rank] = RankStack(rank, pid, state)
        if state is None or state == "Z":
            reports[rank].where = "exited"
        elif state in "Tt":
            reports[rank].where = _STATE_NAMES[state]
        else:
            sizes[rank] = _size(log_dir / f"rank{rank}.log")
            os.kill(pid, STACK_SIGNAL)
    _wait_until_written(sizes, log_dir, wait_s)
    for rank, start in sizes.items():
        text = _read_from(log_dir / f"rank{rank}.log", start)
        report = reports[rank]
        report.dumper = "faulthandler" if text else ""
        report.where = where_from_faulthandler(text) if text else "no stack (its handler did not run)"
        if report.state == "D":
            report.notes.append(_STATE_NAMES["D"])
    for report in reports.values():
        if report.where.startswith(("stopped", "no stack")):
            _add_py_spy_dump(report, log_dir / f"rank{report.rank}.log")
    return reports


def _size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def _read_from(path: Path, offset: int) -> str:
    with open(path, "rb") as fh:
        fh.seek(offset)
        return fh.read().decode(errors="replace")


def _wait_until_written(sizes: dict[int, int], log_dir: Path, wait_s: float) -> None:
    """faulthandler writes synchronously in the handler: wait until each log grew and settled."""
    deadline = time.monotonic() + wait_s
    last = dict(sizes)
    while last and time.monotonic() < deadline:
        time.sleep(0.05)
        for rank in list(last):
            size = _size(log_dir / f"rank{rank}.log")
            if size > sizes[rank] and size == last[rank]:
                del last[rank]
            else:
                last[rank] = size


def _add_py_spy_dump(report: RankStack, log: Path) -> None:
    py_spy = shutil.which("py-spy")
    if py_spy is None:
        report.notes.append("install py-spy to see its stack")
        return
    # --nonblocking reads memory without pausing the target, so it works on a stopped process.
    try:
        out = subprocess.run(
            [py_spy, "dump", "--pid", str(report.pid), "--nonblocking"],
            capture_output=True,
            text=True,
            timeout=15,
        )
    except (OSError, subprocess.TimeoutExpired):
        return
    if out.returncode != 0 or not out.stdout.strip():
        return
    with open(log, "a") as fh:
        fh.write(f"\n--- py-spy dump (rank {report.rank}, {report.where}) ---\n{out.stdout}\n")
    report.dumper = "py-spy"
    report.notes.append("py-spy: " + where_from_py_spy(out.stdout))


_FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')
_SPY_FRAME = re.compile(r"^\s+(?P<func>\S+) \((?P<file>[^:]+):(?P<line>\d+)\)")


def where_from_faulthandler(text: str) -> str:
    """Where the main thread is, from a faulthandler dump of all threads.

    The main thread is the one running a ``<module>`` frame (the script, or ``python -m``'s
    module); threads started by ``threading`` end in ``_bootstrap``. The signal may have been
    handled on any thread, so "Current thread" says nothing."""
    blocks: list[list[tuple[str, int, str]]] = []
    for line in text.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x")):
            blocks.append([])
        elif (match := _FRAME.match(line)) and blocks:
            blocks[-1].append((match["file"], int(match["line"]), match["func"]))
    main = next((f for f in blocks if any(func == "<module>" for _, _, func in f)), None)
    if main is None:
        main = next((f for f in blocks if f and f[-1][2] != "_bootstrap"), blocks[0] if blocks else [])
    return _where(main)


def where_from_py_spy(text: str) -> str:
    frames: list[tuple[str, int, str]] = []
    in_main = False
    for line in text.splitlines():
        if line.startswith("Thread "):
            in_main = '"MainThread"' in line
        elif in_main and (match := _SPY_FRAME.match(line)):
            frames.append((match["file"], int(match["line"]), match["func"]))
    return _where(frames)


def _where(frames: list[tuple[str, int, str]]) -> str:
    """Frames innermost first -> one phrase."""
    if not frames:
        return "no Python frames"
    file, line, func = frames[0]
    if "/torch/distributed/" in file:
        return f"waiting in a collective ({func})"
    if any("/torch/utils/data/" in f for f, _, _ in frames):
        return "waiting for the data loader"
    return f"in {func} ({Path(file).name}:{line})"
