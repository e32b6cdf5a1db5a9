"""Callbacks builder: what every run measures, saves and reports, from the config."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning as L

from fsdp_cli.callbacks.clipping import GradientClipping
from fsdp_cli.callbacks.heartbeat import HeartbeatCallback
from fsdp_cli.callbacks.metrics import MetricsCallback
from fsdp_cli.callbacks.nonfinite import NonFiniteGuard
from fsdp_cli.callbacks.progress import ProgressDisplay
from fsdp_cli.callbacks.samples import SAMPLES_DIR, SampleAnswers
from fsdp_cli.callbacks.setup_report import SetupReport
from fsdp_cli.callbacks.throughput import Throughput, device_peak_tflops
from fsdp_cli.checkpoint.callback import CheckpointCallback
from fsdp_cli.checkpoint.run import checkpoint_dir
from fsdp_cli.config.resolved import ResolvedRun
from fsdp_cli.config.schema import TrainConfig
from fsdp_cli.dotted import instantiate
from fsdp_cli.errors import ConfigError

if TYPE_CHECKING:  # (type-only: the rank's monitor is handed in by the worker)
    from fsdp_cli.worker.monitor import RankMonitor


@dataclass
class RunCallbacks:
    metrics: MetricsCallback
    setup: SetupReport
    checkpoints: CheckpointCallback
    clipping: GradientClipping | None
    nonfinite: NonFiniteGuard
    progress: ProgressDisplay | None = None
    heartbeat: HeartbeatCallback | None = None
    samples: SampleAnswers | None = None
    """``trainer.sample_prompts``' answers (after the metrics row of the step they follow)."""
    user: list[L.Callback] = field(default_factory=list)
    """The config's ``callbacks`` entries."""
    module_clip_val: float | None = None
    """For a module with its own ``configure_gradient_clipping``: the value Lightning hands it
    (``Trainer(gradient_clip_val=...)``); the module clips, not :attr:`clipping`."""

    def as_list(self) -> list[L.Callback]:
        # Clipping first: the metrics row of a step reports the norm clipping computed, and the
        # non-finite guard checks it. The progress display after the metrics, whose rows it
        # shows; the heartbeat last: a step has finished when it beats. The user's callbacks
        # after ours: in each hook they see the step's metrics row (Lightning moves checkpoint
        # callbacks, ModelCheckpoint, to the very end by itself).
        first = [self.clipping] if self.clipping is not None else []
        progress = [self.progress] if self.progress is not None else []
        last = [self.heartbeat] if self.heartbeat is not None else []
        samples = [self.samples] if self.samples is not None else []
        ours = [
            *first,
            self.nonfinite,
            self.setup,
            self.metrics,
            *progress,
            *samples,
            self.checkpoints,
            *last,
        ]
        return [*ours, *self.user]


BUILT_IN_CLIP_VAL = 1.0
"""``trainer.gradient_clip_val=null`` for the modules fsdp-train trains itself (built-in, hf, nn.Module)."""


def gradient_clip_val(run: ResolvedRun, module: Any) -> float | None:
    """``trainer.gradient_clip_val`` resolved for ``module`` (None: no clipping). Unset, a
    LightningModule trained as it is gets Lightning's Trainer default (no clipping) and
    fsdp-train's causal-LM module (the built-in model, ``model=hf``, a plain nn.Module) 1.0; 0
    turns clipping off, as in Lightning. (Resolved here, once per rank, not in the parent: which
    one it is is known only once ``model._target_`` is built.)"""
    from fsdp_cli.models.causal_lm import CausalLMModule

    value = run.cfg.trainer.gradient_clip_val
    if value is None and isinstance(module, CausalLMModule):
        value = BUILT_IN_CLIP_VAL
    return value or None


