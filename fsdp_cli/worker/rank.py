"""One rank's life, in order: read the resolved config, set up the process, build, fit, write the
outputs.

Started by torch.distributed.run as ``python -m fsdp_cli.worker <run_dir>/config.yaml``, or
called in-process by the entry point when it already is a torchrun/SLURM rank. Rank 0 writes
``metrics.jsonl`` and ``summary.json`` (also when the run fails); the other ranks' console
output goes to ``<run_dir>/logs/rank<N>.log``. Before anything else a rank installs what lets the
launcher supervise it (:class:`~fsdp_cli.worker.monitor.RankMonitor`: stack dumps into its
log on request, a heartbeat); a failure is one line, in ``summary.json`` and for the agent.

The steps live by concern: the process (:mod:`fsdp_cli.worker.process`), what is built and fitted
(:mod:`fsdp_cli.worker.fit`), what is reported (:mod:`fsdp_cli.worker.summary`).
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

from fsdp_cli.config.convert import load_train_config
from fsdp_cli.config.resolved import ResolvedRun
from fsdp_cli.config.schema import TrainConfig
from fsdp_cli.dotted import serve_working_directory
from fsdp_cli.launch.environment import SAFEPATH_ENV, global_rank
from fsdp_cli.library_noise import quiet_library_noise
from fsdp_cli.rundir.files import rank_log
from fsdp_cli.rundir.status import (
    EXIT_CONFIG_ERROR,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_PREEMPTED,
    STATUS_FAILED,
    STATUS_PREEMPTED,
)
from fsdp_cli.rundir.summary import summary_exists, write_summary
from fsdp_cli.worker.fit import BuiltRank, FitResult, build, fit
from fsdp_cli.worker.monitor import RankMonitor, report_error_to_agent
from fsdp_cli.worker.process import (
    copy_output,
    leave_the_process_it_was_forked_from,
    redirect_output,
    start_monitor,
)
from fsdp_cli.worker.summary import Outcome, outcome_of, rank_summary


def train_rank(cfg: TrainConfig) -> int:
    """Train as this rank; returns the process exit status."""
    run_dir, rank = Path(cfg.run_dir), global_rank()
    if rank != 0:
        redirect_output(rank_log(run_dir, rank))
    else:
        copy_output(rank_log(run_dir, rank))
    monitor = start_monitor(cfg, rank)
    started = time.time()
    resolved = ResolvedRun.of(cfg)
    built: BuiltRank | None = None
    result: FitResult | None = None
    try:
        built = build(resolved, monitor)
        with _meeting_peers(resolved, monitor, started):
            result = fit(resolved, built)
        outcome = Outcome()
        if result.preempted:
            outcome = Outcome(
                STATUS_PREEMPTED,
                f"stopped by {built.callbacks.checkpoints.stop_signal or 'a stop signal to another rank'}"
                " after saving a checkpoint",
                EXIT_PREEMPTED,
            )
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        outcome = outcome_of(err)
    monitor.exiting(ok=outcome.status != STATUS_FAILED)
    summary = rank_summary(resolved, built, result, outcome, wall=time.time() - started)
    # Rank 0 writes the summary. When a run fails, another rank may get there first (and rank 0
    # may be stopped by the launcher before it can), so a failing rank writes one if none exists.
    # (A preempted run is not failing: every rank saved and stops, and rank 0 reports.)
    if rank == 0 or (outcome.status == STATUS_FAILED and not summary_exists(run_dir)):
        write_summary(run_dir, summary)
    return outcome.exit_code


def _meeting_peers(run: ResolvedRun, monitor: RankMonitor, started: float) -> AbstractContextManager[None]:
    """``launcher.rdzv_timeout_s`` over the process group's rendezvous (``trainer.fit`` starts with
    it): a rank whose peers never come fails with one line instead of waiting out the collective
    timeout (see :mod:`fsdp_cli.worker.rendezvous`)."""
    if run.layout.world_size == 1:
        return nullcontext()
    import torch.distributed as dist

    from fsdp_cli.worker.rendezvous import expired_line, rendezvous_deadline

    timeout = run.cfg.launcher.rdzv_timeout_s

    def give_up() -> None:  # on the watching thread: the main one is blocked in C++
        rank = global_rank()
        outcome = Outcome(STATUS_FAILED, expired_line(timeout, rank, run.layout.world_size), EXIT_FAILED)
        print(f"fsdp-train: error: {outcome.error}", file=sys.stderr, flush=True)
        report_error_to_agent(outcome.error or "")
        monitor.exiting(ok=False)
        if rank == 0 or not summary_exists(run.run_dir):
            write_summary(run.run_dir, rank_summary(run, None, None, outcome, wall=time.time() - started))
        sys.stdout.flush()
        os._exit(EXIT_FAILED)

    return rendezvous_deadline(timeout, is_up=dist.is_initialized, on_expiry=give_up)


def main(argv: list[str] | None = None, *, forked: bool = False) -> None:
    """A rank's whole life. ``forked``: forked from the agent (or its forkserver) rather than
    started as a new process (see :mod:`fsdp_cli.worker.preload`)."""
    quiet_library_noise()  # before torch and torchao are imported (here, or by the preload)
    from torch.distributed.elastic.multiprocessing.errors import record

    if forked:
        leave_the_process_it_was_forked_from()
    if os.environ.pop(SAFEPATH_ENV, None):
        os.environ.pop("PYTHONSAFEPATH", None)
    serve_working_directory()  # model._target_ and parallelize_fn may live there
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m fsdp_cli.worker RUN_DIR/config.yaml", file=sys.stderr)
        sys.exit(EXIT_CONFIG_ERROR)
    cfg = load_train_config(args[0])
    try:
        code = record(train_rank)(cfg)
    except KeyboardInterrupt:  # Ctrl-C before Lightning's own handling took over
        code = EXIT_INTERRUPTED
    except SystemExit as stop:  # Lightning exits 1 after a graceful Ctrl-C
        code = EXIT_OK if stop.code is None else stop.code if isinstance(stop.code, int) else EXIT_FAILED
    # Everything is written and flushed by now (metrics, summary, checkpoints are closed or
    # fsynced). Skipping the interpreter's teardown of torch, gloo and Lightning saves over a
    # second per rank, which every run and every test pays.
    sys.stdout.flush()
    sys.stderr.flush()
    if forked and code == EXIT_OK:
        return  # torch's wrapper tells the agent, then the process ends without that teardown
    os._exit(code)


if __name__ == "__main__":
    main()
