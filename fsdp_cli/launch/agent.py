"""The launcher process: PyTorch's elastic agent (``torch.distributed.run``), reporting failures our way.

``python -m fsdp_cli.launch.agent <torchrun arguments>`` runs exactly what ``torchrun`` would. The
difference is at the end, when a rank fails:

* a config error (a rank exited with status 2 after printing one line) or a preemption (143)
  ends quietly with that status;
* otherwise the agent decides which rank failed first and how (:func:`failure_report`), writes
  it to ``<run dir>/failure.json`` (the parent merges it into ``summary.json``) and prints it in
  one line; torch's full failure table goes to ``<log dir>/launcher.log``.

Why not ``ChildFailedError.get_first_failure()``: it takes the smallest timestamp, and timestamps
are whole seconds (the error file's for a rank that raised, the agent's poll time for one killed
by a signal). A rank SIGKILLed at t=...9.99 and a survivor whose collective failed with
"Connection reset by peer" 5 ms later at t=...0.00 come out in the wrong order, and failures
seen in the same poll tie. So failures a peer caused (a lost connection, the agent's own SIGTERM,
a pid the launcher killed after a death) are set aside before ordering by time.

Why every rank's exit status (:class:`RankExits`): for forked ranks torch reports one failure,
that of the first process it finds ended in its poll. A SIGKILLed rank and the survivor that
exits 5 ms later on "Connection reset by peer" often end within one poll (0.1 s), and torch
then names either; the killed rank leaves no error file. The exit statuses of all of them are
on the process objects torch's ``start_processes`` returned, which the agent keeps.
"""

from __future__ import annotations

import functools
import gc
import importlib
import logging
import os
import signal
import socket
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsdp_cli.config.schema import RankStart
from fsdp_cli.launch.environment import AGENT_LOGGER, AGENT_PID_ENV, PRELOAD_MODULE, die_with_parent, exit_now
from fsdp_cli.launch.launcher import FORK_FLAGS, LOG_DIR_ENV, RUN_DIR_ENV
from fsdp_cli.rundir.failure import write_failure
from fsdp_cli.rundir.files import LAUNCHER_LOG
from fsdp_cli.rundir.heartbeat import (
    ABORT_FILE,
    KILLED_FILE,
    PHASE_EXIT,
    PHASE_FAILED,
    PHASE_SAVE,
    PHASE_START,
    RankBeat,
    launcher_file,
    read_heartbeats,
)
from fsdp_cli.rundir.status import EXIT_CONFIG_ERROR, EXIT_FAILED, EXIT_PREEMPTED

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

PROG = "fsdp-train"

# What a rank raises when a *peer* went away (gloo and NCCL wordings): never the cause when another
# rank failed differently.
COLLATERAL_WORDS = (
    "connection reset by peer",
    "connection closed by peer",
    "broken pipe",
    "socket closed",
    "communicator was aborted",
    "nccl communicator",
)
_SIGNAL_HINTS = {
    "SIGKILL": " (the kernel's out-of-memory killer sends this too)",
    "SIGSEGV": " (segmentation fault)",
    "SIGBUS": " (bus error)",
    "SIGABRT": " (abort)",
}


class RankExits:
    """Every process torch's agent forks for ranks (``launcher.start_method=fork`` or
    ``forkserver``), kept as ``torch.multiprocessing.start_processes`` returns them, so that a
    failure report has each one's exit status: ``{local rank: (pid, exit code)}`` of the newest
    attempt (an elastic restart starts new ones)."""

    def __init__(self) -> None:
        self._contexts: list[Any] = []

    def keep(self) -> None:
        import torch.multiprocessing as mp

        start = mp.start_processes

        @functools.wraps(start)
        def start_and_keep(*args: Any, **kwargs: Any) -> Any:
            context = start(*args, **kwargs)
            self._contexts.append(context)
            return context

        mp.start_processes = start_and_keep

    def statuses(self) -> dict[int, tuple[int, int]]:
        if not self._contexts:
            return {}
        processes = getattr(self._contexts[-1], "processes", [])
        return {i: (p.pid, p.exitcode) for i, p in enumerate(processes) if p.exitcode is not None}


