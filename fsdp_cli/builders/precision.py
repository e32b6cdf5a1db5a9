"""Precision: the Lightning precision plugin and the FSDP mixed-precision policies, from the
dtypes in effect (:mod:`fsdp_cli.precision`, resolved once per run).

Under FSDP2 the ``precision`` group is realised by ``fully_shard``'s MixedPrecisionPolicy (the
all-gather casts parameters to the compute dtype) rather than by autocast: the plugin then only
names the precision and does no casting of its own.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.plugins.precision import Precision

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


def precision_plugin(precision: ResolvedPrecision, *, policy_casts: bool) -> Precision | None:
    """The plugin to hand the Trainer when the strategy's FSDP policy does the casting of a
    ``*-mixed`` precision; None lets Lightning choose from the name."""
    if policy_casts and precision.spec.mixed:
        return ShardedMixedPrecision(precision.name)
    return None
