"""Per-rank heartbeat files: how the launcher knows that ranks are alive and making progress.

``<run dir>/.heartbeat/rank<N>`` holds two lines::

    {"rank": 1, "local_rank": 1, "pid": 1234, "parent": 1200, "host": "node1", "started": 1700000000.0}
              18           17    1700000012.345 train

The first line (JSON) is written once, when the rank starts, after it has installed its stack-dump
signal handler: a pid read from this file is therefore safe to send that signal to; ``parent`` (the elastic
agent that started the rank) tells a launcher its own ranks from another node's sharing the run
directory. The second is
a fixed-width record (beat count, last finished optimizer step, wall time, phase) rewritten in
place with one ``pwrite`` per beat: no fsync, no truncation, no rename (about 2 us). A reader
may in principle see a torn record; it then keeps the previous value until its next poll.

Phases: ``start`` (imports, rendezvous, build, checkpoint load), ``first`` (training has
begun and its first optimizer step has not finished: the first batches, the loader's workers
starting, compilation), ``train``, ``val``, ``save``, ``exit`` or ``failed`` (the rank left
training and is writing its outputs). The watchdog gives ``start`` and ``save`` the start-up
timeout, ``first`` a limit of its own; a rank gone without ``exit`` is one whose peers the
launcher stops.

Torch-free: the parent reads these files.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdp_cli.rundir.files import heartbeat_dir

PHASE_START, PHASE_FIRST, PHASE_TRAIN, PHASE_VAL, PHASE_SAVE = "start", "first", "train", "val", "save"
PHASE_EXIT, PHASE_FAILED = "exit", "failed"
"""The rank left training (ok or preempted / failed) and is writing its outputs."""
SLOW_PHASES = (PHASE_START, PHASE_SAVE)
"""Phases timed by ``launcher.startup_timeout_s`` instead of ``launcher.hang_timeout_s``."""


@dataclass(frozen=True)
class PhaseLimits:
    """How long ranks may go without a beat, by the phase they are in (None: no limit)."""

    hang_s: float | None
    startup_s: float | None
    first_step_s: float | None

    @classmethod
    def of_launcher(cls, launcher: Any) -> PhaseLimits:
        """The limits the ``launcher`` config section sets."""
        return cls(launcher.hang_timeout_s, launcher.startup_timeout_s, launcher.first_step_timeout_s)

    def of(self, phase: str) -> tuple[str, float | None]:
        """The launcher key that limits ``phase``, and its value."""
        if phase in SLOW_PHASES:
            return "launcher.startup_timeout_s", self.startup_s
        if phase == PHASE_FIRST:
            return "launcher.first_step_timeout_s", self.first_step_s
        return "launcher.hang_timeout_s", self.hang_s

    def of_all(self, phases: Iterable[str]) -> tuple[str, float | None]:
        """The longest limit of the phases ranks are in (no rank yet: start-up's)."""
        limits = [self.of(phase) for phase in phases] or [self.of(PHASE_START)]
        unlimited = [lim for lim in limits if lim[1] is None]
        return unlimited[0] if unlimited else max(limits, key=lambda lim: lim[1] or 0.0)


ABORT_FILE = "ABORT.{agent}"
"""Written by the launcher before it kills a hung job: that agent then leaves the report to it."""
KILLED_FILE = "KILLED.{agent}"
"""Pids the launcher killed after a peer died: collateral failures, never the root cause."""

_RECORD = "{n:>12d} {step:>12d} {time:17.3f} {phase:<8.8s}\n"


class Heartbeat:
    """Rank side: ``beat(step, phase)`` whenever the rank makes progress."""

    def __init__(self, run_dir: str | Path, rank: int, local_rank: int, parent: int | None = None) -> None:
        directory = heartbeat_dir(run_dir)
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"rank{rank}"
        header = json.dumps(
            {
                "rank": rank,
                "local_rank": local_rank,
                "pid": os.getpid(),
                "parent": os.getppid() if parent is None else parent,
                # The process it was started or forked by: the agent, or the agent's forkserver.
                "forked_by": os.getppid(),
                "host": socket.gethostname(),
                # Imported before this rank started: forked from the agent or its forkserver.
                "preloaded": "lightning" in sys.modules,
                "started": time.time(),
            }
        )
        self._offset = len(header) + 1
        self._n = 0
        self.step = -1
        self.phase = PHASE_START
        tmp = self.path.with_name(self.path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, (header + "\n" + self._record()).encode())
        os.replace(tmp, self.path)  # readers never see a file without its header
        self._fd = fd

    def _record(self) -> str:
        return _RECORD.format(n=self._n, step=self.step, time=time.time(), phase=self.phase)

    def beat(self, step: int, phase: str) -> None:
        self._n += 1
        self.step, self.phase = step, phase
        os.pwrite(self._fd, self._record().encode(), self._offset)


@dataclass(frozen=True)
class RankBeat:
    """What the parent reads from one rank's heartbeat file."""

    rank: int
    pid: int
    parent: int
    """The pid of the process that started the rank (torch's elastic agent)."""
    host: str
    beats: int
    """Beat count: any change is progress."""
    step: int
    """Last finished optimizer step (-1: none yet)."""
    time: float
    phase: str


def read_heartbeats(run_dir: str | Path) -> dict[int, RankBeat]:
    """Every rank's latest beat; files being created or torn mid-write are skipped until the next read."""
    found: dict[int, RankBeat] = {}
    directory = heartbeat_dir(run_dir)
    if not directory.is_dir():
        return found
    for path in directory.glob("rank*"):
        if path.suffix == ".tmp":
            continue
        beat = _parse(path)
        if beat is not None:
            found[beat.rank] = beat
    return found


def _parse(path: Path) -> RankBeat | None:
    try:
        header, record = path.read_text().splitlines()[:2]
        info = json.loads(header)
        n, step, when, phase = record.split()
        return RankBeat(
            rank=int(info["rank"]),
            pid=int(info["pid"]),
            parent=int(info["parent"]),
            host=str(info["host"]),
            beats=int(n),
            step=int(step),
            time=float(when),
            phase=phase,
        )
    except (OSError, ValueError, KeyError):
        return None


def launcher_file(run_dir: str | Path, name: str, agent_pid: int) -> Path:
    """``ABORT_FILE`` or ``KILLED_FILE`` of the launcher whose agent is ``agent_pid``."""
    return heartbeat_dir(run_dir) / name.format(agent=agent_pid)
