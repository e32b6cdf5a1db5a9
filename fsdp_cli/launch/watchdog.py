"""The launcher's view of its ranks: hung jobs and dead ranks, from the heartbeat files (torch-free).

* :class:`HangWatchdog`: no local rank has beaten (finished a step or a validation batch, entered
  or left a save) for ``launcher.hang_timeout_s`` (``launcher.startup_timeout_s`` while a rank
  starts up or saves, ``launcher.first_step_timeout_s`` from the start of training to the end of
  its first step).
* :class:`DeadRankWatch`: a rank's process is gone without having finished training normally
  (killed, or failed). The elastic agent then stops the others with SIGTERM and a hard-coded 30 s
  before SIGKILL; a survivor blocked in an NCCL collective, or treating SIGTERM as "save at the
  next step", uses all of it. After :data:`PEER_EXIT_GRACE_S` the launcher kills the survivors
  that are still training itself.

Ranks run in sessions of their own (torch starts a new process with ``start_new_session=True``;
a rank forked from the agent or its forkserver calls ``setsid`` first), so a rank's process group is its pid and
holds its data-loader workers: they are killed by group.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable, Mapping
from typing import Any

from fsdp_cli.launch.stacks import RankStack, parent_pid, proc_state
from fsdp_cli.rundir.heartbeat import (
    PHASE_EXIT,
    PHASE_FAILED,
    PHASE_FIRST,
    PHASE_SAVE,
    PHASE_TRAIN,
    SLOW_PHASES,
    PhaseLimits,
    RankBeat,
)

PEER_EXIT_GRACE_S = 5.0
"""How long survivors of a dead rank get to exit by themselves before the launcher kills them."""


def own_beats(beats: Mapping[int, RankBeat], agent_pid: int) -> dict[int, RankBeat]:
    """The beats of the ranks our agent started: nodes sharing a run directory (on one host too)
    each watch their own."""
    return {rank: beat for rank, beat in beats.items() if beat.parent == agent_pid}


def rank_pids(beats: Mapping[int, RankBeat], agent_pid: int) -> dict[int, int]:
    """Ranks whose pid is still a child of our agent, or of its forkserver: a recycled pid is
    never signalled."""
    return {rank: beat.pid for rank, beat in beats.items() if started_by(beat.pid, agent_pid)}


def started_by(pid: int, agent_pid: int) -> bool:
    """Whether ``pid`` is a child of ``agent_pid`` or of a child of it (the agent's forkserver)."""
    parent = parent_pid(pid)
    return parent == agent_pid or (parent is not None and parent_pid(parent) == agent_pid)


def kill_groups(pids: Iterable[int]) -> None:
    for pid in pids:
        try:
            if os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def leftovers(run_dir: str, rank_pids: Iterable[int], own_pid: int) -> list[int]:
    """Processes of an ended run still alive once its agent has exited: in a rank's session (the
    data-loader workers of a killed rank, orphaned until their own watchdog notices, up to 5 s)
    or orphaned (adopted by init) in this process's session (the agent's rank server, waiting for
    those workers), and naming ``run_dir`` on their command line (a recycled pid is never one; a
    ``tee`` of the user's in the same session is not orphaned). Linux; elsewhere none."""
    sessions, own_sid = set(rank_pids), os.getsid(own_pid)
    found = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit() or int(entry) == own_pid:
            continue
        try:
            fields = open(f"/proc/{entry}/stat").read().rpartition(")")[2].split()
            ppid, sid = int(fields[1]), int(fields[3])
            if sid not in sessions and not (sid == own_sid and ppid == 1):
                continue
            if run_dir.encode() in open(f"/proc/{entry}/cmdline", "rb").read():
                found.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    return found


class HangWatchdog:
    """``check(beats)`` is True once no rank has beaten for the timeout of the phases they are in,
    measured on this process's monotonic clock from the last change it saw; ``limit`` is then
    the key and value that ran out."""

    def __init__(self, limits: PhaseLimits) -> None:
        self.limits = limits
        self.limit: tuple[str, float | None] = limits.of_all(())
        self._last: tuple[tuple[int, int, int], ...] | None = None
        self._since = time.monotonic()

    def check(self, beats: Mapping[int, RankBeat]) -> bool:
        key = tuple(sorted((rank, beat.pid, beat.beats) for rank, beat in beats.items()))
        now = time.monotonic()
        if key != self._last:
            self._last, self._since = key, now
            return False
        self.limit = self.limits.of_all(beat.phase for beat in beats.values())
        return self.limit[1] is not None and now - self._since >= self.limit[1]

    @property
    def stalled_for_s(self) -> float:
        return time.monotonic() - self._since


class DeadRankWatch:
    """``check(beats, agent_pid)`` returns the pids to kill once a rank has been gone, without
    finishing normally, for :data:`PEER_EXIT_GRACE_S`: the ranks still training (a rank writing
    its outputs after it failed, or finished, is left alone); else an empty dict."""

    def __init__(self, grace_s: float = PEER_EXIT_GRACE_S) -> None:
        self.grace_s = grace_s
        self._dead_since: float | None = None
        self._generation: frozenset[int] = frozenset()

    def check(self, beats: Mapping[int, RankBeat], agent_pid: int) -> dict[int, int]:
        generation = frozenset(beat.pid for beat in beats.values())
        if generation != self._generation:  # an elastic restart started new ranks
            self._generation, self._dead_since = generation, None
        alive = rank_pids(beats, agent_pid)
        gone = [
            r
            for r, b in beats.items()
            if b.phase != PHASE_EXIT and (r not in alive or proc_state(b.pid) == "Z")
        ]
        if not gone:
            return {}
        now = time.monotonic()
        if self._dead_since is None:
            self._dead_since = now
        if now - self._dead_since < self.grace_s:
            return {}
        return {r: pid for r, pid in alive.items() if beats[r].phase not in (PHASE_EXIT, PHASE_FAILED)}


GRACE_FLOOR_S = 20.0
"""``launcher.interrupt_grace_s=null`` never gives less than this (a step not yet measured)."""
GRACE_PER_STEP = 1.5
"""... and otherwise this many of the longest step measured (a step's time varies)."""


class StepTimes:
    """The longest optimizer step and the longest save the ranks have taken so far, read from
    their heartbeats (``update(beats)`` at each look): what a stop must wait for. The first step
    of a run (compilation, the first batches) is not counted."""

    def __init__(self) -> None:
        self.step_s = 0.0
        self.save_s = 0.0
        self._seen: dict[int, tuple[int, float, str]] = {}
        self._save_started: dict[int, float] = {}

    def update(self, beats: Mapping[int, RankBeat]) -> None:
        for rank, beat in beats.items():
            before = self._seen.get(rank)
            self._seen[rank] = (beat.step, beat.time, beat.phase)
            if before is None:
                continue
            step, when, phase = before
            if beat.step > step and phase == PHASE_TRAIN and beat.phase == PHASE_TRAIN:
                self.step_s = max(self.step_s, (beat.time - when) / (beat.step - step))
            if beat.phase == PHASE_SAVE and phase != PHASE_SAVE:
                self._save_started[rank] = beat.time
            elif phase == PHASE_SAVE and beat.phase != PHASE_SAVE and rank in self._save_started:
                self.save_s = max(self.save_s, beat.time - self._save_started.pop(rank))

    @property
    def stop_s(self) -> float:
        """What a SIGTERM mid-step needs: the rest of the step and a save (a save is measured
        from its start to the next beat, the end of the step after it)."""
        return max(self.step_s, self.save_s)

    def grace_s(self, configured: float | None) -> float:
        """``launcher.interrupt_grace_s``, or (null) what the steps measured so far need."""
        if configured is not None:
            return configured
        return max(GRACE_FLOOR_S, GRACE_PER_STEP * self.step_s)


def _before_training(beats: Mapping[int, RankBeat], limit: tuple[str, float | None] | None) -> str:
    """Where in its start the job stalled, and the limit that ran out (nothing once it trains)."""
    phases = {beat.phase for beat in beats.values()}
    if limit is None or not phases & {PHASE_FIRST, *SLOW_PHASES} or phases & {PHASE_EXIT, PHASE_FAILED}:
        return ""
    key, value = limit
    if PHASE_FIRST in phases:
        where = "before the first step ended (the first batches, a loader's workers, compilation)"
    else:
        where = "while starting up (imports, rendezvous, build, checkpoint load) or saving"
    return f" {where}; {key}={value:g}"


def hang_report(
    beats: Mapping[int, RankBeat],
    stacks: Mapping[int, RankStack],
    stalled_s: float,
    limit: tuple[str, float | None] | None = None,
) -> dict[str, Any]:
    """``failure.json`` for a hung job: one line naming the stuck ranks and the last step, and the details."""
    last = max((b.step for b in beats.values()), default=-1)
    stuck = [s for s in stacks.values() if not s.waiting_on_others] or list(stacks.values())
    waiting = sorted(s.rank for s in stacks.values() if s.waiting_on_others and s not in stuck)
    parts = [f"rank {s.rank} {s.where}" + (f" [{'; '.join(s.notes)}]" if s.notes else "") for s in stuck]
    line = (
        f"hang: no rank made progress for {stalled_s:.0f} s{_before_training(beats, limit)}; last step {last}"
    )
    steps = {r: b.step for r, b in sorted(beats.items())}
    if len(set(steps.values())) > 1:
        line += " (per rank: " + ", ".join(f"{r}={s}" for r, s in steps.items()) + ")"
    if not stacks:
        line += "; no rank had started (no heartbeat)"
    else:
        line += "; stuck: " + "; ".join(parts)
    if waiting:
        line += "; waiting for them in a collective: rank " + ",".join(map(str, waiting))
    line += "; stacks in logs/rank<N>.log"
    return {
        "kind": "hang",
        "error": line,
        "last_step": last,
        "stuck_ranks": sorted(s.rank for s in stuck),
        "stalled_s": round(stalled_s, 1),
        "ranks": {
            str(r): {
                "pid": s.pid,
                "state": s.state,
                "where": s.where,
                "dumper": s.dumper,
                "notes": s.notes,
                "step": beats[r].step if r in beats else None,
                "phase": beats[r].phase if r in beats else None,
            }
            for r, s in sorted(stacks.items())
        },
    }
