"""From the composed config to the typed, resolved, validated config every rank reads.

:func:`resolve_config` is the one path both a single run and a sweep's pre-launch pass take, so
the two always agree on what can run: a single run prints a failure as one line and exits 2; a
sweep records the job as ``skipped`` with that same line and goes on.

No torch here: the checks answer in well under a second.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from fsdp_cli.checkpoint.resume import resolve_resume
from fsdp_cli.config.convert import to_train_config
from fsdp_cli.config.migrate import migrate
from fsdp_cli.config.model_folder import resolve_model_folder
from fsdp_cli.config.schema import TrainConfig
from fsdp_cli.config.validate import advisories, validate
from fsdp_cli.data.prepare import prepare_data
from fsdp_cli.errors import ConfigError
from fsdp_cli.launch.layout import resolve_layout

PreLaunchCheck = Callable[[TrainConfig], None]


def memory_plan_check(cfg: TrainConfig) -> None:
    """On GPUs, the memory plan (:func:`fsdp_cli.plan.check.plan_problem`) against the detected
    memory: a sweep skips a job that cannot fit, with the plan's line; a single run still starts,
    after that line as a warning (the plan is an estimate)."""
    if cfg.accelerator.value != "gpu":
        return
    from fsdp_cli.plan.check import plan_problem

    try:
        problem = plan_problem(cfg)
    except Exception:  # noqa: BLE001 - a plan that cannot be made never stops a run
        return
    if problem is None:
        return
    if _in_sweep():
        raise ConfigError("memory plan", "does not fit", problem.removeprefix("memory plan: "))
    print(f"fsdp-train: warning: {problem}", file=sys.stderr, flush=True)


def rehearsal_check(cfg: TrainConfig) -> None:
    """In a sweep, a job whose layout exceeds this machine (more than one node, or more GPUs than
    are here) is rehearsed before any job starts: rank 0 built on a fake process group with the
    code a real rank runs (:func:`fsdp_cli.plan.rehearsal.refusal`). A job its model cannot take
    is skipped with the rehearsal's line. A single run is not rehearsed (docs/memory.md: why)."""
    if not _in_sweep() or not exceeds_this_machine(cfg, os.environ):
        return
    from fsdp_cli.plan.rehearsal import refusal

    problem = refusal(cfg)
    if problem is not None:
        raise problem


def exceeds_this_machine(cfg: TrainConfig, env: Mapping[str, str]) -> bool:
    """The layout needs other nodes, or more GPUs than this one has: it cannot be tried here."""
    from fsdp_cli.launch.environment import visible_gpu_count

    if cfg.num_nodes > 1:
        return True
    return cfg.accelerator.value == "gpu" and int(cfg.devices) > visible_gpu_count(env)


def _in_sweep() -> bool:
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


PRE_LAUNCH_CHECKS: tuple[PreLaunchCheck, ...] = (memory_plan_check, rehearsal_check)
"""Checks that need the fully resolved config (concrete layout, resume path), run last, in order.

The extension point for verdicts beyond :mod:`fsdp_cli.config.validate` (whether a run fits in
memory, ...): a check raises :class:`fsdp_cli.errors.ConfigError`, and a single run stops with its
one line (exit 2) while a sweep records the job as ``skipped`` with it, before any job starts."""


def resolve_config(
    cfg: DictConfig,
    run_dir: Path,
    env: Mapping[str, str],
    *,
    notify: Callable[[str], None],
) -> TrainConfig:
    """migrate -> resolve the layout (and a ``model=hf`` folder's vocabulary) -> validate ->
    prepare the data (``data=jsonl`` is tokenized and cached here, once) -> resolve ``resume`` ->
    :data:`PRE_LAUNCH_CHECKS`.

    Raises :class:`~fsdp_cli.errors.ConfigError` for the first thing that cannot run. ``notify``
    receives the notices worth a line each (old names, settings without effect, what ``resume``
    found), the migration ones before validation since an error may be about the new name."""
    typed, notices = migrate(to_train_config(cfg))
    for notice in notices:
        notify(notice)
    typed = resolve_layout(typed, env)
    typed = dataclasses.replace(typed, run_dir=str(run_dir), explicit_data=_command_line_chooses_data())
    typed = resolve_model_folder(typed)
    validate(typed)
    prepare_data(typed)
    typed, resume_notices = resolve_resume(typed)
    for check in PRE_LAUNCH_CHECKS:
        check(typed)
    for notice in [*advisories(typed), *resume_notices]:
        notify(notice)
    return typed


def chooses_data(task_overrides: list[str]) -> bool:
    """Whether overrides pick the ``data`` option or set a ``data.*`` key."""
    return any(o.lstrip("+~").startswith(("data=", "data.")) for o in task_overrides)


def _command_line_chooses_data() -> bool:
    # Hydra's defaults always select a data option: only the job's overrides say the user chose one.
    return HydraConfig.initialized() and chooses_data(list(HydraConfig.get().overrides.task))