RANK_EXITS = RankExits()


def message_of(failure: ProcessFailure) -> str:
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    text = str(message or "")
    return "" if text.startswith("To enable traceback") else text


def is_collateral(failure: ProcessFailure, killed: frozenset[int] = frozenset()) -> bool:
    if failure.exitcode == -signal.SIGTERM or failure.pid in killed:
        return True
    return any(word in message_of(failure).lower() for word in COLLATERAL_WORDS)


def first_failure(
    failures: Mapping[int, ProcessFailure], killed: frozenset[int] = frozenset()
) -> tuple[int, ProcessFailure]:
    order = {rank: i for i, rank in enumerate(failures)}  # insertion order: the order seen
    primary = {r: f for r, f in failures.items() if not is_collateral(f, killed)} or dict(failures)
    rank = min(primary, key=lambda r: (primary[r].timestamp, order[r]))
    return rank, primary[rank]


def describe(failure: ProcessFailure) -> str:
    """``killed by SIGKILL (...)``, ``exit code 137 (128+9: SIGKILL, ...)``, ``exit code 1: <its error>``."""
    code = failure.exitcode
    if code < 0:
        name = failure.signal_name()
        return f"killed by {name}{_SIGNAL_HINTS.get(name, '')}"
    return _exit_text(failure)


def when(beat: RankBeat | None) -> str:
    """Where in the run a rank was, from its heartbeat: `` at step 3`` (the step it was in)."""
    if beat is None:
        return ""
    if beat.phase == PHASE_START:
        return " while starting up"
    if beat.phase == PHASE_SAVE:
        return f" while saving step {beat.step}"
    if beat.phase in (PHASE_EXIT, PHASE_FAILED):
        return f" after step {beat.step}, leaving training"
    return f" at step {beat.step + 1}"


def first_line(rank: int, failure: ProcessFailure, beat: RankBeat | None) -> str:
    """``rank 1 was killed by SIGKILL at step 3 (...)`` or ``rank 0 failed first at step 3: exit code 1: ...``."""
    if failure.exitcode < 0:
        name = failure.signal_name()
        return f"rank {rank} was killed by {name}{when(beat)}{_SIGNAL_HINTS.get(name, '')}"
    return f"rank {rank} failed first{when(beat)}: {_exit_text(failure)}"


def _exit_text(failure: ProcessFailure) -> str:
    code = failure.exitcode
    text = f"exit code {code}"
    if code > 128:
        try:
            text += f" (128+{code - 128}: {signal.Signals(code - 128).name}, as a shell or container reports a signal)"
        except ValueError:
            pass
    lines = message_of(failure).strip().splitlines()
    return text + (f": {lines[-1][:400]}" if lines else "")


def failure_report(
    failures: Mapping[int, ProcessFailure],
    killed: frozenset[int] = frozenset(),
    beats: Mapping[int, RankBeat] | None = None,
) -> dict[str, Any]:
    """``failure.json``: which rank failed first and how (``beats``: where each rank was)."""
    rank, failure = first_failure(failures, killed)
    beat = (beats or {}).get(rank)
    message = message_of(failure)
    # Errors the ranks agreed on (a non-finite loss, a failed save: raised on every rank together)
    # name all of them rather than an arbitrary "first".
    same = sorted(r for r, f in failures.items() if message and message_of(f) == message)
    agreed = failure.exitcode >= 0 and len(same) > 1
    error = (
        f"ranks {','.join(map(str, same))} failed: {describe(failure)}"
        if agreed
        else first_line(rank, failure, beat)
    )
    return {
        "kind": "rank_failure",
        "error": error,
        "rank": rank,
        "pid": failure.pid,
        "exit_code": failure.exitcode,
        "signal": failure.signal_name() if failure.exitcode < 0 else None,
        "step": beat.step if beat is not None else None,
        "phase": beat.phase if beat is not None else None,
        "message": message,
        "agreed": agreed,
        "ranks": {
            str(r): {
                "pid": f.pid,
                "exit_code": f.exitcode,
                "collateral": is_collateral(f, killed),
                "message": message_of(f)[-400:],
            }
            for r, f in failures.items()
        },
    }


