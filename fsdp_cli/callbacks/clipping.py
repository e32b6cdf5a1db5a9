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
from torch import nn


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
        self.grad_norm = clip_grad_norm(trainer.model, pl_module.parameters(), self.max_value)


def clip_grad_norm(wrapped: nn.Module, parameters: Any, max_norm: float) -> torch.Tensor:
    """Clip by the global gradient norm across all shards; returns that norm (before clipping)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

    if isinstance(wrapped, FSDP1):
        # FSDP1 holds flat sharded gradients: only the root knows how to total them.
        return wrapped.clip_grad_norm_(max_norm).detach()
    params = [p for p in parameters if p.grad is not None]
    # With tensor parallel, TP-sharded weights live on the (dp, tp) mesh and the others (norms)
    # on the dp mesh only: DTensor cannot mix meshes, so total each mesh's gradients separately.
    groups = list(_by_mesh(params).values())
    norms = []
    for group in groups:
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], foreach=True)
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    total = torch.linalg.vector_norm(torch.stack([n.float() for n in norms])) if norms else torch.zeros(())
    for group in groups:
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=True)
    return total.detach()


def _by_mesh(params: list[nn.Parameter]) -> dict[Any, list[nn.Parameter]]:
    groups: dict[Any, list[nn.Parameter]] = {}
    for p in params:
        groups.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    return groups
