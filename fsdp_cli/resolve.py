"""From the composed config to the typed, resolved, validated run every rank reads.

:func:`resolve_run` is the one path both a single run (``fsdp_cli.cli.main``) and a sweep's
jobs (``fsdp_cli.sweep``) take, so the two always agree on what can run: a single run prints a
failure as one line and exits 2; a sweep records the job as ``skipped`` with that same line and
goes on. It sits below both and above the layers it draws on (config, launch layout, data
preparation, resume, the memory plan); the caller says whether it is a sweep job and which
overrides the command line gave, so nothing here reads Hydra's global state.

No torch here: the checks answer in well under a second.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from fsdp_cli.adapters.options import QuantizeBase
from fsdp_cli.checkpoint.resume import resolve_resume
from fsdp_cli.checkpoint.run import check_checkpoint_dir
from fsdp_cli.config.batch_source import check_batch_source
from fsdp_cli.config.callback_classes import check_callback_classes, check_model_arguments
from fsdp_cli.config.convert import to_train_config
from fsdp_cli.config.migrate import migrate
from fsdp_cli.config.model_folder import resolve_model_folder
from fsdp_cli.config.pipeline_cut import pipeline_cut_check
from fsdp_cli.config.resolved import Layout, ResolvedRun
from fsdp_cli.config.schema import TrainConfig
from fsdp_cli.config.validate import advisories, checked_run, validate
from fsdp_cli.data.prepare import prepare_data
from fsdp_cli.errors import ConfigError
from fsdp_cli.launch.layout import resolve_layout, unusable_gpus_notice
from fsdp_cli.plan.pace import check_cpu_pace
from fsdp_cli.rundir.files import check_writable_folder

PreLaunchCheck = Callable[[ResolvedRun], None]


class Advisory(ConfigError):
    """A pre-launch verdict that skips a sweep's job but only warns a single run (an estimate:
    the user may know better). ``warning``: what a single run prints."""

    def __init__(self, key: str, value: object, problem: str, *, warning: str) -> None:
        super().__init__(key, value, problem)
        self.warning = warning


def memory_plan_check(run: ResolvedRun) -> None:
    """On GPUs, the memory plan (:func:`fsdp_cli.plan.check.plan_problem`) against the detected
    memory: a sweep skips a job that cannot fit, with the plan's line; a single run still starts,
    after that line as a warning (the plan is an estimate)."""
    if not run.layout.on_gpu:
        return
    from fsdp_cli.plan.check import plan_problem

    try:
        problem = plan_problem(run)
    except Exception:  # noqa: BLE001 - a plan that cannot be made never stops a run
        return
    if problem is not None:
        raise Advisory("memory plan", "does not fit", problem.removeprefix("memory plan: "), warning=problem)


def adapter_targets_check(run: ResolvedRun) -> None:
    """``peft=lora``: ``peft.targets`` and ``peft.trainable`` resolved on the model built on the
    meta device (what each rank will adapt), the rank checked against every target layer (and
    the fused experts, ``peft.targets=[experts]``)."""
    if not run.cfg.peft.enabled:
        return
    from fsdp_cli.adapters.quantize import check_quantized_shapes
    from fsdp_cli.adapters.targets import adapted_experts, adapter_layers, trainable_modules

    model = run.model_kind.meta_model(run)
    if model is None:
        raise ConfigError(
            "peft",
            run.cfg.peft.name.value,
            f"{run.model_label}: a LightningModule builds its layers in its own configure_model",
            hint="add adapters there (peft.inject_adapter_in_model), or give model._target_ a plain nn.Module",
        )
    layers = adapter_layers(model, run.cfg.peft)
    adapted_experts(model, run.cfg.peft)
    trainable_modules(model, run.cfg.peft)
    if run.cfg.peft.quantize_base is not QuantizeBase.none:
        check_quantized_shapes(model, layers, shards=run.layout.shard * run.layout.cp)


MODEL_CHECKS: tuple[PreLaunchCheck, ...] = (adapter_targets_check, pipeline_cut_check)
"""Checks of the model built on the meta device (seconds at most), run before the data is
prepared: a typo in ``peft.targets`` is not found after a long tokenization."""


def sample_prompts_check(run: ResolvedRun) -> None:
    """``trainer.sample_prompts``: a model fsdp-train's own loop drives, a layout whose ranks each
    hold whole sequences, and every prompt renders through the run's tokenizer (one line naming
    ``file:line`` otherwise)."""
    from fsdp_cli.data.prompts import run_prompts
    from fsdp_cli.errors import PromptError

    path = run.cfg.trainer.sample_prompts
    if not path:
        return
    key = "trainer.sample_prompts"
    if run.model_kind.name not in ("llama", "hf", "module"):
        raise ConfigError(
            key,
            path,
            "answers come from fsdp-train's causal LM module; a LightningModule of yours samples in its own hooks",
            hint="the built-in model, model=hf or an nn.Module",
        )
    for dim in ("pp", "cp"):
        if getattr(run.layout, dim) > 1:
            raise ConfigError(
                key,
                path,
                f"not with {dim}={getattr(run.layout, dim)}: no rank holds a whole sequence's logits",
                hint=f"fsdp-generate RUN_DIR after training, or {dim}=1",
            )
    try:
        run_prompts(run.cfg)
    except PromptError as err:
        raise ConfigError(key, path, str(err)) from None


PRE_LAUNCH_CHECKS: tuple[PreLaunchCheck, ...] = (
    sample_prompts_check,
    memory_plan_check,
    check_callback_classes,
    check_batch_source,
    check_model_arguments,
)
"""Checks that need the fully resolved config (concrete layout, resume path), run last, in order.

