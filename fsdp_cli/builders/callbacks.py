"""Callbacks builder: what every run measures, saves and reports, from the config."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L

from fsdp_cli.callbacks.clipping import GradientClipping
from fsdp_cli.callbacks.heartbeat import HeartbeatCallback
from fsdp_cli.callbacks.metrics import MetricsCallback
from fsdp_cli.callbacks.nonfinite import NonFiniteGuard
from fsdp_cli.callbacks.progress import ProgressDisplay
from fsdp_cli.callbacks.setup_report import SetupReport
from fsdp_cli.callbacks.throughput import Throughput, counted_flops_per_token, llama_flops_per_token
from fsdp_cli.checkpoint.callback import CheckpointCallback
from fsdp_cli.checkpoint.run import checkpoint_dir
from fsdp_cli.config.schema import LlamaConfig, TrainConfig
from fsdp_cli.launch.rank_monitor import RankMonitor


@dataclass
class RunCallbacks:
    metrics: MetricsCallback
    setup: SetupReport
    checkpoints: CheckpointCallback
    clipping: GradientClipping | None
    nonfinite: NonFiniteGuard
    progress: ProgressDisplay | None = None
    heartbeat: HeartbeatCallback | None = None
    module_clip_val: float | None = None
    """For a module with its own ``configure_gradient_clipping``: the value Lightning hands it
    (``Trainer(gradient_clip_val=...)``); the module clips, not :attr:`clipping`."""

    def as_list(self) -> list[L.Callback]:
        # Clipping first: the metrics row of a step reports the norm clipping computed, and the
        # non-finite guard checks it. The progress display after the metrics, whose rows it
        # shows; the heartbeat last: a step has finished when it beats.
        first = [self.clipping] if self.clipping is not None else []
        progress = [self.progress] if self.progress is not None else []
        last = [self.heartbeat] if self.heartbeat is not None else []
        return [*first, self.nonfinite, self.setup, self.metrics, *progress, self.checkpoints, *last]


BUILT_IN_CLIP_VAL = 1.0
"""``trainer.gradient_clip_val=null`` for the modules fsdp-train trains itself (built-in, hf, nn.Module)."""


def gradient_clip_val(cfg: TrainConfig, module: Any) -> float | None:
    """``trainer.gradient_clip_val`` resolved for ``module`` (None: no clipping). Unset, a
    LightningModule trained as it is gets Lightning's Trainer default (no clipping) and
    fsdp-train's causal-LM module (the built-in model, ``model=hf``, a plain nn.Module) 1.0; 0
    turns clipping off, as in Lightning."""
    from fsdp_cli.models.causal_lm import CausalLMModule

    value = cfg.trainer.gradient_clip_val
    if value is None and isinstance(module, CausalLMModule):
        value = BUILT_IN_CLIP_VAL
    return value or None


def clips_itself(module: Any) -> bool:
    """A module that overrides ``configure_gradient_clipping`` decides (Lightning calls it)."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    return module is not None and is_overridden("configure_gradient_clipping", module, L.LightningModule)


def build_throughput(cfg: TrainConfig, module: Any) -> Throughput:
    """FLOPs per token of the model (formula for the built-in one, counted for others) and the peak."""
    import torch

    seq = getattr(cfg.data, "seq_len", None)
    flops: float | None = None
    if isinstance(cfg.model, LlamaConfig):
        flops = llama_flops_per_token(cfg.model, seq)
    elif seq and callable(getattr(module, "model_factory", None)):  # a plain nn.Module in CausalLMModule
        flops = counted_flops_per_token(module.model_factory, seq, cfg.data.vocab_size)
    peak = cfg.trainer.peak_tflops
    if peak is None and cfg.accelerator.value == "gpu" and torch.cuda.is_available():
        from fsdp_cli.callbacks.throughput import device_peak_tflops

        peak = device_peak_tflops(torch.cuda.get_device_name(), cfg.precision.name)
    return Throughput(flops_per_token=flops, world_size=int(cfg.devices) * cfg.num_nodes, peak_tflops=peak)


def build_callbacks(
    cfg: TrainConfig,
    module: Any = None,
    *,
    module_loaders: bool = False,
    monitor: RankMonitor | None = None,
) -> RunCallbacks:
    """``module``: the LightningModule (its model's FLOPs per token are counted for MFU);
    ``module_loaders``: batches come from the LightningModule's own DataLoaders, whose size in
    tokens is unknown; throughput is then counted in samples (and MFU is not reported);
    ``monitor``: this rank's heartbeat."""
    t = cfg.trainer
    clip_val = gradient_clip_val(cfg, module)
    own_clipping = clips_itself(module)
    clipping = (
        GradientClipping(clip_val, t.gradient_clip_algorithm)
        if clip_val is not None and not own_clipping
        else None
    )
    nonfinite = NonFiniteGuard(
        skip_budget=t.skip_nonfinite_steps,
        clipping=clipping,
        check_grad_norm=cfg.precision.name != "16-mixed",  # loss scaling skips overflowing steps itself
    )
    metrics = MetricsCallback(
        Path(cfg.run_dir),
        log_every_n_steps=t.log_every_n_steps,
        tokens_per_step=None if module_loaders else cfg.data.global_batch_size * cfg.data.seq_len,
        max_steps=t.max_steps,
        clipping=clipping,
        throughput=None if module_loaders else build_throughput(cfg, module),
        nonfinite=nonfinite,
    )
    checkpoints = CheckpointCallback(cfg.checkpoint, checkpoint_dir(cfg), t.max_steps)
    checkpoints.before_save.append(nonfinite.check_before_save)
    return RunCallbacks(
        metrics=metrics,
        setup=SetupReport(),
        checkpoints=checkpoints,
        clipping=clipping,
        progress=ProgressDisplay(metrics, t.max_steps),
        nonfinite=nonfinite,
        heartbeat=HeartbeatCallback(monitor) if monitor is not None else None,
        module_clip_val=clip_val if own_clipping else None,
    )
