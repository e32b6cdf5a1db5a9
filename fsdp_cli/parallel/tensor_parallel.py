"""Tensor parallelism (DTensor) from a plan of ParallelStyles."""

from __future__ import annotations

from typing import Any, Optional

from torch import nn
from torch.distributed.device_mesh import DeviceMesh


def model_tp_plan(model: nn.Module, *, sequence_parallel: bool) -> Optional[dict[str, Any]]:
    """The model's own plan: the built-in Llama's, or ``model.tp_plan(sequence_parallel=...)`` if defined."""
    from fsdp_cli.models.llama import Llama, llama_tp_plan

    if isinstance(model, Llama):
        return llama_tp_plan(model, sequence_parallel=sequence_parallel)
    plan_fn = getattr(model, "tp_plan", None)
    return plan_fn(sequence_parallel=sequence_parallel) if callable(plan_fn) else None


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, plan: dict[str, Any]) -> None:
    """Shard the modules named in ``plan`` across ``tp_mesh``; their weights become DTensors."""
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, tp_mesh, plan)
