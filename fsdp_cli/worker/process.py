"""The process a rank runs in, before and around training: its output redirected to its log, the
monitor started before the slow imports, and a rank forked from the agent (or its forkserver)
made into a process of its own.

What the rank trains is :mod:`fsdp_cli.worker.fit`; its life, in order, is :mod:`fsdp_cli.worker.rank`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from fsdp_cli.config.schema import TrainConfig
from fsdp_cli.launch.environment import (
    AGENT_LOGGER,
    PRELOAD_MODULE,
    WATCHDOG_ENV,
    agent_pid,
    die_with_parent,
    die_with_process,
)
from fsdp_cli.rundir.heartbeat import PhaseLimits
from fsdp_cli.rundir.status import EXIT_CONFIG_ERROR
from fsdp_cli.worker.monitor import RankMonitor


def start_monitor(cfg: TrainConfig, rank: int) -> RankMonitor:
    """Stack dumps and the heartbeat, before the slow imports (a hang at start-up is dumped too)."""
    if os.environ.get(WATCHDOG_ENV) == "launcher":
        # Started by our agent: never outlive it (a killed agent cannot stop its ranks).
        import signal

        die_with_parent(signal.SIGKILL)
    local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
    return RankMonitor(cfg.run_dir, rank, local_rank, limits=PhaseLimits.of_launcher(cfg.launcher))


def redirect_output(path: Path) -> None:
    """This process's stdout and stderr appended to ``path`` (the other ranks' logs)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


class Tee:
    """A text stream that writes to ``stream`` and to ``copy`` (rank 0's console and its log)."""

    def __init__(self, stream: Any, copy: Any) -> None:
        self._stream, self._copy = stream, copy

    def write(self, text: str) -> int:
        self._to_copy("write", text)
        return self._stream.write(text)

    def flush(self) -> None:
        self._to_copy("flush")
        self._stream.flush()

    def _to_copy(self, method: str, *args: Any) -> None:
        """The copy's ``method``; a copy that fails (a full disk) is dropped, not the run."""
        if self._copy is None:
            return
        try:
            getattr(self._copy, method)(*args)
        except (OSError, ValueError):
            self._copy = None

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, ...: the console's
        return getattr(self._stream, name)


def copy_output(path: Path) -> None:
    """Rank 0's console (what Python writes to stdout and stderr) copied into ``path``, line
    buffered, so that ``tail -f logs/rank0.log`` follows the run from another shell."""
    path.parent.mkdir(parents=True, exist_ok=True)
    log = open(path, "a", buffering=1, encoding="utf-8", errors="replace")  # open for the process's life
    sys.stdout = Tee(sys.stdout, log)  # type: ignore[assignment]
    sys.stderr = Tee(sys.stderr, log)  # type: ignore[assignment]


def leave_the_process_it_was_forked_from() -> None:
    """A forked rank starts as a copy of the agent (``launcher.start_method=fork``) or of its
    forkserver. Like a rank torch starts itself, it gets a session of its own (its data-loader
    workers join it, and the launcher stops a rank by its group), it dies with the agent, and it
    starts with Python's own signal handling and logging levels, not the agent's (torch's agent
    turns SIGTERM, SIGINT, SIGHUP and SIGQUIT into an exception of its own, and ours silences
    torch's elastic logs), and with Python's default start method for the processes it starts
    (a forkserver's child inherits ``forkserver``). It cannot use CUDA if it was initialized
    before the fork."""
    import logging
    import signal

    if os.getsid(0) != os.getpid():
        os.setsid()
    # A forkserver lives as long as any rank does: the agent is what a rank must not outlive (as
    # a rank torch starts itself dies with it, see start_monitor).
    die_with_process(agent_pid(), signal.SIGKILL)
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    logging.getLogger(AGENT_LOGGER).setLevel(logging.NOTSET)
    _platform_start_method()
    if getattr(sys.modules.get(PRELOAD_MODULE), "CUDA_INITIALIZED", False):
        print(
            "fsdp-train: error: CUDA was initialized while torch and Lightning were imported for the"
            " ranks to be forked, so forked ranks cannot use it; hint: launcher.start_method=subprocess",
            file=sys.stderr,
            flush=True,
        )
        os._exit(EXIT_CONFIG_ERROR)


def _platform_start_method() -> None:
    """The processes a rank starts without naming a start method (a DataLoader's workers, a
    ``multiprocessing.Pool``) start as they would in a process run with ``python train.py``:
    with the platform's default (``fork`` on Linux before Python 3.14). A rank forked from the
    agent's forkserver was handed the server's ``forkserver`` as its default: its workers would
    then come from a server of their own, started from the rank's main file, and each worker
    would be a copy of that server rather than of the rank (the dataset rebuilt by unpickling)."""
    import multiprocessing

    multiprocessing.set_start_method(None, force=True)
