"""``fsdp-train``: compose -> typed config -> resolve and validate -> launch -> report.

Everything on this path before :func:`fsdp_cli.launch.launcher.launch` is free of torch and
lightning, so ``--help``, ``--cfg job``, ``--info`` and config mistakes answer in well under a
second.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from fsdp_cli.checkpoint.resume import resolve_resume
from fsdp_cli.cli.hydra_errors import quote_numeric_group_options, report_hydra_errors_in_one_line
from fsdp_cli.config.convert import to_train_config, to_yaml
from fsdp_cli.config.migrate import migrate
from fsdp_cli.config.schema import TrainConfig
from fsdp_cli.config.store import register_schemas
from fsdp_cli.config.validate import advisories, validate
from fsdp_cli.errors import ConfigError
from fsdp_cli.launch.environment import ClusterJob, detect_cluster_job, global_rank
from fsdp_cli.launch.launcher import launch
from fsdp_cli.launch.layout import resolve_layout
from fsdp_cli.rundir.failure import merge_failure, read_failure
from fsdp_cli.rundir.files import CONFIG_FILE
from fsdp_cli.rundir.heartbeat import read_heartbeats
from fsdp_cli.rundir.status import EXIT_CONFIG_ERROR, EXIT_FAILED, EXIT_PREEMPTED, STATUS_FAILED
from fsdp_cli.rundir.summary import read_summary, write_summary
from fsdp_cli.rundir.table import print_summary

PROG = "fsdp-train"


def _config_path() -> str:
    """The configs shipped inside the package; from a source tree (``python -m fsdp_cli.cli.main``
    run in a checkout whose package is installed elsewhere) the top-level ``configs/`` folder."""
    if importlib.util.find_spec("fsdp_cli.configs") is not None:
        return "pkg://fsdp_cli.configs"
    return str(Path(__file__).resolve().parents[2] / "configs")


@hydra.main(version_base="1.3", config_path=_config_path(), config_name="train")
def train(cfg: DictConfig) -> dict[str, Any] | None:
    hydra_cfg = HydraConfig.get()
    job = detect_cluster_job(os.environ)
    run_dir = _run_dir(hydra_cfg, job)
    typed = resolve(cfg, run_dir)
    if global_rank() == 0:
        (run_dir / CONFIG_FILE).write_text(to_yaml(typed))

    code = _run_here(typed) if job is not None else launch(typed)
    return finish(code, run_dir, job=job, multirun=hydra_cfg.mode == RunMode.MULTIRUN, cfg=typed)


def _run_here(cfg: TrainConfig) -> int:
    """Inside torchrun/SLURM this process already is a rank: train in place."""
    from fsdp_cli.worker import run

    return run(cfg)


def resolve(cfg: DictConfig, run_dir: Path) -> TrainConfig:
    """The composed config as the typed, resolved, validated config every rank reads; a mistake
    is one line on stderr and exit status 2."""
    try:
        typed, notices = migrate(to_train_config(cfg))
        _notify(notices)  # before validation: an error may be about the new name
        typed = resolve_layout(typed, os.environ)
        typed = dataclasses.replace(typed, run_dir=str(run_dir))
        validate(typed)
        typed, resume_notices = resolve_resume(typed)
    except ConfigError as err:
        fail(err.one_line())
    _notify([*advisories(typed), *resume_notices])
    return typed


def finish(
    code: int, run_dir: Path, *, job: ClusterJob | None, multirun: bool, cfg: TrainConfig | None = None
) -> dict[str, Any] | None:
    """Report the run (the summary table) and turn the ranks' status into ours."""
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
    failure = read_failure(run_dir) if code != 0 and job is None else None
    if summary is None or failure is not None:
        # The ranks died before any could write one (killed, segfault): what the parent knows.
        summary = summary or _parent_summary(cfg, run_dir, code)
        if failure is not None:
            # Which rank failed first and how, or which ranks hung: seen from outside the ranks.
            summary = merge_failure(summary, failure)
        write_summary(run_dir, summary)
    if code == EXIT_CONFIG_ERROR and not multirun:
        # A mistake only the built model could reveal (a wrap class it does not have, ...):
        # the rank already printed the one line; nothing else to show.
        sys.exit(EXIT_CONFIG_ERROR)
    print_summary(summary, run_dir)
    # A preempted job stops a sweep too: the signal was meant for the whole command.
    if code == EXIT_PREEMPTED or (code != 0 and not multirun):
        sys.exit(code if code == EXIT_PREEMPTED else EXIT_FAILED)
    return summary


def _parent_summary(cfg: TrainConfig | None, run_dir: Path, code: int) -> dict[str, Any]:
    """``summary.json`` for ranks that died before writing one: the layout, and the last step any
    rank finished (from the heartbeats)."""
    summary: dict[str, Any] = {
        "status": STATUS_FAILED,
        "error": f"the ranks exited with status {code} before writing a summary; see {run_dir}/logs",
        "exit_code": code,
        "run_dir": str(run_dir),
    }
    if cfg is not None:
        model = cfg.model
        summary.update(
            strategy=cfg.strategy.name,
            world_size=int(cfg.devices) * cfg.num_nodes,
            dp=int(cfg.dp),
            tp=cfg.tp,
            precision=cfg.precision.name,
            model=getattr(model, "target", None) or model.name,
        )
    beats = read_heartbeats(run_dir)
    summary["steps"] = max((max(b.step, 0) for b in beats.values()), default=0)
    return summary


def _notify(notices: list[str]) -> None:
    for notice in notices:
        print(f"{PROG}: {notice}", file=sys.stderr, flush=True)


def fail(message: str) -> NoReturn:
    print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    sys.exit(EXIT_CONFIG_ERROR)


def _run_dir(hydra_cfg: Any, job: ClusterJob | None) -> Path:
    """Hydra's run directory; inside torchrun/SLURM every rank must agree on it, and Hydra's
    default (a timestamp) can differ by a second between ranks, so the job id names it instead."""
    run_dir = Path(hydra_cfg.runtime.output_dir)
    explicit = any(o.startswith(("hydra.run.dir=", "hydra.sweep.")) for o in hydra_cfg.overrides.hydra)
    if job is None or explicit or hydra_cfg.mode == RunMode.MULTIRUN:
        return run_dir
    job_id = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("SLURM_JOB_ID") or "job"
    shared = Path("outputs") / f"{job.kind}-{job_id}"
    shared.mkdir(parents=True, exist_ok=True)
    return shared.resolve()


def main() -> None:
    # `model._target_=pkg.mod.Factory` may name a module in the working directory.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    register_schemas()
    report_hydra_errors_in_one_line(PROG)
    sys.argv[1:] = quote_numeric_group_options(sys.argv[1:])
    train()


if __name__ == "__main__":
    main()
