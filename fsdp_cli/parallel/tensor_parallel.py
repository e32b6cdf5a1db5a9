"""Tensor parallelism (DTensor) from a plan of ParallelStyles."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh


def model_tp_plan(model: nn.Module, *, sequence_parallel: bool) -> dict[str, Any] | None:
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


def replicate_parallel() -> Any:
    """A ParallelStyle that keeps a module whole on every tensor-parallel rank but makes its
    parameters DTensors (``Replicate``) on the tensor-parallel mesh.

    Without sequence parallel the norms are not split; left as plain tensors, FSDP would put them
    on the data-parallel mesh alone while every other weight lives on the (dp, tp) mesh, and
    DTensor refuses to mix meshes in the optimizer's and gradient clipping's fused (foreach) ops.
    """
    from torch.distributed.tensor import DTensor, Replicate, distribute_module
    from torch.distributed.tensor.parallel import ParallelStyle

    class ReplicateParallel(ParallelStyle):
        def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
            def replicate_params(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
                for p_name, param in list(mod.named_parameters(recurse=False)):
                    mod.register_parameter(
                        p_name, nn.Parameter(DTensor.from_local(param, mesh, [Replicate()], run_check=False))
                    )

            def to_dtensor(mod: nn.Module, inputs: Any, mesh: DeviceMesh) -> Any:
                return tuple(
                    DTensor.from_local(t, mesh, [Replicate()], run_check=False)
                    if hasattr(t, "dim") and not isinstance(t, DTensor)
                    else t
                    for t in inputs
                )

            def to_local(mod: nn.Module, outputs: Any, mesh: DeviceMesh) -> Any:
                return outputs.to_local() if isinstance(outputs, DTensor) else outputs

            return distribute_module(module, device_mesh, replicate_params, to_dtensor, to_local)

    return ReplicateParallel()
