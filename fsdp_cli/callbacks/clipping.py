"""Gradient clipping that works under every strategy, for the built-in and for user modules.

Lightning's own clipping fails in two places this project must serve: its FSDP1 precision plugin
refuses ``gradient_clip_algorithm="norm"``, and ``torch.nn.utils.clip_grad_norm_`` cannot total
DTensor gradients that live on different meshes (tensor-parallel weights on the (dp, tp) mesh,
other parameters on the dp mesh only). This callback clips in ``on_before_optimizer_step``: after
gradients are complete (and unscaled under fp16), before the step, once per optimizer step.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch

from fsdp_cli.parallel.grad_norm import clip_grad_norm

__all__ = ["GradientClipping", "clip_grad_norm"]


class GradientClipping(L.Callback):
    """Clip to ``max_value`` by global norm (``norm``) or elementwise (``value``); keeps the norm for metrics."""

    def __init__(self, max_value: float, algorithm: str = "norm") -> None:
        self.max_value = max_value
        self.algorithm = algorithm
        self.grad_norm: torch.Tensor | None = None

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any
    ) -> None:
        if self.algorithm == "value":
            torch.nn.utils.clip_grad_value_(pl_module.parameters(), self.max_value)
            return
        # Under pipeline parallel the other stages hold the rest of the model's gradients.
        across = getattr(trainer.strategy, "pipeline_group", None)
        self.grad_norm = clip_grad_norm(trainer.model, pl_module.parameters(), self.max_value, across=across)
