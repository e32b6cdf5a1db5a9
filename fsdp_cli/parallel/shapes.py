"""Parameter shapes and how a layout splits them, without torch.

A :class:`ParamShape` is one parameter as the model declares it, and the dimension tensor
parallel splits (if any). The helpers say which slice of it a rank holds under torch's chunking
rule (``torch.chunk``: equal chunks of ``ceil(n / parts)``, the last ones shorter or empty), which
both tensor parallel and FSDP2 use. The memory plan (:mod:`fsdp_cli.plan`) builds on these.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ParamShape:
    name: str
    """As ``named_parameters()`` of the model names it (shared parameters once)."""
    shape: tuple[int, ...]
    tp_dim: int | None = None
    """The dimension tensor parallel shards (None: replicated on tensor-parallel ranks)."""
    trainable: bool = True
    """Gets a gradient and optimizer state (False: frozen, e.g. a LoRA run's base weights)."""
    expert: bool = False
    """A mixture of experts' fused experts (``[experts, ...]``): split over the ep ranks by dim 0."""
    quantized: bool = False
    """Held in 4-bit NormalFloat (a QLoRA base weight, :mod:`fsdp_cli.parallel.nf4`)."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def module(self) -> str:
        return self.name.rpartition(".")[0]


def chunk_sizes(n: int, parts: int) -> list[int]:
    """Sizes of ``torch.chunk`` of a length-``n`` dimension into ``parts``, padded with empty chunks."""
    size = math.ceil(n / parts) if n else 0
    return [max(0, min(size, n - i * size)) for i in range(parts)]


def expert_rows(shape: tuple[int, ...], ep: int, shard: int) -> tuple[int, int, list[int]]:
    """A fused experts tensor under expert parallel: (the dimension FSDP2 shards, elements per row
    of it, each expert-shard rank's rows of it). ``shard``: the data-parallel shard ranks, ep of
    them splitting the experts (:func:`fsdp_cli.parallel.fsdp2.expert_shard_dim` decides)."""
    from fsdp_cli.parallel.fsdp2 import expert_shard_dim

    local = (shape[0] // ep, *shape[1:])
    ranks = shard // ep
    dim = expert_shard_dim(local[0], ranks)
    rest = math.prod(local) // local[dim] if local[dim] else 0
    return dim, rest, chunk_sizes(local[dim], ranks)


def tp_local_shape(param: ParamShape, tp: int, tp_rank: int) -> tuple[int, ...]:
    """The shape tensor-parallel rank ``tp_rank`` holds."""
    if tp == 1 or param.tp_dim is None:
        return param.shape
    shape = list(param.shape)
    shape[param.tp_dim] = chunk_sizes(shape[param.tp_dim], tp)[tp_rank]
    return tuple(shape)
