"""The checks a resolved run must pass before any rank starts, run in order: each field's range
and the precision name first (:func:`checked_run`), then the cross-field checks (:data:`CHECKS`)
and the ``data`` group's (:data:`DATA_CHECKS`).

The checks live beside what they check: the strategy's in :mod:`fsdp_cli.config.strategies`, the
model kind's in :mod:`fsdp_cli.config.model_kinds`, the data group's in
:mod:`fsdp_cli.config.data_checks` (and :mod:`fsdp_cli.data.files`), the trainer's, optimizer's,
checkpoint's and logger's in :mod:`fsdp_cli.config.trainer_checks`, the pairs of features the
composition table refuses in :mod:`fsdp_cli.config.composition`, pipeline stages' in
:mod:`fsdp_cli.config.pipeline_checks`, adapters' in :mod:`fsdp_cli.config.adapter_checks`, the
precision name's in :mod:`fsdp_cli.precision`. This module holds the order, the ranges' one-line
error and the notes worth a line (:func:`advisories`).

Each check raises :class:`ConfigError` naming the key, the value, every factor involved, what
is allowed and a hint. Nothing here imports torch: a bad config costs the user well under a
second.
"""

from __future__ import annotations

from collections.abc import Callable

from fsdp_cli.config.adapter_checks import check_adapters
from fsdp_cli.config.composition import check_composition
from fsdp_cli.config.data_checks import (
    check_accumulation,
    check_batch,
    check_data_path,
    check_datamodule,
    check_epoch_data,
    check_packing,
    check_sequence,
    check_validation_data,
    check_vocabulary,
)
from fsdp_cli.config.model_kinds import check_context_parallel, check_expert_parallel, check_model, kind_of
from fsdp_cli.config.pipeline_checks import check_pipeline_layout
from fsdp_cli.config.resolved import ResolvedRun
from fsdp_cli.config.schema import Accelerator, DataModuleConfig, TrainConfig
from fsdp_cli.config.strategies import check_strategy, entry_of
from fsdp_cli.config.trainer_checks import (
    check_async_save,
    check_callbacks,
    check_experiment_logger,
    check_optim,
    check_resume,
    check_trainer,
    check_wrap_and_logger,
)
from fsdp_cli.errors import ConfigError
from fsdp_cli.precision import check_precision_name
from fsdp_cli.ranges import range_problems


def checked_run(cfg: TrainConfig) -> ResolvedRun:
    """The run of a config whose layout :func:`fsdp_cli.launch.layout.resolve_layout` has
    resolved and checked, after what it must pass before it can be resolved at all: each field's
    own range, then the precision name (the precision table must know it)."""
    check_ranges(cfg)
    check_precision_name(cfg.precision.name, on_cpu=cfg.accelerator is Accelerator.cpu)
    return ResolvedRun.of(cfg)


def validate(run: ResolvedRun) -> None:
    """Raise :class:`ConfigError` for the first combination that cannot run: the cross-field
    checks on the run (:func:`checked_run` has checked each field's range and the precision).

    The data checks wait for the ranks when :func:`data_checks_deferred`: only the imported
    module can tell whether it trains on the ``data`` group at all.
    """
    for check in CHECKS:
        check(run)
    if not data_checks_deferred(run.cfg):
        validate_data(run)


def data_checks_deferred(cfg: TrainConfig) -> bool:
    """``model=custom`` with the default data group: a LightningModule with its own
    ``train_dataloader`` ignores it, so vocabulary and batch questions are asked in the ranks,
    of a module that uses it (:func:`validate_data`)."""
    return kind_of(cfg.model).target_decides and not cfg.explicit_data


def validate_data(run: ResolvedRun) -> None:
    """The checks of the ``data`` group (batch split, vocabulary, sequence length, files); none
    for ``data=datamodule``, whose batches are the user's DataModule's."""
    if isinstance(run.cfg.data, DataModuleConfig):
        return
    for check in DATA_CHECKS:
        check(run)


def advisories(cfg: TrainConfig) -> list[str]:
    """Settings that run but do nothing on this layout, worth one line each."""
    notes = []
    entry_of(cfg)  # (an unknown strategy: its one-line error, before its schema is asked)
    if cfg.strategy.offloads() and cfg.accelerator is Accelerator.cpu:
        notes.append(
            "note: strategy.cpu_offload has no effect on CPU processes (parameters already live in CPU memory)"
        )
    settings = cfg.strategy.parallelize_settings()
    if settings is not None and settings.sequence_parallel and cfg.tp == 1:
        notes.append("note: strategy.sequence_parallel has no effect with tp=1")
    t = cfg.trainer
    if t.max_epochs is not None and t.max_steps != -1:
        notes.append(
            f"note: trainer.max_steps={t.max_steps} and trainer.max_epochs={t.max_epochs} both limit this run: "
            "it stops at whichever comes first (trainer.max_steps=-1 trains for the epochs alone)"
        )
    return notes


def check_ranges(cfg: TrainConfig) -> None:
    """Every numeric setting within the range its field declares (:mod:`fsdp_cli.ranges`)."""
    for problem in range_problems(cfg):
        where = problem.range
        is_list = isinstance(problem.value, (list, tuple))
        raise ConfigError(
            problem.key,
            list(problem.value) if is_list else problem.value,
            f"must have each {where.describe()}" if is_list else where.problem(),
            allowed=problem.allowed(),
            hint=where.hint,
        )


CHECKS: tuple[Callable[[ResolvedRun], None], ...] = (
    check_strategy,
    check_composition,
    check_context_parallel,
    check_expert_parallel,
    check_pipeline_layout,
    check_model,
    check_adapters,
    check_datamodule,
    check_trainer,
    check_resume,
    check_wrap_and_logger,
    check_optim,
    check_async_save,
    check_experiment_logger,
    check_callbacks,
)
"""Cross-field checks, in order, on a run :func:`checked_run` built (after :func:`check_ranges`,
each field's own range, and :func:`~fsdp_cli.precision.check_precision_name`: the precision
table must know the name before a run can be resolved)."""
DATA_CHECKS: tuple[Callable[[ResolvedRun], None], ...] = (
    check_accumulation,
    check_batch,
    check_vocabulary,
    check_sequence,
    check_validation_data,
    check_data_path,
    check_packing,
    check_epoch_data,
)
