"""One rank of a run: read the resolved config, build, fit, write the outputs.

Started by torch.distributed.run as ``python -m fsdp_cli.worker <run_dir>/config.yaml``, or
called in-process by the entry point when it already is a torchrun/SLURM rank. Rank 0 writes
``metrics.jsonl`` and ``summary.json`` (also when the run fails); the other ranks' console
output goes to ``<run_dir>/logs/rank<N>.log``. Before anything else a rank installs what lets the
launcher supervise it (:class:`~fsdp_cli.worker.monitor.RankMonitor`: stack dumps into its
log on request, a heartbeat); a failure is one line, in ``summary.json`` and for the agent.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdp_cli.config.convert import load_train_config
from fsdp_cli.config.resolved import ResolvedRun
from fsdp_cli.config.schema import TrainConfig
from fsdp_cli.dotted import serve_working_directory
from fsdp_cli.errors import ConfigError, RunFailure
from fsdp_cli.launch.environment import (
    AGENT_LOGGER,
    SAFEPATH_ENV,
    WATCHDOG_ENV,
    agent_pid,
    die_with_parent,
    global_rank,
)
from fsdp_cli.library_noise import quiet_library_noise
from fsdp_cli.rundir.files import rank_log
from fsdp_cli.rundir.status import (
    EXIT_CONFIG_ERROR,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_PREEMPTED,
    STATUS_FAILED,
    STATUS_OK,
    STATUS_PREEMPTED,
)
from fsdp_cli.rundir.summary import RunSummary, median_of, steady_state, summary_exists, write_summary
from fsdp_cli.worker.monitor import RankMonitor, report_error_to_agent


@dataclass
class RankRun:
    """What one rank builds for a run."""

    module: Any
    datamodule: Any
    trainer: Any
    callbacks: Any  # fsdp_cli.builders.callbacks.RunCallbacks
    parameters_at_build: int = 0
    tokens: bool = True
    """Trained on fsdp-train's token batches (else the module's or its DataModule's loaders)."""


@dataclass
class FitResult:
    steps: int
    checkpoint: str | None
    preempted: bool


@dataclass
class Outcome:
    status: str = STATUS_OK
    error: str | None = None
    exit_code: int = EXIT_OK


def run(cfg: TrainConfig) -> int:
    """Train as this rank; returns the process exit status."""
    run_dir, rank = Path(cfg.run_dir), global_rank()
    if rank != 0:
        _redirect_output(rank_log(run_dir, rank))
    monitor = start_monitor(cfg, rank)
    started = time.time()
    resolved = ResolvedRun.of(cfg)
    built: RankRun | None = None
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
        outcome = _failed(err)
    monitor.exiting(ok=outcome.status != STATUS_FAILED)
    summary = _summary(resolved, built, result, outcome, wall=time.time() - started)
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
            write_summary(run.run_dir, _summary(run, None, None, outcome, wall=time.time() - started))
        sys.stdout.flush()
        os._exit(EXIT_FAILED)

    return rendezvous_deadline(timeout, is_up=dist.is_initialized, on_expiry=give_up)


def start_monitor(cfg: TrainConfig, rank: int) -> RankMonitor:
    """Stack dumps and the heartbeat, before the slow imports (a hang at start-up is dumped too)."""
    if os.environ.get(WATCHDOG_ENV) == "launcher":
        # Started by our agent: never outlive it (a killed agent cannot stop its ranks).
        import signal

        die_with_parent(signal.SIGKILL)
    launcher = cfg.launcher
    return RankMonitor(
        cfg.run_dir,
        rank,
        int(os.environ.get("LOCAL_RANK", "0") or 0),
        hang_timeout_s=launcher.hang_timeout_s,
        startup_timeout_s=launcher.startup_timeout_s,
    )


def _failed(err: BaseException) -> Outcome:
    """The outcome of a rank that raised ``err``: one line in summary.json, on stderr and for the
    agent; a traceback only for what may be a bug."""
    if isinstance(err, ConfigError):
        outcome = Outcome(STATUS_FAILED, err.one_line(), EXIT_CONFIG_ERROR)
    elif isinstance(err, RunFailure):
        outcome = Outcome(STATUS_FAILED, str(err), EXIT_FAILED)
    else:
        traceback.print_exc()
        text = str(err) if isinstance(err, Exception) else (str(err).strip().splitlines() or [""])[0]
        outcome = Outcome(STATUS_FAILED, f"{type(err).__name__}: {text}", EXIT_FAILED)
    if isinstance(err, (ConfigError, RunFailure)):
        print(f"fsdp-train: error: {outcome.error}", file=sys.stderr, flush=True)
    report_error_to_agent(outcome.error or "")
    return outcome


