"""Checks of what the Trainer is handed: the ``trainer`` group's limits and profiler, the
optimizer, ``resume``, the checkpoint saves, the wrap policy, the logger (its package installed)
and the ``callbacks`` entries. Each takes the resolved run and raises one :class:`ConfigError`;
:mod:`fsdp_cli.config.validate` runs them in its order.
"""

from __future__ import annotations

import importlib.util
import os

from fsdp_cli.checkpoint_format import CheckpointFormat
from fsdp_cli.config.resolved import ResolvedRun
from fsdp_cli.config.schema import LoggerName, Profiler, WrapPolicy
from fsdp_cli.dotted import check_dotted
from fsdp_cli.errors import ConfigError
from fsdp_cli.extras import install_hint


def check_trainer(run: ResolvedRun) -> None:
    cfg = run.cfg
    trainer = cfg.trainer
    if trainer.max_steps == -1 and trainer.max_epochs is None:
        raise ConfigError(
            "trainer.max_steps",
            -1,
            "no step limit and no epoch limit: the run would never end",
            allowed="a positive number of steps, or -1 with trainer.max_epochs=N",
            hint="set trainer.max_epochs=N, or trainer.max_steps=N",
        )
    if trainer.gradient_clip_algorithm not in (None, "norm", "value"):
        raise ConfigError(
            "trainer.gradient_clip_algorithm",
            trainer.gradient_clip_algorithm,
            "unknown",
            allowed="norm, value",
        )
    if trainer.profiler is Profiler.torch and -1 < trainer.max_steps < trainer.profile_steps + 2:
        raise ConfigError(
            "trainer.max_steps",
            trainer.max_steps,
            f"trainer.profiler=torch records steps 3..{trainer.profile_steps + 2} (one step of wait, one of warm-up)",
            allowed=f"at least {trainer.profile_steps + 2}",
            hint="raise trainer.max_steps or lower trainer.profile_steps",
        )


def check_optim(run: ResolvedRun) -> None:
    """What torch.optim.AdamW and the schedule would refuse, refused before any rank starts."""
    cfg = run.cfg
    optim = cfg.optim  # (each coefficient's range is declared with the field)
    if len(optim.betas) != 2:
        raise ConfigError(
            "optim.betas",
            list(optim.betas),
            "AdamW needs two coefficients, each in [0, 1)",
            allowed="[beta1, beta2] with 0 <= beta < 1",
            hint="optim.betas=[0.9,0.95]",
        )


def check_resume(run: ResolvedRun) -> None:
    cfg = run.cfg
    if cfg.resume not in (None, "auto") and not os.path.exists(str(cfg.resume)):
        raise ConfigError(
            "resume",
            cfg.resume,
            "no such checkpoint",
            allowed="null, auto, or an existing checkpoint path",
            hint="fsdp-ckpt inspect PATH shows what a checkpoint holds",
        )


def check_async_save(run: ResolvedRun) -> None:
    """Against the format this run really saves in (``strategy=model_parallel``'s
    ``save_distributed_checkpoint`` decides it over ``checkpoint=``), not the group's."""
    cfg = run.cfg
    if cfg.checkpoint.async_save and run.checkpoint_format is not CheckpointFormat.sharded:
        decided_by = (
            "checkpoint=full"
            if cfg.checkpoint.format is not CheckpointFormat.sharded
            else f"strategy.save_distributed_checkpoint=false (strategy={cfg.strategy.name})"
        )
        raise ConfigError(
            "checkpoint.async_save",
            True,
            f"background saves write sharded checkpoints; with {decided_by} this run saves one file",
            allowed="a sharded checkpoint with async_save=true",
            hint="use checkpoint=sharded and leave strategy.save_distributed_checkpoint unset "
            "(fsdp-ckpt convert makes a single file afterwards), or checkpoint.async_save=false",
        )


def check_wrap_and_logger(run: ResolvedRun) -> None:
    cfg = run.cfg
    if cfg.wrap.policy is WrapPolicy.classes and not cfg.wrap.classes:
        raise ConfigError(
            "wrap.classes",
            [],
            "wrap=classes needs at least one module class",
            hint="wrap.classes=[TransformerBlock] (bare or dotted class names)",
        )
    if cfg.logger.name is LoggerName.tensorboard and not (
        importlib.util.find_spec("tensorboard") or importlib.util.find_spec("tensorboardX")
    ):
        raise ConfigError(
            "logger",
            "tensorboard",
            "the tensorboard package is not installed",
            allowed="none, csv",
            hint="pip install tensorboard, or use logger=csv",
        )


LOGGER_PACKAGES = {
    LoggerName.mlflow: ("mlflow", "mlflow"),
    LoggerName.wandb: ("wandb", "wandb"),
}
"""logger option -> (the module Lightning's logger imports, the fsdp-cli extra that installs it)."""


def check_experiment_logger(run: ResolvedRun) -> None:
    """``logger=mlflow``/``wandb``: the package is installed (and, for MLflow's default SQLite store,
    SQLAlchemy and Alembic, which the full ``mlflow`` brings and ``mlflow-skinny`` does not)."""
    cfg = run.cfg
    if cfg.logger.name not in LOGGER_PACKAGES:
        return
    module, extra = LOGGER_PACKAGES[cfg.logger.name]
    needed = [module]
    uri = cfg.logger.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:"
    if cfg.logger.name is LoggerName.mlflow and uri.startswith("sqlite:"):
        needed += ["sqlalchemy", "alembic"]
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigError(
            "logger",
            cfg.logger.name.value,
            f"the {' and '.join(missing)} package{'s are' if len(missing) > 1 else ' is'} not installed",
            allowed="none, csv",
            hint=install_hint(extra),
        )


def check_callbacks(run: ResolvedRun) -> None:
    """Each ``callbacks`` entry names a module that can be imported (found without importing it:
    whether it holds a Lightning Callback taking those arguments is asked on the resolve path,
    :mod:`fsdp_cli.config.callback_classes`, where importing it is allowed)."""
    for name, entry in run.cfg.callbacks.items():
        if entry is not None:
            check_dotted(f"callbacks.{name}._target_", str(entry["_target_"]))
