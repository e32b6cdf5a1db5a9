"""The batch sampler that makes ``data.global_batch_size`` mean the same thing on every layout.

Optimizer step ``s`` consumes dataset items ``[s * G, (s + 1) * G)``. Data-parallel rank ``r`` of
``dp`` takes the contiguous slice ``r * G / dp ...`` of it, split into micro-batches. The union
over ranks is always the same G items, so changing dp or tp never changes what is learned;
tensor-parallel ranks of one data-parallel group share a rank index and see the same batch.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch.utils.data import Sampler


class StepBatchSampler(Sampler[list[int]]):
    """Yields micro-batches of indices for one data-parallel rank, forever (``max_steps`` ends training).

    Arguments:
        global_batch_size: items per optimizer step across all data-parallel ranks.
        micro_batch_size: items per forward on one rank.
        dp_rank, dp_size: this rank's data-parallel coordinate.
        start_step: optimizer step to start from (resume).
    """

    def __init__(
        self,
        *,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        start_step: int = 0,
    ) -> None:
        per_rank = global_batch_size // dp_size
        if per_rank * dp_size != global_batch_size or per_rank % micro_batch_size != 0:
            raise ValueError(
                f"global_batch_size={global_batch_size} must split into dp={dp_size} x micro batches of {micro_batch_size}"
            )
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.per_rank = per_rank
        self.dp_rank = dp_rank
        self.start_step = start_step

    def __iter__(self) -> Iterator[list[int]]:
        step = self.start_step
        while True:
            first = step * self.global_batch_size + self.dp_rank * self.per_rank
            for offset in range(0, self.per_rank, self.micro_batch_size):
                yield list(range(first + offset, first + offset + self.micro_batch_size))
            step += 1
