"""Start the ranks of a run with PyTorch's elastic launcher, from the resolved config.

The parent composes the config once and writes ``config.yaml``; torch.distributed.run then
starts ``python -m fsdp_cli.worker config.yaml`` per local rank. ``sys.argv`` is never
re-executed, so each Hydra multirun job is launched exactly once, with its own process group
and (``--standalone``) its own free rendezvous port. (Inside an existing torchrun or SLURM job
the entry point is already a rank and calls the worker itself.)

While the ranks run, :class:`Supervisor` polls their heartbeat files: it ends a hung job (after
dumping every rank's Python stack into its log) and kills the survivors of a dead rank that do
not exit by themselves (see :mod:`fsdp_cli.launch.watchdog`).

No torch import here: the launcher runs in a subprocess.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable
from pathlib import Path

from fsdp_cli.config.resolved import ResolvedRun
from fsdp_cli.config.schema import RankStart, TrainConfig
from fsdp_cli.launch.environment import SAFEPATH_ENV, WATCHDOG_ENV
from fsdp_cli.launch.stacks import dump_stacks
from fsdp_cli.launch.watchdog import (
    DeadRankWatch,
    HangWatchdog,
    StepTimes,
    hang_report,
    kill_groups,
    leftovers,
    own_beats,
    rank_pids,
)
from fsdp_cli.rundir.failure import clear_failure, write_failure
from fsdp_cli.rundir.files import CONFIG_FILE, log_dir
from fsdp_cli.rundir.heartbeat import (
    ABORT_FILE,
    KILLED_FILE,
    PHASE_EXIT,
    PHASE_SAVE,
    PhaseLimits,
    launcher_file,
    read_heartbeats,
)
from fsdp_cli.rundir.status import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_PREEMPTED
from fsdp_cli.rundir.summary import clear_summary

LOG_DIR_ENV = "FSDP_CLI_LOG_DIR"
"""Tells the agent where the run's logs go (it writes its failure report there)."""
RUN_DIR_ENV = "FSDP_CLI_RUN_DIR"
"""Tells the agent where the heartbeat files and ``failure.json`` live."""
POLL_S = 0.25
"""How often the launcher looks at the agent and the heartbeats."""
MONITOR_INTERVAL_S = 0.1
"""How often torch's agent looks at its ranks (pinned: a rank's death is noticed within it)."""
FORK_FLAGS = {RankStart.fork: "--start-method=fork", RankStart.forkserver: "--start-method=forkserver"}
"""torchrun's options that fork the ranks. Seeing one, the agent imports what a rank needs
(:mod:`fsdp_cli.worker.preload`) before anything else: itself (``fork``), or in the forkserver it
starts at once (``forkserver``)."""
WORKER_SCRIPT = Path(__file__).resolve().parents[1] / "worker" / "__main__.py"
"""What a forked rank runs (``python -m fsdp_cli.worker`` runs the same file)."""
AGENT_EXIT_GRACE_S = 10.0
"""After killing a hung job's ranks, how long the agent gets to notice before it is killed too."""


def torchrun_command(cfg: TrainConfig, config_path: Path) -> list[str]:
    # The agent is torch.distributed.run with quieter failure reporting (see its docstring).
    cmd = [sys.executable, "-m", "fsdp_cli.launch.agent", f"--nproc-per-node={cfg.devices}"]
    if cfg.num_nodes == 1 and cfg.launcher.rdzv_endpoint is None:
        cmd.append("--standalone")
    else:
        endpoint = cfg.launcher.rdzv_endpoint
        # Every node must present the same id: derive it from what they share, the endpoint
        # (run directories differ between nodes: Hydra's default is a local timestamp).
        rdzv_id = (
            os.environ.get("FSDP_CLI_RDZV_ID")
            or "fsdp-cli-" + uuid.uuid5(uuid.NAMESPACE_URL, str(endpoint)).hex[:12]
        )
        cmd += [
            f"--nnodes={cfg.num_nodes}",
            f"--node-rank={cfg.launcher.node_rank}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={rdzv_id}",
            # The launchers' own meeting (torch reads whole seconds; its default is 600).
            f"--rdzv-conf=join_timeout={math.ceil(cfg.launcher.rdzv_timeout_s)}",
        ]
    cmd += [f"--max-restarts={cfg.launcher.max_restarts}", f"--monitor-interval={MONITOR_INTERVAL_S}"]
    if cfg.launcher.start_method in FORK_FLAGS:
        # Ranks run the worker's __main__ in processes forked from the agent (or its forkserver),
        # which imported what a rank needs once (fsdp_cli.worker.preload).
        cmd += [FORK_FLAGS[cfg.launcher.start_method], "--run-path", str(WORKER_SCRIPT)]
    else:
        cmd += ["-m", "fsdp_cli.worker"]
    return [*cmd, str(config_path)]