def build(run: ResolvedRun, monitor: RankMonitor | None = None) -> RankRun:
    """Module, data, strategy, callbacks and trainer from the resolved run."""
    import lightning as L

    _quiet_known_noise()
    from fsdp_cli.builders.callbacks import build_callbacks
    from fsdp_cli.builders.data import build_datamodule, feeds_tokens
    from fsdp_cli.builders.model import build_module
    from fsdp_cli.builders.strategy import build_strategy
    from fsdp_cli.builders.trainer import build_trainer

    L.seed_everything(run.cfg.seed, workers=True, verbose=False)
    module = build_module(run)
    datamodule = build_datamodule(run, module)  # None: the module's own DataLoaders
    own = not feeds_tokens(datamodule)  # the user's loaders: the module's or its DataModule's
    if not own:
        _quiet_token_validation_note()
    strategy = build_strategy(run)
    callbacks = build_callbacks(run, module, module_loaders=own, monitor=monitor)
    trainer = build_trainer(
        run,
        strategy,
        callbacks=callbacks.as_list(),
        accumulation=(run.cfg.trainer.accumulate_grad_batches or 1) if own else datamodule.accumulation,
        module_loaders=own,
        module_clip_val=callbacks.module_clip_val,
    )
    return RankRun(
        module=module,
        datamodule=datamodule,
        trainer=trainer,
        callbacks=callbacks,
        parameters_at_build=_parameter_count(module),
        tokens=not own,
    )


def fit(run: ResolvedRun, built: RankRun) -> FitResult:
    """Train (resuming where the config says), then save the final checkpoint if one is due."""
    cfg = run.cfg
    trainer, checkpoints = built.trainer, built.callbacks.checkpoints
    trainer.fit(built.module, datamodule=built.datamodule, ckpt_path=_resume_path(cfg))
    last = checkpoints.last_saved
    already_saved = last is not None and last.name.startswith(f"step_{trainer.global_step:08d}")
    if (cfg.checkpoint.save_last or checkpoints.preempted) and not already_saved:
        checkpoints.save(trainer)
    checkpoints.finish(trainer)  # a background save becomes visible (or fails) before we report
    saved = checkpoints.last_saved
    return FitResult(
        steps=trainer.global_step, checkpoint=str(saved) if saved else None, preempted=checkpoints.preempted
    )


def _resume_path(cfg: TrainConfig) -> str | None:
    """The parent resolved ``resume``; after an elastic restart the newest checkpoint wins."""
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:
        from fsdp_cli.checkpoint.run import checkpoint_dir, newest_verified

        found, _ = newest_verified(checkpoint_dir(cfg))
        if found is not None:
            return str(found)
    return cfg.resume


def _summary(
    run: ResolvedRun, built: RankRun | None, result: FitResult | None, outcome: Outcome, *, wall: float
) -> RunSummary:
    metrics = built.callbacks.metrics if built is not None else None
    setup = built.callbacks.setup if built is not None else None
    skipped = built.callbacks.nonfinite.skipped if built is not None else []
    rows = metrics.rows if metrics is not None else []
    val_rows = metrics.val_rows if metrics is not None else []
    steady = steady_state(rows)
    data = run.cfg.data
    tokens = built is None or built.tokens  # else batches from the user's loaders
    return RunSummary(
        status=outcome.status,
        error=outcome.error,
        exit_code=outcome.exit_code,
        **run.summary_columns(),
        parameters=max(built.parameters_at_build, _parameter_count(built.module))
        if built is not None
        else None,
        global_batch_size=data.global_batch_size if tokens else None,
        seq_len=data.seq_len if tokens else None,
        steps=_steps_done(built, result, rows),
        final_loss=rows[-1]["loss"] if rows else None,
        val_loss=val_rows[-1].get("val_loss") if val_rows else None,
        tokens_per_s=median_of(steady, "tokens_per_s"),
        samples_per_s=median_of(steady, "samples_per_s"),
        step_time_s=median_of(steady, "step_time_s"),
        tflops_per_s=median_of(steady, "tflops_per_s"),
        mfu=median_of(steady, "mfu"),
        peak_memory_bytes=metrics.peak_memory_bytes if metrics is not None else [],
        checkpoint=result.checkpoint if result is not None else None,
        skipped_nonfinite_steps=len(skipped),
        skipped_nonfinite_at=list(skipped),
        setup=setup.info if setup is not None else None,
        wall_time_s=round(wall, 3),
    )


