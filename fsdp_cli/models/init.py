"""Layout-independent weight initialisation.

A parameter's initial values depend only on (seed, parameter name, row): each block of rows is
drawn from its own generator. A rank that holds a shard (FSDP, tensor parallel, or both) draws
just the rows it owns and slices its columns, so a model created on the meta device and
initialised after sharding equals, bit for bit, the same model initialised whole on one
process. That makes ``tensor_init_context`` (empty init for models too large for one rank)
safe and keeps every layout's starting point identical.
"""

from __future__ import annotations

import math
import zlib

import torch
from torch import nn

from fsdp_cli.parallel.names import canonical_name

ROWS_PER_BLOCK = 256


@torch.no_grad()
def seeded_normal_(param: torch.Tensor, *, std: float, seed: int, name: str) -> None:
    """Fill ``param`` (a plain tensor or a DTensor shard) with N(0, std^2), layout-independently."""
    from fsdp_cli.parallel.nf4 import is_quantized, write_full

    if is_quantized(param):  # QLoRA's NF4 base: quantized whole (the same rows drawn), this rank's kept
        full = torch.empty(tuple(param.shape), dtype=torch.float32)
        seeded_normal_(full, std=std, seed=seed, name=name)
        write_full(param, full)
        return
    local, (row0, col0) = _local_view(param)
    if local.numel() == 0:
        return
    # Shapes only: indexing a DTensor would all-gather it.
    full_rows, full_cols = param.shape[0], math.prod(param.shape[1:])
    rows, cols = local.shape[0], math.prod(local.shape[1:])
    # Drawn on the host whatever the default device: Lightning builds a model under its rank's
    # device (cuda:N for DDP), where a host generator cannot draw; the copy below moves the values.
    out = torch.empty(rows, cols, dtype=torch.float32, device="cpu")
    first_block = row0 // ROWS_PER_BLOCK
    last_block = (row0 + rows - 1) // ROWS_PER_BLOCK
    key = zlib.crc32(canonical_name(name).encode())
    for block in range(first_block, last_block + 1):
        start = block * ROWS_PER_BLOCK
        stop = min(start + ROWS_PER_BLOCK, full_rows)
        gen = torch.Generator().manual_seed((seed * 1_000_003 + key * 7_919 + block) % (2**63))
        # Drawn in fp32 whatever the default dtype (64-true and bf16-true set it while the model is
        # built): every precision starts from the same weights, rounded to its dtype.
        values = torch.randn(stop - start, full_cols, generator=gen, dtype=torch.float32, device="cpu") * std
        lo, hi = max(start, row0), min(stop, row0 + rows)
        out[lo - row0 : hi - row0] = values[lo - start : hi - start, col0 : col0 + cols]
    local.copy_(out.view(local.shape).to(local.dtype))


@torch.no_grad()
def seeded_normal_whole_(param: torch.Tensor, *, std: float, seed: int, name: str) -> None:
    """Fill ``param`` with N(0, std^2) drawn whole from a generator seeded by (seed, name), keeping
    this rank's part: for tensors :func:`seeded_normal_` cannot draw by rows (a mixture of
    experts' fused experts, split over ep and sharded by FSDP2 along either of two dimensions). One
    full tensor at a time is drawn on the host."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    key = zlib.crc32(canonical_name(name).encode())
    gen = torch.Generator().manual_seed((seed * 1_000_003 + key * 7_919) % (2**63))
    full = torch.randn(tuple(param.shape), generator=gen, dtype=torch.float32, device="cpu") * std
    target = param.data if isinstance(param, nn.Parameter) else param
    if isinstance(target, DTensor):
        full = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None).to_local()
        target = target.to_local()
    target.copy_(full.to(target.dtype))


def _local_view(param: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
    """The local tensor of ``param`` and the (row, column) offset of its first element in the full tensor."""
    from torch.distributed.tensor import DTensor

    from fsdp_cli.compat.torch_internals import global_offset

    if isinstance(param, nn.Parameter):
        param = param.data
    if not isinstance(param, DTensor):
        return param, (0, 0)
    offset = global_offset(param)
    local = param.to_local()
    if param.dim() > 2:
        raise ValueError("seeded_normal_ supports 1-D and 2-D parameters")
    col0 = offset[1] if param.dim() == 2 else 0
    return local, (offset[0], col0)
