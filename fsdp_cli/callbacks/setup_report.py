"""What the run actually set up, printed once by rank 0 when training starts.

The mesh, the FSDP units, and the dtypes in effect — parameters as stored, compute, gradient
reduction, optimizer state — read from the live objects rather than from the config, so a
silent precision mistake (say, fp32 compute under a "bf16" run) is visible on the first screen.
After the first optimizer step it also records, per rank, the bytes its parameters, gradients
and optimizer state hold (``held_bytes``: distinct storages, padding included), which the
memory plan (:mod:`fsdp_cli.plan`) is checked against.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import lightning as L
import torch
from torch import nn

from fsdp_cli.compat.torch_internals import storage_bytes
from fsdp_cli.dtypes import dtype_name
from fsdp_cli.parallel.names import canonical_name


def _name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else dtype_name(dtype)


def describe_setup(trainer: L.Trainer) -> dict[str, Any]:
    strategy = trainer.strategy
    module = trainer.lightning_module
    params = list(module.parameters())
    stored = params[0].dtype if params else torch.float32
    # What gradients (and so reductions and moments) are in: fp32 adapters over a bf16 base differ.
    trained = next((p.dtype for p in params if p.requires_grad), stored)
    compute, reduce = _unit_precision(strategy.model or module, stored, trained)
    autocast = _autocast_dtype(trainer)
    if autocast is not None:
        compute = _name(autocast)
    optim_dtypes = _optimizer_state_dtypes(trainer) or {_name(trained)}
    report = getattr(strategy, "parallelize_report", None)
    info = {
        "mesh": _mesh(strategy),
        "fsdp_units": list(report.fsdp_units) if report is not None else _fsdp_units(strategy),
        "dtypes": {
            "param": _name(stored),
            "compute": compute,
            "reduce": reduce,
            "optimizer_state": sorted(d for d in optim_dtypes if d),
        },
        "activation_checkpointing": report.ac_blocks if report is not None else _ac_blocks(module),
        "tensor_parallel_modules": report.tp_modules if report is not None else None,
        # Read from the live modules, not from what was asked for: proof the options took effect.
        "compiled_blocks": _compiled_modules(module),
        "param_device": _param_devices(params),
        "float8_linears": report.float8_linears if report is not None else None,
        "float8_emulated": report.float8_emulated if report is not None else None,
    }
    if report is not None and report.expert_modules:
        info["expert_parallel_modules"] = report.expert_modules
    if any(not p.requires_grad for p in params):  # a LoRA run (or a model that froze its own)
        info["trainable"] = _trainable(params)
    # A model filled in place after sharding (model=hf) says what this rank read and held.
    weights = getattr(getattr(module, "model", None), "load_report", None)
    if weights is not None:
        info["weights"] = dataclasses.asdict(weights)
    return info


def _trainable(params: list[nn.Parameter]) -> dict[str, Any]:
    """What trains and what is frozen: global element counts (DTensors count whole) and the
    dtypes each is stored in (a LoRA run's adapters against its base)."""
    from fsdp_cli.parallel.nf4 import is_quantized

    trains = [p for p in params if p.requires_grad]
    frozen = [p for p in params if not p.requires_grad]
    quantized = [p for p in frozen if is_quantized(p)]
    out: dict[str, Any] = {
        "parameters": sum(p.numel() for p in trains),
        "of": sum(p.numel() for p in params),
        "dtype": sorted({_name(p.dtype) for p in trains}),
        # (a QLoRA base's weights are "nf4", read off the live tensors: proof they stayed 4-bit)
        "frozen_dtype": sorted({"nf4" if is_quantized(p) else _name(p.dtype) for p in frozen}),
    }
    if quantized:
        out["quantized"] = {
            "weights": len(quantized),
            "parameters": sum(p.numel() for p in quantized),
            "dequantized_to": sorted({_name(p.dtype) for p in quantized}),  # (what NF4 stands for)
        }
    return out


def _unit_precision(
    model: nn.Module, stored: torch.dtype, trained: torch.dtype | None = None
) -> tuple[str, str]:
    """(compute, reduce) dtypes from the FSDP units of the live model: the policy ``fully_shard``
    recorded on each FSDP2 unit, FSDP1's ``mixed_precision`` on each wrapped unit; whoever set it
    (this package's strategies, or the user's own ``configure_model``). Units that disagree are
    listed (``bfloat16/float32``); without a policy, the dtype the parameters are stored in (for the
    reduction: the dtype the trained ones are stored in, fp32 adapters over a bf16 base)."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    from fsdp_cli.compat.torch_internals import fsdp2_mp_policies

    trained = trained or stored
    compute: set[str] = set()
    reduce: set[str] = set()
    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            policies = fsdp2_mp_policies(unit)
        elif isinstance(unit, FullyShardedDataParallel):
            policies = [unit.mixed_precision]
        else:
            continue
        for policy in policies:
            param = policy.param_dtype or stored
            compute.add(_name(param))
            reduce.add(_name(policy.reduce_dtype or policy.param_dtype or trained))
    return "/".join(sorted(compute)) or _name(stored), "/".join(sorted(reduce)) or _name(trained)


def _compiled_modules(module: nn.Module) -> int:
    from fsdp_cli.compat.torch_internals import is_compiled_in_place

    return sum(is_compiled_in_place(m) for m in module.modules())


def _param_devices(params: list[nn.Parameter]) -> list[str]:
    """Where the parameters (each rank's shards) live: ``cpu`` under CPU offload on a GPU."""
    return sorted({(p.to_local() if hasattr(p, "to_local") else p).device.type for p in params})


def _autocast_dtype(trainer: L.Trainer) -> torch.dtype | None:
    plugin = trainer.precision_plugin
    if type(plugin).__name__ == "MixedPrecision":
        return torch.bfloat16 if plugin.precision == "bf16-mixed" else torch.float16
    return None


def _optimizer_state_dtypes(trainer: L.Trainer) -> set[str | None]:
    # Adam's moments are created on the first step, in the dtype of the parameters they follow.
    out: set[str | None] = set()
    for optimizer in trainer.optimizers:
        for state in optimizer.state.values():
            out.update(_name(v.dtype) for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return out


def _mesh(strategy: Any) -> dict[str, int]:
    sizes = getattr(strategy, "mesh_sizes", None)
    return sizes() if callable(sizes) else {"data_parallel": int(strategy.world_size)}


def _fsdp_units(strategy: Any) -> list[str]:
    """Walks the wrapped model: for strategies that wrap without a parallelize report (FSDP1,
    a user's parallelize_fn or configure_model)."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    target = strategy.parallelize_target() if hasattr(strategy, "parallelize_target") else strategy.model
    if target is None:
        return []
    return [
        canonical_name(name) or "<root>"
        for name, m in target.named_modules()
        if isinstance(m, (FSDPModule, FullyShardedDataParallel))
    ]


def _ac_blocks(module: nn.Module) -> int:
    from fsdp_cli.compat.torch_internals import CheckpointWrapper

    return sum(isinstance(m, CheckpointWrapper) for m in module.modules())


def format_setup(info: dict[str, Any]) -> str:
    mesh = " x ".join(f"{k}={v}" for k, v in info["mesh"].items())
    units = info["fsdp_units"]
    kinds = Counter(u.rsplit(".", 1)[0] if "." in u else u for u in units)
    unit_text = (
        ", ".join(f"{n} x {k}" if n > 1 else k for k, n in kinds.items()) if units else "none (not sharded)"
    )
    d = info["dtypes"]
    lines = [
        f"mesh: {mesh}",
        f"fsdp units: {len(units)} ({unit_text})",
        f"activation checkpointing: {info['activation_checkpointing']} blocks",
    ]
    if info.get("tensor_parallel_modules"):
        lines.append(f"tensor parallel: {info['tensor_parallel_modules']} modules")
    if info.get("expert_parallel_modules"):
        ep = info["mesh"].get("expert_parallel", "?")
        lines.append(
            f"expert parallel: {info['expert_parallel_modules']} MoE layers, experts split over ep={ep} "
            "(tokens routed all-to-all)"
        )
    if info.get("compiled_blocks"):
        lines.append(f"torch.compile: {info['compiled_blocks']} blocks")
    if info.get("float8_linears"):
        emulated = "; matmuls emulated on CPU" if info.get("float8_emulated") else ""
        lines.append(f"float8: {info['float8_linears']} linear layers (torchao, float8 all-gather{emulated})")
    weights = info.get("weights")
    if weights is not None and weights["pretrained"]:
        lines.append(
            f"weights: {weights['bytes_read'] / 2**20:,.1f} MiB read by this rank from {weights['files']} file(s) "
            f"in {weights['seconds']:.2f} s; largest tensor held whole {weights['max_full_tensor_bytes'] / 2**20:,.2f} MiB"
        )
    t = info.get("trainable")
    if t:
        share = 100 * t["parameters"] / max(1, t["of"])
        lines.append(
            f"trainable: {t['parameters']:,} of {t['of']:,} parameters ({share:.2f}%) | stored "
            f"{'/'.join(t['dtype'])}, frozen {'/'.join(t['frozen_dtype'])}{_quantized_words(t)}"
        )
    lines.append(
        f"dtypes: param {d['param']} | compute {d['compute']} | reduce {d['reduce']} | optimizer state {'/'.join(d['optimizer_state'])}"
    )
    return "\n".join(lines)


def _quantized_words(trainable: dict[str, Any]) -> str:
    q = trainable.get("quantized") or {}
    if not q.get("weights"):
        return ""
    return (
        f" (nf4 of {'/'.join(q['dequantized_to'])}: {q['parameters']:,} parameters in {q['weights']} weights)"
    )


def _optimizer_tensors(trainer: L.Trainer) -> list[torch.Tensor]:
    return [
        v
        for opt in trainer.optimizers
        for state in opt.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    ]


class SetupReport(L.Callback):
    """Prints :func:`describe_setup` once on rank 0 (and ``notes``: what the run promises, such
    as what a stop does) and keeps it for ``summary.json``."""

    def __init__(self, notes: tuple[str, ...] = ()) -> None:
        self.notes = notes
        self.info: dict[str, Any] | None = None
        self._grad_bytes: int | None = None
        self._recorded = False

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.info = describe_setup(trainer)
        if trainer.is_global_zero:
            print("\n".join([format_setup(self.info), *self.notes]), flush=True)

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any
    ) -> None:
        if self._grad_bytes is None:
            self._grad_bytes = storage_bytes(p.grad for p in pl_module.parameters())

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self._recorded or self._grad_bytes is None:
            return
        self._recorded = True  # after the first optimizer step: every state exists once
        mine = {
            "params": storage_bytes(pl_module.parameters()),
            "grads": self._grad_bytes,
            "optimizer": storage_bytes(_optimizer_tensors(trainer)),
        }
        everyone = [mine]
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            everyone = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(everyone, mine)
        if self.info is not None:
            self.info["held_bytes"] = everyone