def clips_itself(module: Any) -> bool:
    """A module that overrides ``configure_gradient_clipping`` decides (Lightning calls it)."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    return module is not None and is_overridden("configure_gradient_clipping", module, L.LightningModule)


def build_throughput(run: ResolvedRun, module: Any, device_name: str | None = None) -> Throughput:
    """FLOPs per token of the model (its kind's answer: the formula for the built-in one, counted for
    others) and the
    device's peak for the compute dtype in effect (``device_name``: the CUDA device's, looked up
    when None and the run is on a GPU)."""
    cfg = run.cfg
    flops = run.model_kind.flops_per_token(run, module)
    peak = cfg.trainer.peak_tflops
    if peak is None and run.layout.on_gpu:
        name = device_name if device_name is not None else _cuda_device_name()
        peak = device_peak_tflops(name, run.precision.compute) if name else None
    return Throughput(flops_per_token=flops, world_size=run.layout.world_size, peak_tflops=peak)


def _cuda_device_name() -> str | None:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def build_callbacks(
    run: ResolvedRun,
    module: Any = None,
    *,
    module_loaders: bool = False,
    monitor: RankMonitor | None = None,
) -> RunCallbacks:
    """``module``: the LightningModule (its model's FLOPs per token are counted for MFU);
    ``module_loaders``: batches come from the LightningModule's own DataLoaders, whose size in
    tokens is unknown; throughput is then counted in samples (and MFU is not reported);
    ``monitor``: this rank's heartbeat."""
    cfg = run.cfg
    t = cfg.trainer
    clip_val = gradient_clip_val(run, module)
    own_clipping = clips_itself(module)
    clipping = (
        GradientClipping(clip_val, t.gradient_clip_algorithm or "norm")
        if clip_val is not None and not own_clipping
        else None
    )
    nonfinite = NonFiniteGuard(
        skip_budget=t.skip_nonfinite_steps,
        clipping=clipping,
        check_grad_norm=not run.precision.spec.loss_scaling,  # loss scaling skips overflowing steps itself
    )
    metrics = _build_metrics(run, module, clipping, nonfinite, module_loaders=module_loaders)
    checkpoints = CheckpointCallback(
        cfg.checkpoint, checkpoint_dir(cfg), t.max_steps, run.checkpoint_format, run_id=cfg.run_id
    )
    checkpoints.before_save.append(nonfinite.check_before_save)
    return RunCallbacks(
        metrics=metrics,
        setup=SetupReport(stop_notes(cfg)),
        checkpoints=checkpoints,
        clipping=clipping,
        progress=ProgressDisplay(metrics, t.max_steps),
        nonfinite=nonfinite,
        heartbeat=HeartbeatCallback(monitor) if monitor is not None else None,
        samples=build_samples(cfg),
        user=[*_start_from(cfg), *build_user_callbacks(cfg)],
        module_clip_val=clip_val if own_clipping else None,
    )


def build_samples(cfg: TrainConfig) -> SampleAnswers | None:
    """``trainer.sample_prompts``, rendered on this rank as the parent checked them."""
    if not cfg.trainer.sample_prompts:
        return None
    from fsdp_cli.data.prompts import answer_text, run_prompts

    found = run_prompts(cfg)
    return SampleAnswers(
        found.rows,
        decode=lambda tokens: answer_text(found.tokenizer, tokens, found.eos),
        eos=found.eos,
        max_new_tokens=cfg.trainer.sample_max_new_tokens,
        context=cfg.data.seq_len,
        folder=Path(cfg.run_dir) / SAMPLES_DIR,
    )


def _start_from(cfg: TrainConfig) -> list[L.Callback]:
    """``peft=lora`` on a full fine-tune's checkpoint: its weights fill the base before step 1."""
    if cfg.start_from is None:
        return []
    from fsdp_cli.checkpoint.start_from import StartFromWeights

    return [StartFromWeights(cfg.start_from)]


def _build_metrics(
    run: ResolvedRun,
    module: Any,
    clipping: GradientClipping | None,
    nonfinite: NonFiniteGuard,
    *,
    module_loaders: bool,
) -> MetricsCallback:
    """The metrics rows; with the module's own DataLoaders (``module_loaders``) neither tokens per
    step nor throughput is known."""
    cfg = run.cfg
    t = cfg.trainer
    return MetricsCallback(
        Path(cfg.run_dir),
        log_every_n_steps=t.log_every_n_steps,
        tokens_per_step=None if module_loaders else cfg.data.global_batch_size * cfg.data.seq_len,
        max_steps=t.max_steps,
        clipping=clipping,
        throughput=None if module_loaders else build_throughput(run, module),
        nonfinite=nonfinite,
    )


def stop_notes(cfg: TrainConfig) -> tuple[str, ...]:
    """What a SIGTERM does to this run, said at its start (the grace follows the run)."""
    if not cfg.checkpoint.save_on_sigterm:
        return ()
    launcher = cfg.launcher
    grace = (
        "1.5 x the longest step, at least 20 s (launcher.interrupt_grace_s=null)"
        if launcher.interrupt_grace_s is None
        else f"launcher.interrupt_grace_s={launcher.interrupt_grace_s:g} s"
    )
    return (
        f"on SIGTERM: a checkpoint at the next step boundary, waited for up to {grace}; "
        f"the whole stop within launcher.shutdown_timeout_s={launcher.shutdown_timeout_s} s",
    )


def build_user_callbacks(cfg: TrainConfig) -> list[L.Callback]:
    """The ``callbacks`` entries, built as the lightning-hydra-template convention has it (an
    argument that is itself a ``_target_`` node is built too). The parent checked that each class
    exists and takes its arguments; what a constructor still refuses (a value out of range) is the
    same one-line error, from the rank."""
    built = []
    for name, entry in cfg.callbacks.items():
        if entry is None:
            continue
        callback = instantiate(entry, f"callbacks.{name}")
        if not isinstance(callback, L.Callback):
            raise ConfigError(
                f"callbacks.{name}",
                entry["_target_"],
                f"built a {type(callback).__name__}, not a Lightning Callback",
                allowed="a subclass of lightning.pytorch.Callback, or a factory returning one",
            )
        built.append(callback)
    return built
