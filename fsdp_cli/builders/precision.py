"""Precision: the Lightning precision plugin and the FSDP mixed-precision policies, from the
dtypes in effect (:mod:`fsdp_cli.precision`, resolved once per run).

Under FSDP2 the ``precision`` group is realised by ``fully_shard``'s MixedPrecisionPolicy (the
all-gather casts parameters to the compute dtype) rather than by autocast: the plugin then only
names the precision and does no casting of its own.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.plugins.precision import FSDPPrecision, HalfPrecision, Precision
from torch import nn

from fsdp_cli.adapters.dtype import convert_all_but_trainable_leaves
from fsdp_cli.precision import ResolvedPrecision


def torch_dtype(name: str | None) -> torch.dtype | None:
    """``"bfloat16"`` -> ``torch.bfloat16`` (None stays None)."""
    return None if name is None else getattr(torch, name)


def fsdp2_mp_policy(precision: ResolvedPrecision) -> Any:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = precision.policy
    return MixedPrecisionPolicy(
        param_dtype=torch_dtype(policy.param),
        reduce_dtype=torch_dtype(policy.reduce),
        output_dtype=torch_dtype(policy.output),
        cast_forward_inputs=policy.cast_forward_inputs,
    )


class ShardedMixedPrecision(Precision):
    """Names a ``*-mixed`` precision whose casting FSDP's policy performs (no autocast here)."""

    def __init__(self, precision: str) -> None:
        super().__init__()
        self.precision = precision  # type: ignore[assignment]


class _KeepsTrainableLeaves:
    """A ``*-true`` plugin whose conversion leaves the fp32 adapters as they are."""

    _desired_input_dtype: torch.dtype

    def convert_module(self, module: nn.Module) -> nn.Module:
        return convert_all_but_trainable_leaves(module, self._desired_input_dtype)


class AdapterHalfPrecision(_KeepsTrainableLeaves, HalfPrecision):
    """``bf16-true`` / ``16-true`` over a 16-bit base with fp32 adapters (fsdp2, ddp)."""


class AdapterFSDPPrecision(_KeepsTrainableLeaves, FSDPPrecision):
    """The same for FSDP1 (Lightning's FSDPStrategy takes FSDPPrecision plugins only)."""

    @property
    def mixed_precision_config(self) -> Any:
        """None: each flat parameter computes and reduces in the dtype it is stored in (the base's
        units bf16, the adapters' own units fp32). Lightning's bf16-true policy would cast the
        adapters to bf16 for compute and reduce their gradients in bf16."""
        return None


def precision_plugin(
    precision: ResolvedPrecision, *, policy_casts: bool, fp32_adapters: bool = False, fsdp1: bool = False
) -> Precision | None:
    """The plugin to hand the Trainer when the strategy's FSDP policy does the casting of a
    ``*-mixed`` precision, or when fp32 adapters must survive a ``*-true`` conversion to 16 bits;
    None lets Lightning choose from the name."""
    if policy_casts and precision.spec.mixed:
        return ShardedMixedPrecision(precision.name)
    if fp32_adapters and precision.spec.fixes_param_dtype and precision.param != "float64":
        return (AdapterFSDPPrecision if fsdp1 else AdapterHalfPrecision)(precision.name)
    return None
