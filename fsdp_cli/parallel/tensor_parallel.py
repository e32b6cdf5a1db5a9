"""Tensor parallelism (DTensor) from a model's plan of ParallelStyles.

The plan comes from the model (``model.tp_plan(sequence_parallel=...)``) or from the user; this
layer never knows a concrete model.
"""

from __future__ import annotations

from difflib import get_close_matches
from fnmatch import fnmatchcase
from functools import partial
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, distribute_module
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from fsdp_cli.errors import ConfigError


def model_tp_plan(model: nn.Module, *, sequence_parallel: bool) -> dict[str, Any] | None:
    """The model's own plan, ``model.tp_plan(sequence_parallel=...)``, or None if it has none."""
    plan_fn = getattr(model, "tp_plan", None)
    return plan_fn(sequence_parallel=sequence_parallel) if callable(plan_fn) else None


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, plan: dict[str, Any]) -> None:
    """Shard the modules named in ``plan`` across ``tp_mesh``; their weights become DTensors.

    A parameter that does not train keeps not training, whatever the style. A parameter shared
    by two modules (tied input and output embeddings) stays shared:
    ``parallelize_module`` gives each module a parameter of its own, so the tie is restored when
    both ends are sharded alike (a vocabulary-parallel embedding and a column-parallel head).
    """
    check_plan_names(model, plan)
    aliases = _aliases(model)
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    parallelize_module(model, tp_mesh, plan)
    # torch's SequenceParallel makes every parameter it replicates trainable (torch 2.13: a plain
    # nn.Parameter); a frozen norm under LoRA, or one a user froze, stays frozen.
    for name, param in model.named_parameters():
        if name in frozen:
            param.requires_grad_(False)
    for alias, source in aliases:
        src, dst = model.get_parameter(source), model.get_parameter(alias)
        if src is dst:
            continue
        placements = [getattr(t, "placements", "whole") for t in (dst, src)]
        if placements[0] != placements[1]:
            raise ValueError(
                f"tied parameters {alias} and {source} are split differently by the tensor-parallel plan "
                f"({placements[0]} vs {placements[1]})"
            )
        owner, _, name = alias.rpartition(".")
        setattr(model.get_submodule(owner), name, src)


def check_plan_names(model: nn.Module, plan: dict[str, Any]) -> None:
    """Every key of ``plan`` names a module of ``model`` (:func:`plan_key_matches`;
    ``parallelize_module`` only warns about a key that names none and leaves the module whole)."""
    names = [name for name, _ in model.named_modules() if name]
    for key in plan:
        if not any(plan_key_matches(key, name) for name in names):
            close = get_close_matches(key, names, n=3)
            raise ConfigError(
                "tensor-parallel plan",
                key,
                f"names no module of {type(model).__name__}",
                allowed=", ".join(close) if close else None,
                hint="correct the module names in the model's tp_plan() (or the parallelize_fn's plan)",
            )


def plan_key_matches(key: str, name: str) -> bool:
    """``parallelize_module``'s rule: a plan key names a module, ``*`` matching one segment."""
    pattern, parts = key.split("."), name.split(".")
    return len(pattern) == len(parts) and all(fnmatchcase(n, p) for n, p in zip(parts, pattern))


def _aliases(model: nn.Module) -> list[tuple[str, str]]:
    """(second name, first name) of every parameter reachable under more than one name."""
    first: dict[int, str] = {}
    aliases = []
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases.append((name, first[id(param)]))
        else:
            first[id(param)] = name
    return aliases


class ReplicateParallel(ParallelStyle):
    """Keeps a module whole on every tensor-parallel rank but makes its parameters DTensors
    (``Replicate``) on the tensor-parallel mesh.

    Without sequence parallel the norms are not split; left as plain tensors, FSDP would put them
    on the data-parallel mesh alone while every other weight lives on the (dp, tp) mesh, and
    DTensor refuses to mix meshes in the optimizer's and gradient clipping's fused (foreach) ops.

    ``input_layouts``: how a plain tensor reaching the module is laid out (it is made whole first:
    a sequence-sharded input is gathered); ``output_layouts``: how the (whole) output is handed on
    (``Shard(1)``: this rank's part of the sequence); ``use_local_output``: handed on as a plain
    tensor. LoRA's adapters under tensor parallel use them to meet the layer they wrap
    (:mod:`fsdp_cli.adapters.tensor_parallel`).
    """

    def __init__(
        self,
        *,
        input_layouts: Placement | None = None,
        output_layouts: Placement | None = None,
        use_local_output: bool = True,
    ) -> None:
        super().__init__()
        self.input_layouts = (input_layouts or Replicate(),)
        self.output_layouts = (output_layouts or Replicate(),)
        self.use_local_output = use_local_output

    # ParallelStyle's extension point is the abstract ``_apply`` (checked in fsdp_cli.compat).
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module,
            device_mesh,
            _replicate_params,
            partial(_inputs_to_dtensor, self.input_layouts[0]),
            partial(_outputs_as, self.output_layouts[0], self.use_local_output),
        )


def _replicate_params(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    for param_name, param in list(module.named_parameters(recurse=False)):
        replicated = DTensor.from_local(param, mesh, [Replicate()], run_check=False)
        module.register_parameter(param_name, nn.Parameter(replicated, requires_grad=param.requires_grad))


def _inputs_to_dtensor(layout: Placement, module: nn.Module, inputs: Any, mesh: DeviceMesh) -> Any:
    return tuple(_whole(t, layout, mesh) if hasattr(t, "dim") else t for t in inputs)


def _whole(t: Any, layout: Placement, mesh: DeviceMesh) -> DTensor:
    if not isinstance(t, DTensor):
        t = DTensor.from_local(t, mesh, [layout], run_check=False)
    return t if t.placements == (Replicate(),) else t.redistribute(mesh, [Replicate()])


def _outputs_as(layout: Placement, use_local: bool, module: nn.Module, outputs: Any, mesh: DeviceMesh) -> Any:
    if not isinstance(outputs, DTensor):
        return outputs
    if outputs.placements != (layout,):
        outputs = outputs.redistribute(mesh, [layout])
    return outputs.to_local() if use_local else outputs