def with_peer_failures(
    failures: Mapping[int, ProcessFailure],
    run_dir: Path,
    killed: frozenset[int] = frozenset(),
    exits: Mapping[int, tuple[int, int]] | None = None,
) -> dict[int, ProcessFailure]:
    """``failures`` and the other ranks of this node that failed beside the one torch reports.
    Ranks forked by torch (``launcher.start_method=fork`` or ``forkserver``) are reported one only,
    the first it finds ended. ``exits`` (:meth:`RankExits.statuses`) has every forked rank's exit
    status: each non-zero one is added, with its error file if it left one (in torch's log layout
    next to the reported one: ``attempt_N/<local rank>/error.json``). Without them, a rank that
    left an error file is added with the status a failing rank exits with, and a rank the
    launcher killed (a survivor of a dead peer) as killed by SIGKILL. Pids come from the heartbeats."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    found = dict(failures)
    if len(failures) != 1:
        return found
    ((rank, failure),) = failures.items()
    attempt, offset = Path(failure.error_file).parent.parent, rank - failure.local_rank
    for local, (pid, code) in (exits or {}).items():
        if offset + local != rank and code != 0:
            found[offset + local] = ProcessFailure(local, pid, code, str(attempt / str(local) / "error.json"))
    for r, beat in sorted(own_heartbeats(run_dir).items()):
        if r in found:
            continue
        local = failure.local_rank + r - rank
        error_file = attempt / str(local) / "error.json"
        if error_file.is_file():
            found[r] = ProcessFailure(local, beat.pid, EXIT_FAILED, str(error_file))
        elif beat.pid in killed:
            found[r] = ProcessFailure(local, beat.pid, -signal.SIGKILL, str(error_file))
    return found


def stopped_by_the_agent(
    failures: Mapping[int, ProcessFailure], reported: Mapping[int, ProcessFailure]
) -> frozenset[int]:
    """Pids of ranks that ended after the failure torch saw first, with a status but no error of
    their own: torch's agent stopped them (its SIGTERM, which a rank in Lightning's hands turns
    into an exit status). Collateral, as a pid the launcher killed."""
    return frozenset(
        f.pid for r, f in failures.items() if r not in reported and f.exitcode >= 0 and not message_of(f)
    )


def own_heartbeats(run_dir: Path) -> dict[int, RankBeat]:
    """The heartbeats of the ranks this agent started (nodes may share the run directory, and
    pids repeat across hosts)."""
    here = socket.gethostname()
    return {r: b for r, b in read_heartbeats(run_dir).items() if b.parent == os.getpid() and b.host == here}


def _killed_by_launcher(run_dir: Path) -> frozenset[int]:
    try:
        return frozenset(int(x) for x in launcher_file(run_dir, KILLED_FILE, os.getpid()).read_text().split())
    except (OSError, ValueError):
        return frozenset()


def _report(err: ChildFailedError) -> int:
    log_dir = os.environ.get(LOG_DIR_ENV)
    if log_dir:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        (Path(log_dir) / LAUNCHER_LOG).write_text(err.format_msg() + "\n")
    _, torch_first = err.get_first_failure()
    if torch_first.exitcode in (EXIT_CONFIG_ERROR, EXIT_PREEMPTED) and len(err.failures) == 1:
        return torch_first.exitcode
    run_dir = Path(os.environ.get(RUN_DIR_ENV, "."))
    if launcher_file(run_dir, ABORT_FILE, os.getpid()).exists():
        return EXIT_FAILED  # the launcher ended a hung job and writes the report itself
    killed = _killed_by_launcher(run_dir)
    failures = with_peer_failures(err.failures, run_dir, killed, RANK_EXITS.statuses())
    report = failure_report(
        failures, killed | stopped_by_the_agent(failures, err.failures), own_heartbeats(run_dir)
    )
    if report["exit_code"] in (EXIT_CONFIG_ERROR, EXIT_PREEMPTED):
        return int(report["exit_code"])
    write_failure(run_dir, report)
    if not report["agreed"]:  # an error every rank raised was printed by rank 0 already
        print(f"{PROG}: {report['error']}", file=sys.stderr, flush=True)
    return EXIT_FAILED


def start_rank_server() -> None:
    """Start the forkserver that torch's agent forks ranks from (``--start-method=forkserver``), now:
    it imports what a rank needs (:mod:`fsdp_cli.worker.preload`) while this agent meets its
    peers. Forked from this agent once it has imported torch (before any thread starts), so that
    torch is imported once per node, not twice; spawned as a fresh interpreter where this Python's
    forkserver cannot be stood in for (:mod:`fsdp_cli.compat.multiprocessing_internals`). It ends
    once the agent and every rank forked from it have ended (they hold its pipe); the ranks end
    with the agent (:func:`~fsdp_cli.launch.environment.die_with_process`)."""
    import multiprocessing
    from multiprocessing import forkserver

    from fsdp_cli.compat.multiprocessing_internals import can_fork_server, fork_server

    if can_fork_server():
        import_torch()
        fork_server([PRELOAD_MODULE])
    else:
        multiprocessing.set_forkserver_preload([PRELOAD_MODULE])
        forkserver.ensure_running()


def import_torch() -> None:
    """torch, imported before the rank server is forked from this agent, so that the server starts
    with it (the rest of what torch's agent imports comes after the fork, beside the server's own
    imports). The collector is paused meanwhile: its passes over the objects the import makes
    (which live as long as the process) are a tenth of the import's CPU."""
    collecting = gc.isenabled()
    gc.disable()
    importlib.import_module("torch")
    if collecting:
        gc.enable()