The extension point for verdicts beyond :mod:`fsdp_cli.config.validate` (whether a run fits in
memory, ...): a check raises :class:`fsdp_cli.errors.ConfigError`, and a single run stops with its
one line (exit 2) while a sweep records the job as ``skipped`` with it, before any job starts.
An :class:`Advisory` skips a sweep's job too, but a single run only prints it as a warning."""


def rehearsal_check(run: ResolvedRun, env: Mapping[str, str]) -> None:
    """A job whose layout exceeds this machine (more than one node, or more GPUs than are here) is
    rehearsed: rank 0 built on a fake process group with the code a real rank runs
    (:func:`fsdp_cli.plan.rehearsal.refusal`); a job its model cannot take is skipped with the
    rehearsal's line. (A layout this machine holds is tried for real as the job starts.)"""
    if not exceeds_this_machine(run.layout, env):
        return
    from fsdp_cli.plan.rehearsal import refusal

    problem = refusal(run)
    if problem is not None:
        raise problem


def exceeds_this_machine(layout: Layout, env: Mapping[str, str]) -> bool:
    """The layout needs other nodes, or more GPUs than this one has: it cannot be tried here."""
    from fsdp_cli.launch.environment import visible_gpu_count

    if layout.num_nodes > 1:
        return True
    return layout.on_gpu and layout.devices > visible_gpu_count(env)


SweepCheck = Callable[[ResolvedRun, Mapping[str, str]], None]
SWEEP_CHECKS: tuple[SweepCheck, ...] = (rehearsal_check,)
"""Checks a sweep's jobs get after :data:`PRE_LAUNCH_CHECKS` (``multirun=True``), with the job's
environment: verdicts that cost seconds of torch, worth paying before a sweep's first job starts,
not before a single run, whose ranks reach the same code within their first minute
(docs/memory.md, "Rehearsal before real runs")."""


def resolve_run(
    cfg: DictConfig,
    run_dir: Path,
    env: Mapping[str, str],
    *,
    notify: Callable[[str], None],
    multirun: bool = False,
    overrides: Sequence[str] = (),
) -> ResolvedRun:
    """migrate -> resolve the layout (and a ``model=hf`` folder's vocabulary) -> the frozen
    :class:`~fsdp_cli.config.resolved.ResolvedRun`, built once here (every derived value computed
    once; the launcher and the report take it) -> validate ->
    check the output folders -> :data:`MODEL_CHECKS` -> prepare the data (``data=jsonl`` is tokenized and cached here, once) -> resolve ``resume`` ->
    :data:`PRE_LAUNCH_CHECKS` (and for a sweep's job :data:`SWEEP_CHECKS`).

    Raises :class:`~fsdp_cli.errors.ConfigError` for the first thing that cannot run. ``notify``
    receives the notices worth a line each (old names, settings without effect, what ``resume``
    found), the migration ones before validation since an error may be about the new name.
    ``multirun``: a sweep's job (an :class:`Advisory` then skips it); ``overrides``: the job's
    command-line overrides (whether the user chose the ``data`` group)."""
    typed, notices = migrate(to_train_config(cfg))
    for notice in notices:
        notify(notice)
    auto = typed.accelerator.value == "auto"
    typed = resolve_layout(typed, env)
    gpu_notice = unusable_gpus_notice(env) if auto else None
    if gpu_notice is not None:
        notify(gpu_notice)
    typed = dataclasses.replace(typed, run_dir=str(run_dir), explicit_data=chooses_data(list(overrides)))
    run = checked_run(resolve_model_folder(typed))  # the run, built once: everything below takes it
    validate(run)
    slow = check_cpu_pace(run.cfg, chosen=not auto)  # refused where the CPU was not asked for
    if slow is not None:
        notify(f"warning: {slow}")
    check_output_folders(run.cfg)
    for check in MODEL_CHECKS:
        check(run)
    prepare_data(run.cfg, notify)
    resumed, resume_notices = resolve_resume(run.cfg)
    run = run.with_config(resumed)  # (the resume path and run id: nothing derived changes)
    _run_checks(run, env, notify=notify, multirun=multirun)
    for notice in [*advisories(run.cfg), *resume_notices]:
        notify(notice)
    return run


def _run_checks(
    run: ResolvedRun, env: Mapping[str, str], *, notify: Callable[[str], None], multirun: bool
) -> None:
    """:data:`PRE_LAUNCH_CHECKS` in order, an :class:`Advisory` a warning to ``notify`` unless
    ``multirun``; then, for a sweep's job, :data:`SWEEP_CHECKS` with the job's ``env``."""
    for check in PRE_LAUNCH_CHECKS:
        try:
            check(run)
        except Advisory as advice:
            if multirun:
                raise
            notify(f"warning: {advice.warning}")
    if multirun:
        for sweep_check in SWEEP_CHECKS:
            sweep_check(run, env)


def check_output_folders(cfg: TrainConfig) -> None:
    """Where the run writes (its run dir, its checkpoints) can be written, before anything runs.
    (Hydra creates the run dir before this; :mod:`fsdp_cli.cli.hydra_errors` answers when it cannot.)"""
    check_writable_folder(
        "hydra.run.dir", Path(cfg.run_dir), hint="hydra.run.dir=DIR (a folder this user can write)"
    )
    check_checkpoint_dir(cfg)


def resolve_config(cfg: DictConfig, run_dir: Path, env: Mapping[str, str], **options: Any) -> TrainConfig:
    """:func:`resolve_run` (same arguments), for a caller that wants only the config it wrote
    (a sweep's check of a job)."""
    return resolve_run(cfg, run_dir, env, **options).cfg


def chooses_data(task_overrides: list[str]) -> bool:
    """Whether overrides pick the ``data`` option or set a ``data.*`` key."""
    return any(o.lstrip("+~").startswith(("data=", "data.")) for o in task_overrides)
