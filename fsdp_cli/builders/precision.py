"""Precision: the Lightning precision plugin and the FSDP mixed-precision policies.

Under FSDP2 the ``precision`` group is realised by ``fully_shard``'s MixedPrecisionPolicy (the
all-gather casts parameters to the compute dtype) rather than by autocast: the plugin then only
names the precision and does no casting of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.plugins.precision import Precision

from fsdp_cli.config.schema import DType, MixedPrecisionPolicyConfig

DTYPES = {DType.float32: torch.float32, DType.bfloat16: torch.bfloat16, DType.float16: torch.float16}


@dataclass(frozen=True)
class MixedPrecisionDtypes:
    """The dtypes in effect: printed at start-up so a silent precision mistake is visible."""

    param: torch.dtype | None
    reduce: torch.dtype | None
    output: torch.dtype | None
    cast_forward_inputs: bool = True


def mixed_precision_dtypes(precision: str, explicit: MixedPrecisionPolicyConfig) -> MixedPrecisionDtypes:
    """bf16-mixed -> bf16 compute with fp32 gradient reduction; 16-mixed -> fp16/fp32; otherwise none.

    Explicit ``mp_policy`` fields win over what the precision implies.
    """
    implied: dict[str, torch.dtype | None] = {"param": None, "reduce": None, "output": None}
    if precision == "bf16-mixed":
        implied = {"param": torch.bfloat16, "reduce": torch.float32, "output": None}
    elif precision == "16-mixed":
        implied = {"param": torch.float16, "reduce": torch.float32, "output": None}
    pick = lambda value, key: DTYPES[value] if value is not None else implied[key]  # noqa: E731
    return MixedPrecisionDtypes(
        param=pick(explicit.param_dtype, "param"),
        reduce=pick(explicit.reduce_dtype, "reduce"),
        output=pick(explicit.output_dtype, "output"),
        cast_forward_inputs=explicit.cast_forward_inputs,
    )


def fsdp2_mp_policy(dtypes: MixedPrecisionDtypes) -> Any:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(
        param_dtype=dtypes.param,
        reduce_dtype=dtypes.reduce,
        output_dtype=dtypes.output,
        cast_forward_inputs=dtypes.cast_forward_inputs,
    )


class ShardedMixedPrecision(Precision):
    """Names a ``*-mixed`` precision whose casting FSDP's policy performs (no autocast here)."""

    def __init__(self, precision: str) -> None:
        super().__init__()
        self.precision = precision  # type: ignore[assignment]


def fsdp2_precision_plugin(precision: str) -> Precision | None:
    """The plugin to hand the Trainer for FSDP2; None lets Lightning choose from the name."""
    if precision in ("bf16-mixed", "16-mixed"):
        return ShardedMixedPrecision(precision)
    return None