def main(argv: list[str]) -> int:
    # A launcher killed outright (SIGKILL) must not leave ranks training: stop them, as on preemption.
    die_with_parent(signal.SIGTERM)
    # Ranks forked from the forkserver are its children, not ours: they name their agent from this.
    os.environ[AGENT_PID_ENV] = str(os.getpid())
    if FORK_FLAGS[RankStart.fork] in argv:
        # Imported before torch's agent starts a thread (its rendezvous store): the ranks are
        # forked from this process.
        importlib.import_module(PRELOAD_MODULE)
    elif FORK_FLAGS[RankStart.forkserver] in argv:
        start_rank_server()
    if any(flag in argv for flag in FORK_FLAGS.values()):
        RANK_EXITS.keep()
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args(argv)
    # The agent's own per-event chatter ("Sending process ... closing signal") adds nothing the
    # failure report does not say.
    logging.getLogger(AGENT_LOGGER).setLevel(logging.CRITICAL)
    try:
        run(args)
    except SignalException as err:
        # Preemption (SIGTERM): the ranks were sent the signal, saved, and exited. Ctrl-C and
        # the others keep the shell's 128 + signal convention.
        print(f"{PROG}: stopped by signal {err.sigval.name}", file=sys.stderr, flush=True)
        return 128 + int(err.sigval)
    except ChildFailedError as err:
        return _report(err)
    except RendezvousTimeoutError:
        return _report_unmet(args)
    return 0


def _report_unmet(args: Any) -> int:
    """The nodes did not all meet within ``launcher.rdzv_timeout_s`` (torchrun's ``join_timeout``):
    one line, in ``failure.json`` for the parent's summary, instead of torch's traceback."""
    conf = dict(item.partition("=")[::2] for item in str(args.rdzv_conf or "").split(",") if item)
    line = (
        f"launcher.rdzv_timeout_s={conf.get('join_timeout', '?')}: the nodes did not all meet at "
        f"launcher.rdzv_endpoint={args.rdzv_endpoint} (this is node {args.node_rank} of {args.nnodes}); "
        "hint: start fsdp-train on every node with the same launcher.rdzv_endpoint, reachable from each, "
        "and its own launcher.node_rank; raise launcher.rdzv_timeout_s when nodes start minutes apart"
    )
    write_failure(Path(os.environ.get(RUN_DIR_ENV, ".")), {"kind": "rendezvous", "error": line})
    print(f"{PROG}: error: {line}", file=sys.stderr, flush=True)
    return EXIT_FAILED


if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))
