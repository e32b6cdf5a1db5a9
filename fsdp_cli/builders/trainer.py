"""Trainer builder: the ``trainer``, ``logger`` and layout settings -> a Lightning ``Trainer``."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Checkpoint, ProgressBar
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger
from lightning.pytorch.profilers import PassThroughProfiler

from fsdp_cli.adapters.options import AdapterDtype, QuantizeBase
from fsdp_cli.builders.precision import precision_plugin
from fsdp_cli.config.resolved import Layout, ResolvedRun
from fsdp_cli.config.schema import LoggerName, Profiler, TrainConfig, TrainerConfig
from fsdp_cli.launch.environment import global_rank
from fsdp_cli.rundir.files import profiler_dir


def build_logger(cfg: TrainConfig) -> Logger | None:
    run_dir = Path(cfg.run_dir)
    if cfg.logger.name is LoggerName.csv:
        return CSVLogger(save_dir=run_dir, name="csv", version="")
    if cfg.logger.name is LoggerName.tensorboard:
        return TensorBoardLogger(save_dir=run_dir, name="tensorboard", version="")
    if cfg.logger.name in (LoggerName.mlflow, LoggerName.wandb):
        from fsdp_cli.builders.loggers import build_experiment_logger

        return build_experiment_logger(cfg.logger, run_dir)
    return None


class NoProfiler(PassThroughProfiler):
    """Lightning's default profiler (it records nothing), without its cost per hook call.

    Lightning wraps every hook it calls (each callback's each hook, every step, on every rank) in
    ``profiler.profile(name)``, a generator-based context manager even when it records nothing:
    about 70 on a step with fsdp-train's callbacks. This one hands back a plain context that
    yields the name as Lightning's does (``with trainer.profiler.profile(name) as action``) with
    no generator behind it; ``start``/``stop`` stay the pass-through no-ops."""

    def profile(self, action_name: str) -> contextlib.AbstractContextManager:  # type: ignore[override]
        return contextlib.nullcontext(action_name)


def build_profiler(cfg: TrainConfig, accumulation: int) -> Any:
    """Lightning's profiler for ``trainer.profiler``; files go to ``<run dir>/profiler/``."""
    t = cfg.trainer
    if t.profiler is Profiler.none:
        return NoProfiler()
    if t.profiler is Profiler.simple:
        from lightning.pytorch.profilers import SimpleProfiler

        return SimpleProfiler(dirpath=profiler_dir(cfg.run_dir), filename="simple")
    import torch
    from lightning.pytorch.profilers import PyTorchProfiler

    # Lightning steps the schedule once per training_step (micro-batch): one optimizer step of
    # wait, one of warm-up, then whole optimizer steps recorded.
    schedule = torch.profiler.schedule(
        wait=accumulation, warmup=accumulation, active=t.profile_steps * accumulation, repeat=1
    )
    return PyTorchProfiler(dirpath=profiler_dir(cfg.run_dir), filename="trace", schedule=schedule)


def precision_arguments(run: ResolvedRun) -> dict[str, Any]:
    """The Trainer's ``precision=`` (Lightning picks the plugin), or ``plugins=`` a plugin that
    only names it where the strategy's FSDP policy does the casting. (A rehearsal builds its
    Trainer with the same.)"""
    peft = run.cfg.peft
    plugin = precision_plugin(
        run.precision,
        policy_casts=run.entry.policy_casts,
        # (a quantized base must not meet Lightning's module.to(dtype): it would dequantize it)
        fp32_adapters=peft.enabled
        and (peft.adapter_dtype is AdapterDtype.float32 or peft.quantize_base is not QuantizeBase.none),
        fsdp1=run.entry.name == "fsdp",
    )
    return {"plugins": [plugin]} if plugin is not None else {"precision": run.precision.name}


def build_trainer(
    run: ResolvedRun,
    strategy: Any,
    *,
    callbacks: list[L.Callback],
    accumulation: int,
    module_loaders: bool = False,
    module_clip_val: float | None = None,
) -> L.Trainer:
    """``accumulation``: micro-batches per optimizer step. Gradient clipping is a callback
    (:mod:`fsdp_cli.callbacks.clipping`), not Lightning's, so it works under FSDP1 and mixed meshes.

    ``module_loaders``: the user's DataLoaders are used (the LightningModule's own, or those of
    its ``data=datamodule``). Lightning then gives each one a DistributedSampler over the
    strategy's data-parallel ranks (as ``Trainer`` does by default), so each data-parallel rank
    sees different samples and tensor-parallel peers the same ones. Our own DataModule shards by itself (the step-aligned sampler) and opts out.

    ``module_clip_val``: for a module with its own ``configure_gradient_clipping``, the
    ``gradient_clip_val`` Lightning passes to it.

    Validation follows the path: Lightning's defaults for the module's own loaders
    (:func:`module_validation`), fsdp-train's for its data (:func:`token_validation`).
    """
    cfg = run.cfg
    t = cfg.trainer
    kwargs = precision_arguments(run)
    kwargs.update(_gradient_clipping(t, module_clip_val))
    kwargs.update(_validation(t, accumulation, module_loaders=module_loaders))
    return L.Trainer(
        **_placement(run.layout),
        strategy=strategy,
        max_steps=t.max_steps,
        max_epochs=t.max_epochs if t.max_epochs is not None else -1,
        accumulate_grad_batches=accumulation,
        log_every_n_steps=t.log_every_n_steps,
        logger=build_logger(cfg) or False,
        callbacks=callbacks,
        deterministic=t.deterministic,
        **_callback_switches(t, callbacks),
        enable_model_summary=False,
        use_distributed_sampler=module_loaders,
        default_root_dir=cfg.run_dir,
        profiler=build_profiler(cfg, accumulation),
        **kwargs,
    )


def _placement(layout: Layout) -> dict[str, Any]:
    """Where the ranks run: the layout's accelerator, devices per node and nodes."""
    return {"accelerator": layout.accelerator, "devices": layout.devices, "num_nodes": layout.num_nodes}


def _gradient_clipping(t: TrainerConfig, module_clip_val: float | None) -> dict[str, Any]:
    # As given (None when unset): Lightning hands it to configure_gradient_clipping and checks
    # clip_gradients(..., gradient_clip_algorithm=...) against it. The value itself only when the
    # module clips itself: otherwise our GradientClipping callback clips.
    return {"gradient_clip_val": module_clip_val, "gradient_clip_algorithm": t.gradient_clip_algorithm}


def _callback_switches(t: TrainerConfig, callbacks: list[L.Callback]) -> dict[str, Any]:
    """The Trainer's checkpointing and progress-bar switches, on for the callbacks that need them."""
    # Our checkpoints are a callback of ours; Lightning's ModelCheckpoint, when the config's
    # callbacks hold one, saves through the same strategy (the same format, resumable). A
    # progress bar among them is wanted too (Lightning refuses one with the flag off).
    return {
        "enable_checkpointing": any(isinstance(c, Checkpoint) for c in callbacks),
        "enable_progress_bar": t.enable_progress_bar or any(isinstance(c, ProgressBar) for c in callbacks),
    }


def _validation(t: TrainerConfig, accumulation: int, *, module_loaders: bool) -> dict[str, Any]:
    """Validation follows the path: the module's own loaders or fsdp-train's data."""
    validation = module_validation if module_loaders else token_validation
    return validation(t, accumulation)


def module_validation(t: TrainerConfig, accumulation: int) -> dict[str, Any]:
    """A module's own ``val_dataloader`` (or its DataModule's) validates as under a plain
    ``Trainer``: a sanity check of 2 batches, the whole loader, after every epoch; each key the
    config sets replaces Lightning's default (``val_check_interval`` in optimizer steps)."""
    kwargs: dict[str, Any] = {}
    if t.val_check_interval is not None:
        kwargs.update(_every_n_steps(t.val_check_interval, accumulation))
    if t.limit_val_batches is not None:
        kwargs["limit_val_batches"] = t.limit_val_batches
    if t.num_sanity_val_steps is not None:
        kwargs["num_sanity_val_steps"] = t.num_sanity_val_steps
    return kwargs


def token_validation(t: TrainerConfig, accumulation: int) -> dict[str, Any]:
    """fsdp-train's data validates only with ``val_check_interval`` (its held-out batches,
    ``limit_val_batches`` of them, 4 by default) and runs no sanity check unless asked; a
    validation setting given without the interval is named in a note, not ignored silently."""
    if t.val_check_interval is None:
        _note_unused_validation(t)
        return {"limit_val_batches": 0, "num_sanity_val_steps": 0}
    return {
        **_every_n_steps(t.val_check_interval, accumulation),
        "limit_val_batches": TOKEN_VAL_BATCHES if t.limit_val_batches is None else t.limit_val_batches,
        "num_sanity_val_steps": t.num_sanity_val_steps or 0,
    }


def _note_unused_validation(t: TrainerConfig) -> None:
    unused = [
        f"trainer.{k}" for k in ("limit_val_batches", "num_sanity_val_steps") if getattr(t, k) is not None
    ]
    if unused and global_rank() == 0:
        print(
            f"fsdp-train: note: {' and '.join(unused)} {'has' if len(unused) == 1 else 'have'} no effect: "
            "fsdp-train's data validates only with trainer.val_check_interval=N",
            file=sys.stderr,
            flush=True,
        )


TOKEN_VAL_BATCHES = 4
"""Held-out batches per validation of fsdp-train's data when ``trainer.limit_val_batches`` is null."""


def _every_n_steps(steps: int, accumulation: int) -> dict[str, Any]:
    # Lightning counts validation intervals in batches; ours are optimizer steps.
    return {"val_check_interval": steps * accumulation, "check_val_every_n_epoch": None}