def _steps_done(built: RankRun | None, result: FitResult | None, rows: list[dict[str, Any]]) -> int:
    if result is not None:
        return result.steps
    if built is not None:  # a failed run: the optimizer steps it took before failing
        return int(built.trainer.global_step)
    return rows[-1]["step"] if rows else 0


def _parameter_count(module: Any) -> int:
    """The model's size: counted before sharding by our modules; for a user's module, before fit
    (FSDP1 leaves only this rank's shard behind) or after it (DTensors report global sizes)."""
    counted = getattr(module, "num_parameters", None)
    if counted is not None:
        return int(counted)
    return int(sum(p.numel() for p in module.parameters()))


def _quiet_known_noise() -> None:
    """Silence messages that are noise for our own code paths, so real warnings stand out:
    Lightning's start-up banners and tips; FSDP2's note that the root returns a view (our loss
    never modifies logits in place); DTensor's note that the scalar gradient-norm all-reduce on
    the (dp, tp) mesh takes two collectives instead of one."""
    import logging
    import warnings

    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=r".*LeafSpec.*is deprecated")
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")

    class _NormPartialNote(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return "_NormPartial" not in record.getMessage()

    logging.getLogger("torch.distributed.tensor._redistribute").addFilter(_NormPartialNote())


def _quiet_token_validation_note() -> None:
    """fsdp-train's data has a validation loader only with ``trainer.val_check_interval``, which
    the docs say; Lightning's note is kept for a user's module (its validation loop is skipped)."""
    import warnings

    warnings.filterwarnings("ignore", message=r"You defined a `validation_step` but have no `val_dataloader`")


def _redirect_output(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def main(argv: list[str] | None = None, *, forked: bool = False) -> None:
    """A rank's whole life. ``forked``: forked from the agent (or its forkserver) rather than
    started as a new process (see :mod:`fsdp_cli.worker.preload`)."""
    quiet_library_noise()  # before torch and torchao are imported (here, or by the preload)
    from torch.distributed.elastic.multiprocessing.errors import record

    if forked:
        _leave_the_process_it_was_forked_from()
    if os.environ.pop(SAFEPATH_ENV, None):
        os.environ.pop("PYTHONSAFEPATH", None)
    serve_working_directory()  # model._target_ and parallelize_fn may live there
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m fsdp_cli.worker RUN_DIR/config.yaml", file=sys.stderr)
        sys.exit(EXIT_CONFIG_ERROR)
    cfg = load_train_config(args[0])
    try:
        code = record(run)(cfg)
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


def _leave_the_process_it_was_forked_from() -> None:
    """A forked rank starts as a copy of the agent (``launcher.start_method=fork``) or of its
    forkserver. Like a rank torch starts itself, it gets a session of its own (its data-loader
    workers join it, and the launcher stops a rank by its group), it dies with the agent, and it
    starts with Python's own signal handling and logging levels, not the agent's (torch's agent
    turns SIGTERM, SIGINT, SIGHUP and SIGQUIT into an exception of its own, and ours silences
    torch's elastic logs). It cannot use CUDA if it was initialized before the fork."""
    import logging
    import signal

    from fsdp_cli.launch.environment import PRELOAD_MODULE, die_with_process

    if os.getsid(0) != os.getpid():
        os.setsid()
    # A forkserver lives as long as any rank does: the agent is what a rank must not outlive (as
    # a rank torch starts itself dies with it, see start_monitor).
    die_with_process(agent_pid(), signal.SIGKILL)
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    logging.getLogger(AGENT_LOGGER).setLevel(logging.NOTSET)
    if getattr(sys.modules.get(PRELOAD_MODULE), "CUDA_INITIALIZED", False):
        print(
            "fsdp-train: error: CUDA was initialized while torch and Lightning were imported for the"
            " ranks to be forked, so forked ranks cannot use it; hint: launcher.start_method=subprocess",
            file=sys.stderr,
            flush=True,
        )
        os._exit(EXIT_CONFIG_ERROR)


if __name__ == "__main__":
    main()
