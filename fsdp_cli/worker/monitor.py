"""What each rank does so that the launcher can supervise it (torch-free).

* Stack dumps on :data:`~fsdp_cli.launch.stacks.STACK_SIGNAL` into ``logs/rank<N>.log``, installed
  before the rank's pid is published.
* A heartbeat (:mod:`fsdp_cli.rundir.heartbeat`) beaten by the training callbacks.
* Its one-line error written where the elastic agent reads it, so the agent can tell a rank's
  own failure from a peer's "connection reset".
* Without a launcher of ours (inside torchrun or srun) nobody watches the heartbeat: the rank
  arms ``faulthandler.dump_traceback_later`` itself, re-armed at most once a second, which dumps
  its stack into its log and exits when it makes no progress for the hang timeout.
"""

from __future__ import annotations

import faulthandler
import json
import os
import time
from pathlib import Path
from typing import IO, Any

from fsdp_cli.launch.environment import WATCHDOG_ENV, agent_pid
from fsdp_cli.launch.stacks import install_stack_dumps
from fsdp_cli.rundir.files import rank_log
from fsdp_cli.rundir.heartbeat import PHASE_EXIT, PHASE_FAILED, Heartbeat, PhaseLimits

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
_REARM_EVERY_S = 1.0


class RankMonitor:
    """Arguments:
    run_dir: the run directory (heartbeat files and logs live there).
    rank, local_rank: this process's ranks.
    limits: the in-rank fallback's limits by phase; used only when no launcher of ours watches
        this rank.
    """

    def __init__(
        self,
        run_dir: str | Path,
        rank: int,
        local_rank: int,
        *,
        limits: PhaseLimits,
    ) -> None:
        self._log: IO[Any] = install_stack_dumps(rank_log(run_dir, rank))
        self.heartbeat = Heartbeat(run_dir, rank, local_rank, parent=agent_pid())
        watched = os.environ.get(WATCHDOG_ENV) == "launcher"
        self._limits = None if watched else limits
        self._armed_at = 0.0
        self._arm()

    def beat(self, step: int, phase: str) -> None:
        self.heartbeat.beat(step, phase)
        if self._limits is not None and time.monotonic() - self._armed_at >= _REARM_EVERY_S:
            self._arm()

    def exiting(self, ok: bool) -> None:
        """The rank left training: no more progress is expected, nor a hang. A failed rank's
        peers are stopped by the launcher if they do not exit by themselves."""
        self.heartbeat.beat(self.heartbeat.step, PHASE_EXIT if ok else PHASE_FAILED)
        if self._limits is not None:
            faulthandler.cancel_dump_traceback_later()

    def _arm(self) -> None:
        if self._limits is None:
            return
        _, limit = self._limits.of(self.heartbeat.phase)
        self._armed_at = time.monotonic()
        if limit is None:
            faulthandler.cancel_dump_traceback_later()
            return
        # exit=True: a rank that cannot make progress ends, so that torchrun or srun end the job.
        faulthandler.dump_traceback_later(limit, repeat=False, file=self._log, exit=True)


def report_error_to_agent(line: str) -> None:
    """Leave this rank's one-line error where torch's elastic agent reads it (``ProcessFailure``
    accepts a plain-string message with a timestamp)."""
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        return
    try:
        Path(path).write_text(json.dumps({"message": line, "timestamp": int(time.time())}))
    except OSError:
        pass  # reporting must never hide the failure itself