def worker_env(run: ResolvedRun) -> dict[str, str]:
    cfg = run.cfg
    env = dict(os.environ)
    if "PYTHONSAFEPATH" not in env:
        # `python -m` puts the working directory first on sys.path, where a file named like a
        # dependency (rich.py) is imported instead of it: the agent and the ranks start without
        # it (Python 3.11+), and a rank appends it (model._target_ may live there).
        env["PYTHONSAFEPATH"] = "1"
        env[SAFEPATH_ENV] = "1"
    if "OMP_NUM_THREADS" not in env:
        # torchrun would force 1; on CPU runs the ranks share the cores instead.
        per_rank = 1 if run.layout.on_gpu else (os.cpu_count() or 1) // run.layout.devices
        env["OMP_NUM_THREADS"] = str(max(1, per_rank))
    env.setdefault("PYTHONUNBUFFERED", "1")
    env[LOG_DIR_ENV] = str(log_dir(cfg.run_dir))
    env[RUN_DIR_ENV] = str(cfg.run_dir)
    env[WATCHDOG_ENV] = "launcher"
    # How long the launcher waits for ranks to save after forwarding SIGTERM, before SIGKILL.
    env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(cfg.launcher.shutdown_timeout_s))
    return env


def launch(run: ResolvedRun) -> int:
    """Start the ranks and supervise them; returns their exit status (0 when all succeeded)."""
    cfg, run_dir = run.cfg, run.run_dir
    # A resumed run reuses its directory: the last run's failure report (stale heartbeats name
    # other agents) and summary must not stand for this one (a Ctrl-C'd rank writes none).
    clear_failure(run_dir)
    clear_summary(run_dir)
    proc = subprocess.Popen(torchrun_command(cfg, run_dir / CONFIG_FILE), env=worker_env(run))
    supervisor = Supervisor(cfg, proc)
    previous = signal.signal(signal.SIGTERM, supervisor.terminate)
    try:
        return supervisor.run()
    finally:
        signal.signal(signal.SIGTERM, previous)


