"""Context parallel: each micro-batch's sequence split over ``cp`` ranks, attention exchanged
all-to-all over heads (the DeepSpeed-Ulysses form).

Every layer but attention works token by token, so it runs on this rank's slice of the sequence
as it would on the whole. Attention needs every earlier token: before it, one all-to-all turns
``[batch, heads, seq / cp, d]`` into ``[batch, heads / cp, seq, d]`` (this rank now holds the
whole sequence for its share of the heads), ordinary attention runs (any kernel, a causal or a
document mask), and one all-to-all turns the output back. It runs wherever ``all_to_all_single``
does (gloo on CPU, NCCL on GPUs) and is exact against one process.

Three things must be global, not per slice (each is a test of tests/test_context_parallel.py):
- rotary positions: this slice's tokens sit at ``rank * seq / cp ...`` of the sequence
  (:meth:`ContextParallel.positions`), or where packing put them;
- labels: shifted against the inputs *before* the split (a slice's last input predicts the next
  slice's first token), :meth:`ContextParallel.split_batch` takes the ``[B, T + 1]`` ids whole;
- masks: the document mask of packed sequences is over the whole sequence, built from every
  slice's positions (:meth:`ContextParallel.whole_positions`).

A module takes part by declaring a class attribute ``context_parallel = None``: the strategy sets
it to this rank's :class:`ContextParallel` on every such module of the model (the built-in Llama,
its attention, the LightningModule whose steps split the batch). Its attention calls :func:`attend`.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

SEQUENCE_KEYS = ("input_ids", "labels", "position_ids")
"""The entries of a labelled batch that run along the sequence (split under context parallel)."""


@dataclass(frozen=True, eq=False)
class ContextParallel:
    """This rank's place in its context-parallel group: ``size`` ranks share each sequence,
    this one holds slice ``rank``."""

    group: Any
    """The process group of the ranks that split one sequence."""
    size: int
    rank: int
    _last: list[Any] = field(default_factory=list, repr=False)
    """(a weak reference to a tensor, what :meth:`remembered` computed from it)."""

    @classmethod
    def of_mesh(cls, mesh: Any, impl: Any = "all_to_all") -> ContextParallel:
        """From the 1-D context-parallel slice of the run's device mesh; ``impl``: a
        :class:`~fsdp_cli.parallel.options.ContextParallelImpl` (or its name)."""
        if getattr(impl, "value", impl) == "ring":
            return RingContextParallel(
                group=mesh.get_group(), size=mesh.size(), rank=mesh.get_local_rank(), mesh=mesh
            )
        return cls(group=mesh.get_group(), size=mesh.size(), rank=mesh.get_local_rank())

    # ------------------------------------------------------------------ the batch

    def split(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's contiguous slice of ``tensor`` along ``dim`` (its length divides by cp:
        checked before launch)."""
        length = tensor.shape[dim]
        if length % self.size:
            raise ValueError(f"context parallel: sequence length {length} does not divide by cp={self.size}")
        return tensor.narrow(dim, self.rank * (length // self.size), length // self.size).contiguous()

    def positions(self, rows: int, length: int, device: Any) -> torch.Tensor:
        """``[rows, length / cp]``: the global positions of this rank's slice of an unpacked sequence."""
        local = length // self.size
        start = self.rank * local
        return torch.arange(start, start + local, device=device).expand(rows, local)

    def split_batch(self, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[B, T + 1]`` token ids -> this rank's (inputs, targets, positions), each ``[B, T / cp]``:
        shifted first, then split, so the slices' targets together are the whole sequence's."""
        inputs, targets = batch[:, :-1], batch[:, 1:]
        positions = self.positions(batch.shape[0], inputs.shape[1], batch.device)
        return self.split(inputs), self.split(targets), positions

    def split_labelled(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A labelled batch (``input_ids``, ``labels`` aligned with them: shifted by the data,
        before any split; packed ``position_ids``) -> this rank's slice of each; every other entry
        (the step's counts) as it is. (Unpacked, the model takes its slice's positions from its
        own ``context_parallel``.)"""
        sliced = {key: self.split(batch[key]) for key in SEQUENCE_KEYS if key in batch}
        return {**batch, **sliced}

    def whole_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """Every slice's positions, ``[B, T]`` (no gradient: integers), for a mask over the whole sequence."""
        slices = [torch.empty_like(positions) for _ in range(self.size)]
        torch.distributed.all_gather(slices, positions.contiguous(), group=self.group)
        return torch.cat(slices, dim=1)

    def remembered(self, tensor: torch.Tensor, compute: Callable[[torch.Tensor], Any]) -> Any:
        """``compute(tensor)``, kept for the next call with the same tensor object: every attention
        layer of one forward (and its recomputation) asks for the same positions' mask."""
        if self._last and self._last[0]() is tensor:
            return self._last[1]
        value = compute(tensor)
        self._last[:] = [weakref.ref(tensor), value]
        return value

    # ------------------------------------------------------------------ attention

    def to_heads(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """Each ``[B, h, T / cp, d]`` -> ``[B, h / cp, T, d]``, all in one all-to-all: rank r then
        holds heads ``r * h / cp ...`` of every tensor, for the whole sequence."""
        rows, _, local, dim = tensors[0].shape
        parts = [t.reshape(rows, self.size, t.shape[1] // self.size, local, dim) for t in tensors]
        packed = torch.cat(parts, dim=2).transpose(0, 1).contiguous()  # [cp, B, heads/cp, T/cp, d]
        received = _all_to_all(packed, self.group)  # dim 0: the sequence slice it came from
        whole = received.permute(1, 2, 0, 3, 4).reshape(rows, -1, self.size * local, dim)
        return list(whole.split([t.shape[1] // self.size for t in tensors], dim=1))

    def to_sequence(self, out: torch.Tensor) -> torch.Tensor:
        """``[B, h / cp, T, d]`` -> ``[B, h, T / cp, d]``: :meth:`to_heads` undone."""
        rows, heads, length, dim = out.shape
        local = length // self.size
        packed = out.reshape(rows, heads, self.size, local, dim).permute(2, 0, 1, 3, 4).contiguous()
        received = _all_to_all(packed, self.group)  # dim 0: the heads it came from
        return received.transpose(0, 1).reshape(rows, self.size * heads, local, dim)


@dataclass(frozen=True, eq=False)
class RingContextParallel(ContextParallel):
    """torch's ring attention (``cp_impl=ring``, GPUs): each rank keeps its queries and passes its
    keys and values around the ring. The sequence is cut into ``2 cp`` chunks and rank r holds
    chunks r and ``2 cp - 1 - r`` (torch's head-tail load balancing: every rank then has as much
    causal work), so its positions and labels are those chunks' too; causal only (no document
    masks: packing is refused before launch)."""

    mesh: Any = None
    """The 1-D context-parallel mesh (ring attention runs on DTensors over it)."""

    def split(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Chunks ``rank`` and ``2 cp - 1 - rank`` of ``2 cp`` along ``dim``, in that order."""
        length, chunks = tensor.shape[dim], 2 * self.size
        if length % chunks:
            raise ValueError(f"ring attention: sequence length {length} does not divide by 2 x cp={chunks}")
        part = length // chunks
        head, tail = self.rank * part, (chunks - 1 - self.rank) * part
        return torch.cat([tensor.narrow(dim, head, part), tensor.narrow(dim, tail, part)], dim).contiguous()

    def positions(self, rows: int, length: int, device: Any) -> torch.Tensor:
        """``[rows, length / cp]``: the global positions of this rank's two chunks."""
        return self.split(torch.arange(length, device=device).expand(rows, length))

    def whole_positions(self, positions: torch.Tensor) -> torch.Tensor:
        raise ValueError("ring attention takes no document mask (cp_impl=ring is refused with packing)")

    def attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None
    ) -> torch.Tensor:
        """``[B, H, T / cp, d]`` slices (key/value heads as many as the queries') -> the output slice."""
        from fsdp_cli.compat.torch_internals import ring_attention

        return ring_attention(q, k, v, self.mesh, scale)


def _all_to_all(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """Equal slices of dim 0 exchanged, with its gradient exchanged back in backward."""
    from fsdp_cli.compat.torch_internals import all_to_all

    return all_to_all(tensor, group)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    cp: ContextParallel | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention of ``q [B, T, H, d]`` over ``k, v [B, T, KV, d]`` (sequence-major, as the
    projections give them; grouped-query: each key/value head serves ``H / KV`` query heads) ->
    ``[B, T, H, d]``. ``mask``: None (causal) or a boolean ``[B, 1, T, T]``, True = may attend.
    Under context parallel ``T`` is this rank's slice and ``mask`` covers the whole sequence;
    key/value heads that do not split over cp are repeated before the exchange."""
    repeat = q.shape[2] // k.shape[2]
    if cp is None or cp.size == 1:
        if repeat > 1:
            k, v = k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
        )
        return out.transpose(1, 2)
    if isinstance(cp, RingContextParallel):
        if mask is not None:
            raise ValueError("ring attention takes no document mask (cp_impl=ring is refused with packing)")
        if repeat > 1:
            k, v = k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)
        return cp.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale).transpose(1, 2)
    if k.shape[2] % cp.size:
        k, v, repeat = k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2), 1
    q, k, v = cp.to_heads(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    if repeat > 1:
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale)
    return cp.to_sequence(out).transpose(1, 2)


def install(model: nn.Module, cp: ContextParallel) -> int:
    """Give ``cp`` to every module of ``model`` that declares ``context_parallel`` and has none yet
    (the strategy installs on the LightningModule after parallelize installed on its model); how
    many did."""
    count = 0
    for module in model.modules():
        if hasattr(type(module), "context_parallel") and module.context_parallel is None:
            module.context_parallel = cp  # type: ignore[assignment]
            count += 1
    return count


def takes_context_parallel(model: nn.Module) -> bool:
    """Whether some module of ``model`` declares ``context_parallel`` (its attention can be reached)."""
    return any(hasattr(type(m), "context_parallel") for m in model.modules())
