"""What a rank trains: the module, data, strategy, callbacks and trainer built from the resolved
run (:func:`build`), and the fit with its final save (:func:`fit`).

The process around it is :mod:`fsdp_cli.worker.process`; what the rank reports afterwards is
:mod:`fsdp_cli.worker.summary`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from fsdp_cli.config.resolved import ResolvedRun
from fsdp_cli.config.schema import TrainConfig
from fsdp_cli.worker.monitor import RankMonitor


@dataclass
class BuiltRank:
    """What one rank builds for a run (:func:`build`)."""

    module: Any
    datamodule: Any
    trainer: Any
    callbacks: Any  # fsdp_cli.builders.callbacks.RunCallbacks
    parameters_at_build: int = 0
    tokens: bool = True
    """Trained on fsdp-train's token batches (else the module's or its DataModule's loaders)."""


@dataclass
class FitResult:
    """How :func:`fit` ended: the steps taken, the last checkpoint saved, whether a stop signal ended it."""

    steps: int
    checkpoint: str | None
    preempted: bool


def build(run: ResolvedRun, monitor: RankMonitor | None = None) -> BuiltRank:
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
    return BuiltRank(
        module=module,
        datamodule=datamodule,
        trainer=trainer,
        callbacks=callbacks,
        parameters_at_build=parameter_count(module),
        tokens=not own,
    )


def fit(run: ResolvedRun, built: BuiltRank) -> FitResult:
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


def parameter_count(module: Any) -> int:
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