class Supervisor:
    """Waits for the agent while watching the ranks' heartbeats (see :mod:`fsdp_cli.launch.watchdog`)."""

    def __init__(self, cfg: TrainConfig, proc: subprocess.Popen[bytes]) -> None:
        self.run_dir = Path(cfg.run_dir)
        self.proc = proc
        self.hang = HangWatchdog(PhaseLimits.of_launcher(cfg.launcher))
        self.dead = DeadRankWatch()
        self.times = StepTimes()
        self.configured_grace_s = cfg.launcher.interrupt_grace_s
        self.shutdown_timeout_s = cfg.launcher.shutdown_timeout_s
        self._warned_slow_stop = False
        self._watching = True
        self._interrupted: float | None = None
        self.terminated: float | None = None

    @property
    def interrupt_grace_s(self) -> float:
        return self.times.grace_s(self.configured_grace_s)

    def terminate(self, signum: int = signal.SIGTERM, frame: object = None) -> None:
        """SIGTERM to us (a scheduler preempting the job, ``kill``): passed to the agent, which
        passes it to every rank; they agree to stop at the next step boundary, checkpoint and exit
        "preempted". A step can take minutes (a large model on CPU): :meth:`run` gives them
        ``launcher.interrupt_grace_s`` to reach the save, as it gives a Ctrl-C."""
        if self.terminated is None:
            self.terminated = time.monotonic()
            print(f"fsdp-train: SIGTERM: {self._grace_line()}", file=sys.stderr, flush=True)
        self.proc.send_signal(signal.SIGTERM)

    def _grace_line(self) -> str:
        measured = (
            f"the longest step so far {self.times.step_s:.1f} s"
            if self.times.step_s
            else "no step measured yet"
        )
        how = "launcher.interrupt_grace_s" + ("=null: " if self.configured_grace_s is None else ", ")
        return (
            f"the ranks save at the next step boundary; waiting up to {self.interrupt_grace_s:g} s for it "
            f"({how}{measured}), then launcher.shutdown_timeout_s={self.shutdown_timeout_s} s for the save"
        )

    def run(self) -> int:
        while True:
            try:
                code = self._look()
            except KeyboardInterrupt:
                # Ctrl-C reached the agent too (same process group), which stops the ranks.
                self._interrupted = self._interrupted or time.monotonic()
                continue
            if code is not None:
                return code

    def _look(self) -> int | None:
        """Wait a poll for the agent, then one look at the ranks: the exit status once it is known."""
        try:
            code = self.proc.wait(timeout=POLL_S)
        except subprocess.TimeoutExpired:
            pass
        else:
            if code != 0:
                self._end_leftovers()
            return code
        if self._interrupted is not None and time.monotonic() - self._interrupted > self.interrupt_grace_s:
            return self._end_interrupted_job()
        if self._save_on_sigterm_overdue():
            return self._end_terminated_job()
        if not self._watching:
            return None
        try:
            return self._watch()
        except Exception as err:  # noqa: BLE001 - supervision must never abandon the ranks
            print(f"fsdp-train: warning: the hang and dead-rank watch stopped: {err!r}", file=sys.stderr)
            self._watching = False
            return None

    def _end_leftovers(self) -> None:
        """A failed run's processes the agent left (a killed rank's loader workers, the server
        waiting for them): killed, so that nothing of the run outlives fsdp-train."""
        beats = own_beats(read_heartbeats(self.run_dir), self.proc.pid)
        for pid in leftovers(str(self.run_dir), [beat.pid for beat in beats.values()], os.getpid()):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _watch(self) -> int | None:
        """One look at the heartbeats; the exit status when the job had to be ended."""
        beats = own_beats(read_heartbeats(self.run_dir), self.proc.pid)
        self.times.update(beats)
        self._warn_if_a_stop_cannot_save()
        doomed = self.dead.check(beats, self.proc.pid)
        if doomed:
            self._kill_collateral(list(doomed.values()))
        if self.hang.check(beats):
            return self._end_hung_job()
        return None

    def _warn_if_a_stop_cannot_save(self) -> None:
        """Once: the steps (and saves) measured take longer than a stop is given, so a SIGTERM
        would end the run without its save."""
        if self._warned_slow_stop or self.times.stop_s <= self.shutdown_timeout_s:
            return
        self._warned_slow_stop = True
        print(
            f"fsdp-train: warning: a step and a save take {self.times.stop_s:.0f} s here, more than a SIGTERM"
            f" gets (launcher.shutdown_timeout_s={self.shutdown_timeout_s}): a stop would save nothing;"
            " raise launcher.shutdown_timeout_s (and the scheduler's grace: SLURM's --signal=TERM@<s>)",
            file=sys.stderr,
            flush=True,
        )

    def _kill_collateral(self, pids: list[int]) -> None:
        """Survivors of a dead rank that did not exit by themselves; the agent is told they are
        collateral, so that its report names the rank that died."""
        with open(launcher_file(self.run_dir, KILLED_FILE, self.proc.pid), "a") as fh:
            fh.write("".join(f"{pid}\n" for pid in pids))
        kill_groups(pids)

    def _end_interrupted_job(self) -> int:
        """Ranks that did not stop within ``launcher.interrupt_grace_s`` of a Ctrl-C (one stopped or
        blocked in a collective whose peer already left never returns to Python): killed, and
        the agent after them; the run is reported interrupted as any other Ctrl-C."""
        beats = own_beats(read_heartbeats(self.run_dir), self.proc.pid)
        print(
            f"fsdp-train: ranks still running {self.interrupt_grace_s:g} s after Ctrl-C: killing them",
            file=sys.stderr,
            flush=True,
        )
        self._kill_ranks_then_agent(rank_pids(beats, self.proc.pid).values())
        return EXIT_INTERRUPTED

    def _save_on_sigterm_overdue(self) -> bool:
        """The grace since SIGTERM is over and no rank has begun the save (none is saving or
        writing its outputs): they are still inside a step. A save already under way is left to
        finish (it is the checkpoint the signal asked for; the agent's
        ``launcher.shutdown_timeout_s`` bounds it)."""
        if self.terminated is None or time.monotonic() - self.terminated <= self.interrupt_grace_s:
            return False
        beats = own_beats(read_heartbeats(self.run_dir), self.proc.pid)
        return not any(beat.phase in (PHASE_SAVE, PHASE_EXIT) for beat in beats.values())

    def _end_terminated_job(self) -> int:
        """Ranks that did not reach a step boundary within the grace of a SIGTERM: killed, and the
        run reported preempted without the save it asked for."""
        beats = own_beats(read_heartbeats(self.run_dir), self.proc.pid)
        print(
            f"fsdp-train: SIGTERM: the ranks did not reach a step boundary within "
            f"launcher.interrupt_grace_s={self.interrupt_grace_s:g} s: killing them; nothing was saved by "
            "this stop",
            file=sys.stderr,
            flush=True,
        )
        self._kill_ranks_then_agent(rank_pids(beats, self.proc.pid).values())
        return EXIT_PREEMPTED

    def _kill_ranks_then_agent(self, pids: Iterable[int]) -> None:
        """SIGKILL the ranks' groups; the agent gets :data:`AGENT_EXIT_GRACE_S` to notice and exit."""
        kill_groups(pids)
        try:
            self.proc.wait(timeout=AGENT_EXIT_GRACE_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def _end_hung_job(self) -> int:
        stalled = self.hang.stalled_for_s
        beats = own_beats(read_heartbeats(self.run_dir), self.proc.pid)
        abort = launcher_file(self.run_dir, ABORT_FILE, self.proc.pid)
        abort.parent.mkdir(parents=True, exist_ok=True)
        abort.write_text(f"hang detected at {time.time():.3f}\n")
        pids = rank_pids(beats, self.proc.pid)
        stacks = dump_stacks(pids, log_dir(self.run_dir))
        # SIGKILL, not SIGTERM: a SIGTERM would start the preemption save, or be ignored by a rank
        # blocked in C code, costing the agent's whole shutdown timeout.
        self._kill_ranks_then_agent(pids.values())
        report = hang_report(beats, stacks, stalled, self.hang.limit)
        write_failure(self.run_dir, report)
        print(f"fsdp-train: {report['error']}", file=sys.stderr, flush=True)
        return EXIT_FAILED
