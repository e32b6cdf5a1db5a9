"""The batch sampler that makes ``data.global_batch_size`` mean the same thing on every layout.

Optimizer step ``s`` consumes dataset items ``[s * G, (s + 1) * G)``. Data-parallel rank ``r`` of
``dp`` takes the contiguous slice ``r * G / dp ...`` of it, split into micro-batches. The union
over ranks is always the same G items, so changing dp or tp never changes what is learned;
tensor-parallel ranks of one data-parallel group share a rank index and see the same batch.

With epochs (a dataset of ``epoch_size`` items, ``trainer.max_epochs``), an epoch is
``S = epoch_size // G`` whole steps: step ``s`` of epoch ``e = s // S`` takes items
``e * epoch_size + (s % S) * G ...`` (the datasets map item ``e * epoch_size + i`` to position ``i``
of epoch ``e``'s order), so each epoch visits ``S * G`` distinct items and the few left over
(``epoch_size mod G``) are not seen in that epoch. Either way a step's items depend on the step
alone: resuming at any step, mid-epoch included, continues exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from torch.utils.data import Sampler


class StepBatchSampler(Sampler[list[int]]):
    """Yields micro-batches of indices for one data-parallel rank: forever (``max_steps`` ends
    training), or one epoch per iteration when ``epoch_size`` is given.

    Arguments:
        global_batch_size: items per optimizer step across all data-parallel ranks.
        micro_batch_size: items per forward on one rank.
        dp_rank, dp_size: this rank's data-parallel coordinate.
        start_step: optimizer step to start from (resume).
        epoch_size: items in one epoch of the dataset; None = an endless stream without epochs.
        current_step: the optimizer step each iteration starts from (the trainer's global step,
            read when the iteration begins: the resumed step, or the first step of a new epoch);
            default: ``start_step``.
    """

    def __init__(
        self,
        *,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        start_step: int = 0,
        epoch_size: int | None = None,
        current_step: Callable[[], int] | None = None,
    ) -> None:
        per_rank = global_batch_size // dp_size
        if per_rank * dp_size != global_batch_size or per_rank % micro_batch_size != 0:
            raise ValueError(
                f"global_batch_size={global_batch_size} must split into dp={dp_size} x micro batches of {micro_batch_size}"
            )
        if epoch_size is not None and epoch_size < global_batch_size:
            raise ValueError(f"an epoch of {epoch_size} items holds no global batch of {global_batch_size}")
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.per_rank = per_rank
        self.dp_rank = dp_rank
        self.start_step = start_step
        self.epoch_size = epoch_size
        self.current_step = current_step

    @property
    def steps_per_epoch(self) -> int | None:
        """Optimizer steps in one epoch; None without epochs."""
        return None if self.epoch_size is None else self.epoch_size // self.global_batch_size

    def __len__(self) -> int:
        """Micro-batches of one epoch on this rank (what Lightning counts as the epoch's batches)."""
        if self.steps_per_epoch is None:
            raise TypeError("an endless stream has no length")  # Lightning: an infinite epoch
        return self.steps_per_epoch * (self.per_rank // self.micro_batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        step = self.current_step() if self.current_step is not None else self.start_step
        per_epoch = self.steps_per_epoch
        end = None if per_epoch is None else (step // per_epoch + 1) * per_epoch
        while end is None or step < end:
            first = self._first_item(step) + self.dp_rank * self.per_rank
            for offset in range(0, self.per_rank, self.micro_batch_size):
                yield list(range(first + offset, first + offset + self.micro_batch_size))
            step += 1

    def _first_item(self, step: int) -> int:
        """The index of step ``step``'s first item (over all data-parallel ranks)."""
        if self.epoch_size is None:
            return step * self.global_batch_size
        epoch, within = divmod(step, self.epoch_size // self.global_batch_size)
        return epoch * self.epoch_size + within * self.global_batch_size


def step_first_item(index: int, *, global_batch_size: int, epoch_size: int | None) -> int:
    """The first item of the global batch that item ``index`` belongs to (the inverse of
    :meth:`StepBatchSampler._first_item`): a dataset that weighs each item by its whole step
    (``data=chat``'s token-weighted loss) finds the step's other items from it."""
    if epoch_size is None:
        return index // global_batch_size * global_batch_size
    epoch, within = divmod(index, epoch_size)
    return epoch * epoch_size + within // global_batch_size * global_batch_size
