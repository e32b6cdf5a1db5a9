"""``fsdp-train``: compose -> typed config -> resolve and validate -> launch -> report.

Everything on this path before :func:`fsdp_cli.launch.launcher.launch` is free of torch and
lightning, so ``--help``, ``--cfg job``, ``--info`` and config mistakes answer in well under a
second. In a sweep (``-m``) each job runs through :func:`fsdp_cli.sweep.job.run_sweep_job`,
so that no job stops the sweep, and the command exits with the status its report decided.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from fsdp_cli.cli.configs import config_path, register_sweep_launcher
from fsdp_cli.cli.hydra_errors import quote_numeric_group_options, report_hydra_errors_in_one_line
from fsdp_cli.config.schema import SET_BY_THE_ENTRY_POINT
from fsdp_cli.config.store import register_schemas
from fsdp_cli.dotted import serve_working_directory
from fsdp_cli.errors import ConfigError
from fsdp_cli.launch.environment import ClusterJob, check_job_environment, detect_cluster_job, global_rank
from fsdp_cli.library_noise import quiet_library_noise
from fsdp_cli.rundir.files import remove_if_unused
from fsdp_cli.rundir.status import (
    EXIT_CONFIG_ERROR,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_PREEMPTED,
    STATUS_FAILED,
    STATUS_INTERRUPTED,
    STATUS_PREEMPTED,
    STOP_CODES,
)

if TYPE_CHECKING:
    from fsdp_cli.config.resolved import ResolvedRun
    from fsdp_cli.config.schema import TrainConfig
    from fsdp_cli.rundir.summary import RunSummary

# What only a run, a sweep or its report needs (resolution, the launcher, the run directory's
# readers) is imported where it is used: `--cfg job` prints the composed config before `train`
# runs, and a config mistake stops inside `resolve`, so neither pays for the rest.

PROG = "fsdp-train"
DRY_RUN_FLAG = "--dry-run"
"""Resolve and check the run, rehearse rank 0 (:mod:`fsdp_cli.cli.rehearse`), start nothing."""
MULTIRUN_FLAGS = ("-m", "--multirun")
MODE_FLAGS = {
    **dict.fromkeys(MULTIRUN_FLAGS, "--multirun"),
    **dict.fromkeys(("-c", "--cfg"), "--cfg"),
    **dict.fromkeys(("-i", "--info"), "--info"),
}


@hydra.main(version_base="1.3", config_path=config_path(), config_name="train")
def train(cfg: DictConfig) -> Any:
    hydra_cfg = HydraConfig.get()
    job = detect_cluster_job(os.environ)
    run_dir = Path(hydra_cfg.runtime.output_dir)
    if hydra_cfg.mode == RunMode.MULTIRUN:
        from fsdp_cli.sweep.job import run_sweep_job

        # One job of a sweep: skipped or failed, it returns the worst objective; the sweep goes on.
        launch_job = functools.partial(_launch, run_dir=run_dir, job=job, multirun=True)
        return run_sweep_job(cfg, run_dir, launch=launch_job, notify=_notify)
    # A config error (one line, exit 2) or a dry run: no run happened in the folder Hydra made.
    try:
        run = resolve(cfg, run_dir)
        if _dry_run:
            dry_run(run)  # (exits 1 or 2 where the rehearsal disagrees or refuses)
            remove_if_unused(run_dir, Path.cwd())
            return None
    except SystemExit:
        remove_if_unused(run_dir, Path.cwd())
        raise
    return _launch(run, run_dir=run_dir, job=job, multirun=False)[1]


_dry_run = False
"""This command is ``fsdp-train ... --dry-run`` (set by :func:`main`; Hydra's entry takes no arguments)."""


def dry_run(run: ResolvedRun) -> None:
    """``--dry-run``: the plan and a rehearsal of rank 0 instead of the run; exits 1 when they
    disagree, 2 (one line) when the model cannot take the layout."""
    from fsdp_cli.cli.rehearse import rehearse_and_report
    from fsdp_cli.plan.check import detected_device_memory

    try:
        memory = detected_device_memory(run, os.environ)
        code = rehearse_and_report(run, rank=0, memory=memory, as_json=False, step=True, prog=PROG)
    except ConfigError as err:
        fail(err.one_line())
    if code:
        sys.exit(code)


def _launch(
    run: ResolvedRun, *, run_dir: Path, job: ClusterJob | None, multirun: bool
) -> tuple[int, dict[str, Any] | None]:
    """Write the resolved config, run the ranks, report: their exit status and the summary."""
    from fsdp_cli.config.convert import to_yaml
    from fsdp_cli.launch.launcher import launch
    from fsdp_cli.rundir.files import CONFIG_FILE

    if global_rank() == 0:
        _write_atomically(run_dir / CONFIG_FILE, to_yaml(run.cfg))
    code = _run_here(run.cfg) if job is not None else launch(run)
    return code, finish(code, run_dir, job=job, multirun=multirun, run=run)


def _run_here(cfg: TrainConfig) -> int:
    """Inside torchrun/SLURM this process already is a rank: train in place."""
    from fsdp_cli.worker.rank import train_rank

    return train_rank(cfg)


def resolve(cfg: DictConfig, run_dir: Path) -> ResolvedRun:
    """The composed config as the typed, resolved, validated run every rank reads; a mistake
    is one line on stderr and exit status 2."""
    from fsdp_cli.resolve import resolve_run

    overrides = list(HydraConfig.get().overrides.task)
    try:
        return resolve_run(cfg, run_dir, os.environ, notify=_notify, overrides=overrides)
    except ConfigError as err:
        fail(err.one_line())


def finish(
    code: int, run_dir: Path, *, job: ClusterJob | None, multirun: bool, run: ResolvedRun | None = None
) -> dict[str, Any] | None:
    """Report the run (the summary table) and turn the ranks' status into ours."""
    from fsdp_cli.rundir.failure import merge_failure, read_failure
    from fsdp_cli.rundir.summary import read_summary, write_summary
    from fsdp_cli.rundir.table import print_summary

    if job is not None and global_rank() != 0:
        # One rank of a torchrun/SLURM job: rank 0 reports; a failing rank still fails its process.
        if code != 0:
            sys.exit(code)
        return None
    summary = read_summary(run_dir)
    if summary is None and code == 0:
        # Multi-node: global rank 0 (and its summary) lives on another node.
        print(f"{PROG}: this node's ranks finished; rank 0's node holds summary.json", flush=True)
        return None
    # (Ctrl-C stops every rank on purpose: no rank failed first.)
    failure = read_failure(run_dir) if code not in (0, EXIT_INTERRUPTED) and job is None else None
    if summary is None or failure is not None:
        # The ranks died before any could write one (killed, segfault): what the parent knows.
        summary = summary or _parent_summary(run, run_dir, code).as_dict()
        if failure is not None:
            # Which rank failed first and how, or which ranks hung: seen from outside the ranks.
            summary = merge_failure(summary, failure)
        write_summary(run_dir, summary)
    if code == EXIT_CONFIG_ERROR:
        # A mistake only the built model could reveal (a wrap class it does not have, ...): the
        # rank already printed the one line; a sweep records the job as skipped.
        if not multirun:
            sys.exit(EXIT_CONFIG_ERROR)
        return summary
    print_summary(summary, run_dir)
    # Preemption or Ctrl-C stops a sweep too: the signal was meant for the whole command.
    if code in STOP_CODES or (code != 0 and not multirun):
        sys.exit(code if code in STOP_CODES else EXIT_FAILED)
    return summary


def _parent_summary(run: ResolvedRun | None, run_dir: Path, code: int) -> RunSummary:
    """``summary.json`` for ranks that died before writing one: the layout, and the last step any
    rank finished (from the heartbeats)."""
    from fsdp_cli.rundir.heartbeat import read_heartbeats
    from fsdp_cli.rundir.summary import RunSummary

    columns = run.summary_columns() if run is not None else {"run_dir": str(run_dir)}
    summary = RunSummary(
        status=STATUS_FAILED,
        error=f"the ranks exited with status {code} before writing a summary; see {run_dir}/logs",
        exit_code=code,
        **columns,
    )
    if code == EXIT_INTERRUPTED:
        summary.status = STATUS_INTERRUPTED
        summary.error = f"interrupted (Ctrl-C); {_what_resume_finds(run, run_dir)}"
    elif code == EXIT_PREEMPTED:  # SIGTERM, and the ranks killed before they reached the save
        summary.status = STATUS_PREEMPTED
        summary.error = (
            "SIGTERM: the ranks were killed inside a step, so the save on SIGTERM did not happen; "
            + _what_resume_finds(run, run_dir)
        )
    beats = read_heartbeats(run_dir)
    summary.steps = max((max(b.step, 0) for b in beats.values()), default=0)
    return summary


def _what_resume_finds(run: ResolvedRun | None, run_dir: Path) -> str:
    """What a stop left to resume from: nothing was saved by it; the newest complete checkpoint
    ``resume=auto`` would continue from, or that there is none."""
    from fsdp_cli.checkpoint.run import checkpoint_dir, complete_checkpoints

    directory = checkpoint_dir(run.cfg) if run is not None else run_dir / "checkpoints"
    found = complete_checkpoints(directory)
    if not found:
        return f"nothing was saved, and there is no checkpoint in {directory}: resume=auto would start over"
    step, path = found[-1]
    return (
        f"nothing was saved by this stop: resume=auto hydra.run.dir={run_dir} continues from {path} "
        f"(step {step}), repeating the steps after it"
    )


def _write_atomically(path: Path, text: str) -> None:
    # On a shared run directory every node's parent writes it; a rank must never read half a file.
    tmp = path.with_name(f"{path.name}.{os.getpid()}.partial")
    tmp.write_text(text)
    os.replace(tmp, path)


def _notify(notice: str) -> None:
    print(f"{PROG}: {notice}", file=sys.stderr, flush=True)


def fail(message: str) -> NoReturn:
    print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    sys.exit(EXIT_CONFIG_ERROR)


def cluster_run_dir(argv: list[str], env: Mapping[str, str]) -> list[str]:
    """Inside torchrun/SLURM every rank composes the config itself, and Hydra's default run (or
    sweep) directory, a timestamp, can differ by a second between ranks: name it after the job
    instead, before Hydra creates it, so the ranks share one directory (unless the command names one)."""
    job = detect_cluster_job(env)
    if job is None:
        return argv
    job_id = env.get("TORCHELASTIC_RUN_ID") or env.get("SLURM_JOB_ID") or "job"
    multirun = any(a in MULTIRUN_FLAGS for a in argv)
    key, root = ("hydra.sweep.dir", "multirun") if multirun else ("hydra.run.dir", "outputs")
    if any(a.startswith(f"{key}=") for a in argv):
        return argv
    return [*argv, f"{key}={root}/{job.kind}-{job_id}"]


def is_sweep(argv: list[str]) -> bool:
    """``-m``, or ``hydra.mode=MULTIRUN`` on the command line (Hydra then runs a sweep too)."""
    return any(a in MULTIRUN_FLAGS or a.lstrip("+~") == "hydra.mode=MULTIRUN" for a in argv)


def check_modes(argv: list[str]) -> None:
    """Hydra runs one mode at a time; say so in one line instead of its traceback."""
    modes = sorted({MODE_FLAGS[a] for a in argv if a in MODE_FLAGS})
    if len(modes) > 1:
        fail(
            f"{' and '.join(modes)} cannot be combined (one mode at a time); "
            f"hint: to see one job of a sweep, drop -m and give one value per key: {PROG} tp=2 --cfg job"
        )


def take_dry_run_flag(argv: list[str]) -> bool:
    """Whether ``argv`` asks for ``--dry-run``, which is ours, not Hydra's: taken out of ``argv``
    (in place) before Hydra parses it."""
    if DRY_RUN_FLAG not in argv:
        return False
    if any(a in MULTIRUN_FLAGS for a in argv):
        fail(
            f"{DRY_RUN_FLAG} and --multirun cannot be combined; hint: a sweep rehearses the jobs this "
            f"machine cannot try itself; to see one job, drop -m: {PROG} tp=2 {DRY_RUN_FLAG}"
        )
    argv[:] = [a for a in argv if a != DRY_RUN_FLAG]
    return True


def main() -> None:
    global _dry_run
    serve_working_directory()  # `model._target_=pkg.mod.Factory` may name a module there
    quiet_library_noise()  # (a --dry-run imports torch and torchao here)
    register_schemas()
    register_sweep_launcher()
    from fsdp_cli.compat.hydra_internals import interpolation_maps_only_where_used, mode_from_command_line
    from fsdp_cli.compat.omegaconf_internals import yaml_read_by_libyaml

    interpolation_maps_only_where_used()
    yaml_read_by_libyaml()
    if not any(a.lstrip("+~").startswith("hydra.mode=") for a in sys.argv[1:]):
        mode_from_command_line()
    if any(a in ("-c", "--cfg", "-i", "--info") or a.startswith("--cfg=") for a in sys.argv[1:]):
        from fsdp_cli.compat.hydra_internals import hide_from_printed_config

        hide_from_printed_config(SET_BY_THE_ENTRY_POINT)
    # Optuna imports alembic, whose INFO chatter ("setup plugin ...") Hydra's root logger prints.
    logging.getLogger("alembic").setLevel(logging.WARNING)
    report_hydra_errors_in_one_line(PROG)
    check_modes(sys.argv[1:])
    argv = sys.argv[1:]
    _dry_run = take_dry_run_flag(argv)  # (set on every call: a test runs commands in one process)
    try:
        check_job_environment(os.environ)  # the run directory below is named after the job
    except ConfigError as err:
        fail(err.one_line())
    sys.argv[1:] = cluster_run_dir(quote_numeric_group_options(argv), os.environ)
    train()
    if is_sweep(sys.argv[1:]):
        from fsdp_cli.sweep.report import exit_status

        # After a sweep: 1 when any job failed, 2 when every job was skipped, decided by its report.
        code = exit_status()
        if code:
            sys.exit(code)


if __name__ == "__main__":
    main()
