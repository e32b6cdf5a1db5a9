"""What each schedule torch ships asks of a layout and holds in memory (torch-free).

The facts a parent needs before launch: how many stages a rank holds, whether the stages are
placed in a V, and how many micro-batches' activations a stage keeps at its peak.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ScheduleFacts:
    name: str
    """torch's spelling (``torch.distributed.pipelining.schedules.get_schedule_class``)."""
    multi_stage: bool
    """Holds several stages per rank (a ``PipelineScheduleMulti``)."""
    v_shape: bool = False
    """Exactly two stages per rank, placed in a V (rank r holds stages r and 2pp-1-r)."""
    zero_bubble: bool = False
    """Splits backward into input and weight gradients (FSDP2 must not reshard after forward)."""
    holds_all_microbatches: bool = False
    """Keeps every micro-batch's activations until backward (GPipe, LoopedBFS)."""

    def default_stages_per_rank(self) -> int:
        return 2 if self.multi_stage else 1

    def held_microbatches(self, pp: int, microbatches: int, stages_per_rank: int) -> int:
        """Micro-batches whose activations one stage holds at its peak: all of them for the
        fill-drain schedules, at most the pipeline's depth for the 1F1B family."""
        if self.holds_all_microbatches:
            return microbatches
        return min(microbatches, pp * stages_per_rank)

    def bubble_fraction(self, pp: int, microbatches: int, stages_per_rank: int) -> float:
        """The idle share of a step in theory: (pp - 1) / (m·v + pp - 1) for v stages per rank
        (zero-bubble schedules fill most of it; this is their upper bound)."""
        return (pp - 1) / (microbatches * stages_per_rank + pp - 1)


SCHEDULES: dict[str, ScheduleFacts] = {
    facts.name.lower(): facts
    for facts in (
        ScheduleFacts("GPipe", multi_stage=False, holds_all_microbatches=True),
        ScheduleFacts("1F1B", multi_stage=False),
        ScheduleFacts("Interleaved1F1B", multi_stage=True),
        ScheduleFacts("LoopedBFS", multi_stage=True, holds_all_microbatches=True),
        ScheduleFacts("InterleavedZeroBubble", multi_stage=True, zero_bubble=True),
        ScheduleFacts("ZBVZeroBubble", multi_stage=True, v_shape=True, zero_bubble=True),
        ScheduleFacts("DualPipeV", multi_stage=True, v_shape=True, zero_bubble=True),
    )
}
"""Keyed by the lower-cased name, as torch matches names."""


def schedule_facts(name: str) -> ScheduleFacts | None:
    return SCHEDULES.get(name.lower())
