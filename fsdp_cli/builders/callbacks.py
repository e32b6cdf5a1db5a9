"""Callbacks builder: what every run measures, saves and reports, from the config."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import lightning as L

from fsdp_cli.callbacks.clipping import GradientClipping
from fsdp_cli.callbacks.heartbeat import HeartbeatCallback
from fsdp_cli.callbacks.metrics import MetricsCallback
from fsdp_cli.callbacks.nonfinite import NonFiniteGuard
from fsdp_cli.callbacks.setup_report import SetupReport
from fsdp_cli.checkpoint.callback import CheckpointCallback
from fsdp_cli.checkpoint.run import checkpoint_dir
from fsdp_cli.config.schema import TrainConfig
from fsdp_cli.launch.rank_monitor import RankMonitor


@dataclass
class RunCallbacks:
    metrics: MetricsCallback
    setup: SetupReport
    checkpoints: CheckpointCallback
    clipping: GradientClipping | None
    nonfinite: NonFiniteGuard
    heartbeat: HeartbeatCallback | None = None

    def as_list(self) -> list[L.Callback]:
        # Clipping first: the metrics row of a step reports the norm clipping computed, and the
        # non-finite guard checks it. The heartbeat last: a step has finished when it beats.
        first = [self.clipping] if self.clipping is not None else []
        last = [self.heartbeat] if self.heartbeat is not None else []
        return [*first, self.nonfinite, self.setup, self.metrics, self.checkpoints, *last]


def build_callbacks(
    cfg: TrainConfig, *, module_loaders: bool = False, monitor: RankMonitor | None = None
) -> RunCallbacks:
    """``module_loaders``: batches come from the LightningModule's own DataLoaders, whose size in
    tokens is unknown; throughput is then counted in samples. ``monitor``: this rank's heartbeat."""
    t = cfg.trainer
    clipping = (
        GradientClipping(t.gradient_clip_val, t.gradient_clip_algorithm)
        if t.gradient_clip_val is not None
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
        nonfinite=nonfinite,
    )
    checkpoints = CheckpointCallback(cfg.checkpoint, checkpoint_dir(cfg), t.max_steps)
    checkpoints.before_save.append(nonfinite.check_before_save)
    return RunCallbacks(
        metrics=metrics,
        setup=SetupReport(),
        checkpoints=checkpoints,
        clipping=clipping,
        nonfinite=nonfinite,
        heartbeat=HeartbeatCallback(monitor) if monitor is not None else None,
    )
