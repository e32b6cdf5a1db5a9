"""4-bit NormalFloat weights (torchao's ``NF4Tensor``) as FSDP2 shards them: QLoRA's frozen base.

torchao's NF4 tensor splits along its rows and has FSDP2's all-gather hooks, so ranks exchange
the 4-bit data, not the 16-bit weight, and a forward dequantizes one layer's weight at a time
into the input's dtype (:mod:`fsdp_cli.adapters.quantize` puts them in a model).

Quantization is whole-tensor: the per-block scales are double-quantized against their mean over
the *whole* weight, so a shard quantized alone would differ. Every writer of a quantized weight
(the built-in model's seeded init, the Hugging Face loader) therefore hands :func:`write_full`
the full tensor, one at a time; it quantizes that and keeps this rank's rows: every layout holds
the bits one process would.

Shapes: NF4 blocks are 64 elements, their scales are quantized in blocks of 256, so a quantized
weight needs a multiple of 64 x 256 = 16,384 elements per shard (:func:`shape_problem`, checked
before launch).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # (torch-free to import: the planner's byte counts are read on the config path)
    import torch

BLOCK = 64
"""Elements per NF4 block (one absmax scale each): QLoRA's and torchtune's value."""
SCALER_BLOCK = 256
"""Scales per block of the second (int8) quantization of the scales."""
UNIT = BLOCK * SCALER_BLOCK
"""A quantized weight (and each shard of it) holds a multiple of this many elements."""


def nf4_module() -> Any:
    """torchao's NF4 (``to_nf4``, ``NF4Tensor``): in ``torchao.quantization`` (0.18), ``torchao.dtypes`` in older releases."""
    try:
        from torchao.quantization import NF4Tensor, to_nf4
    except ImportError:  # older torchao
        from torchao.dtypes import NF4Tensor, to_nf4  # type: ignore[no-redef]
    return NF4Tensor, to_nf4


def bytes_per_element(dtype_bytes: int) -> float:
    """Memory per weight element in NF4: 4 bits, one int8 scale per block, one scale factor (the
    weight's dtype) per block of scales."""
    return 0.5 + 1 / BLOCK + dtype_bytes / UNIT


def nf4_constant_bytes(dtype_bytes: int) -> int:
    """What each NF4 weight (each rank's shard of one) holds besides its data: the 16-value code
    table and the whole tensor's scale mean, in the weight's dtype."""
    return (16 + 1) * dtype_bytes


def is_quantized(tensor: Any) -> bool:
    """Whether ``tensor`` (a parameter, a DTensor or a plain tensor) holds NF4 data."""
    from fsdp_cli.compat.torch_internals import dtensor_local_object

    local = dtensor_local_object(tensor)
    if not type(local).__module__.startswith("torchao"):  # (torchao imported only where it is used)
        return False
    NF4Tensor, _ = nf4_module()
    return isinstance(local, NF4Tensor)


def shape_problem(shape: tuple[int, ...], shards: int) -> str | None:
    """Why a weight of ``shape`` cannot be held in NF4 split over ``shards`` ranks (None if it can)."""
    numel = math.prod(shape)
    if len(shape) != 2:
        return f"a {len(shape)}-D weight (NF4 holds 2-D weights)"
    if numel % UNIT:
        return f"{numel:,} elements, not a multiple of {UNIT:,} ({BLOCK}-element blocks, scales in blocks of {SCALER_BLOCK})"
    if shape[0] % shards or (numel // shards) % UNIT:
        return f"{shape[0]} rows split over {shards} ranks do not leave each a multiple of {UNIT:,} elements"
    return None


def write_full(param: torch.Tensor, full: torch.Tensor) -> None:
    """Fill the NF4 ``param`` (plain, or this rank's rows of a DTensor) from the ``full``
    full-precision weight: ``full`` quantized whole, this rank's rows kept."""
    import torch

    with torch.no_grad():
        _write_full(param, full)


def _write_full(param: torch.Tensor, full: torch.Tensor) -> None:
    from fsdp_cli.compat.torch_internals import dtensor_local_object, local_box

    _, to_nf4 = nf4_module()
    quantized = to_nf4(full.to(param.dtype).contiguous(), BLOCK, SCALER_BLOCK)
    local = dtensor_local_object(param)  # (FSDP2's own object: its all-gather reads it)
    if local is not param:
        (rows, _), (row0, _) = local_box(param)
        if rows == 0:
            return
        quantized = quantized.split(rows)[row0 // rows]
    local.copy_(quantized)
    # (copy_ moves the data; the whole tensor's scale mean and the code table are set, not copied:
    # a tensor materialised from the meta device still has them on the meta device)
    local.scaler_mean = quantized.scaler_mean.clone()
    local.nf4 = quantized.nf4.clone()


def nf4_round_trip(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``weight`` as the run's forward saw it: quantized to NF4 from ``dtype``, dequantized."""
    _, to_nf4 = nf4_module()
    return to_nf4(weight.to(dtype).contiguous(), BLOCK, SCALER_BLOCK).get_original_weight()


def settle_constants(model: torch.nn.Module, device: Any) -> None:
    """Put the NF4 weights' two constants (the whole tensor's scale mean, the 16-value code table)
    on ``device`` where ``to_empty`` left them on the meta device: what a rehearsal, which fills no
    values, needs for its forward to run (:func:`write_full` sets them when it fills)."""
    import torch

    from fsdp_cli.compat.torch_internals import dtensor_local_object

    for param in model.parameters():
        if is_quantized(param):
            local = dtensor_local_object(param)
            if local.scaler_mean.is_meta:
                local.scaler_mean = torch.zeros((), dtype=local.scaler_mean.dtype, device=device)
                local.nf4 = torch.zeros(local.nf4.shape, dtype=local.nf4.dtype, device=device)
