"""The default ``parallelize_fn``: every parallelism applied in one place, in one order.

Order matters, and is the same as torchtitan's:
1. tensor parallel — before FSDP, so ``fully_shard`` sees DTensor parameters and shards them 2-D;
2. activation checkpointing — wraps whole blocks, so it must see them before compile;
3. ``torch.compile`` per block — compiles what will run, checkpoint wrapper included;
4. ``fully_shard`` per unit, then the root — last, over whatever modules the steps above left.

A user ``parallelize_fn`` replaces all of it. It is called with keywords only (NeMo's
FSDP2Strategy calling convention), and receives just the keywords its signature accepts.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_cli.config.schema import ActivationCheckpointing, WrapConfig
from fsdp_cli.models.init import canonical_name
from fsdp_cli.parallel.activation_checkpoint import apply_ac
from fsdp_cli.parallel.fsdp2 import apply_fsdp
from fsdp_cli.parallel.tensor_parallel import apply_tp, model_tp_plan
from fsdp_cli.parallel.wrap import repeated_block_class, wrap_units

log = logging.getLogger(__name__)

DP_REPLICATE, DP_SHARD, TP = "data_parallel_replicate", "data_parallel_shard", "tensor_parallel"


@dataclass
class ParallelizeReport:
    """What parallelize did, for the one-time setup printout."""

    tp_modules: int = 0
    ac_blocks: int = 0
    compiled_blocks: int = 0
    fsdp_units: list[str] = field(default_factory=list)


def parallelize(
    model: nn.Module,
    *,
    device_mesh: DeviceMesh,
    mp_policy: object | None = None,
    offload_policy: object | None = None,
    tp_shard_plan: dict[str, Any] | None = None,
    sequence_parallel: bool = False,
    activation_checkpointing: ActivationCheckpointing | bool = ActivationCheckpointing.none,
    ac_every_n_blocks: int = 2,
    compile: bool = False,
    reshard_after_forward: bool | int = True,
    wrap: WrapConfig | None = None,
) -> ParallelizeReport:
    """Apply tensor parallel, activation checkpointing, compile and FSDP2 to ``model`` in place.

    ``device_mesh`` has the dimensions ``data_parallel_replicate``, ``data_parallel_shard`` and
    ``tensor_parallel`` (sizes may be 1).
    """
    report = ParallelizeReport()
    wrap = wrap or WrapConfig()
    if isinstance(activation_checkpointing, bool):
        activation_checkpointing = (
            ActivationCheckpointing.full if activation_checkpointing else ActivationCheckpointing.none
        )

    # Units are chosen before any wrapper is inserted, from the model as the user wrote it.
    units = wrap_units(model, wrap)
    # Checkpointing and compile work per transformer block, whatever the FSDP units are.
    block_cls = repeated_block_class(model)
    blocks = [m for m in model.modules() if block_cls is not None and isinstance(m, block_cls)] or units

    tp_mesh = device_mesh[TP]
    if tp_mesh.size() > 1:
        plan = tp_shard_plan or model_tp_plan(model, sequence_parallel=sequence_parallel)
        if plan is None:
            raise ValueError(
                f"tp={tp_mesh.size()} but {type(model).__name__} has no tensor-parallel plan: define "
                "model.tp_plan(sequence_parallel) or pass strategy.parallelize_fn"
            )
        apply_tp(model, tp_mesh, plan)
        report.tp_modules = len(plan)

    report.ac_blocks = apply_ac(model, blocks, activation_checkpointing, ac_every_n_blocks)

    if compile:
        for block in blocks:
            # Module.compile() compiles in place: parameter names (and checkpoints) do not change.
            block.compile()
        report.compiled_blocks = len(blocks)

    replicate = device_mesh[DP_REPLICATE].size()
    dp_mesh = device_mesh[DP_REPLICATE, DP_SHARD] if replicate > 1 else device_mesh[DP_SHARD]
    apply_fsdp(
        model,
        dp_mesh,
        units,
        reshard_after_forward=reshard_after_forward,
        mp_policy=mp_policy,
        offload_policy=offload_policy,
    )
    names = {id(m): canonical_name(n) for n, m in model.named_modules()}
    report.fsdp_units = [names.get(id(u), type(u).__name__) for u in units] + ["<root>"]
    return report


def call_parallelize_fn(
    fn: Callable[..., Any], model: nn.Module, device_mesh: DeviceMesh, **options: Any
) -> Any:
    """Call a user ``parallelize_fn`` with the keywords its signature accepts."""
    params = inspect.signature(fn).parameters
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs = {k: v for k, v in options.items() if takes_all or k in params}
    if "device_mesh" in params or takes_all:
        return fn(model, device_mesh=device_mesh, **kwargs)
    return fn(model, device_mesh, **kwargs)
