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
    interleaved_warmup: int = 0
    """For the interleaved runtime schedules: the forwards each hop from the last rank adds to
    the warm-up (torch's ``_get_warmup_ops`` multiply factor; 0: not such a schedule)."""
    microbatch_per_stage: bool = False
    """Needs at least one micro-batch per stage, pp x stages_per_rank (DualPipeV)."""
    last_rank_extra: int = 0
    """Forwards the last pipeline rank holds beyond 2pp (DualPipeV's overlapped forward)."""

    def default_stages_per_rank(self) -> int:
        return 2 if self.multi_stage else 1

    def held_microbatches(self, pp: int, microbatches: int, stages_per_rank: int) -> int:
        """Micro-batches whose activations one stage holds at its peak: all of them for the
        fill-drain schedules, at most the pipeline's depth for the 1F1B family."""
        if self.holds_all_microbatches:
            return microbatches
        return min(microbatches, pp * stages_per_rank)

    def rank_stages(self, pp: int, stages_per_rank: int, pp_rank: int) -> list[int]:
        """The stages pipeline rank ``pp_rank`` holds: looped (r, r + pp, ...), or a V
        (r and 2pp - 1 - r) for the V-shaped schedules, as torch places them."""
        if self.v_shape:
            return [pp_rank, 2 * pp - 1 - pp_rank]
        return [pp_rank + k * pp for k in range(stages_per_rank)]

    def held_activation_sets(self, pp: int, microbatches: int, stages_per_rank: int, pp_rank: int) -> int:
        """Forwards (one micro-batch through one stage) whose activations pipeline rank
        ``pp_rank`` keeps at its peak, as torch's schedules order them (a test replays torch's
        own orders): every forward for the fill-drain schedules; the warm-up forwards for 1F1B
        (pp - r), plus the one in flight for the interleaved ones; for the zero-bubble ones a
        forward counts until its weight gradient (the layers' inputs stay until then), which
        makes every rank hold what the first holds; the V-shaped ones at most 2pp."""
        every = microbatches * stages_per_rank
        if self.holds_all_microbatches:
            return every
        if not self.multi_stage:
            return min(microbatches, pp - pp_rank)
        if self.interleaved_warmup:
            per_round = microbatches // max(1, microbatches // pp)
            hops = pp - 1 if self.zero_bubble else pp - 1 - pp_rank
            warmup = (stages_per_rank - 1) * per_round + self.interleaved_warmup * hops
            return min(warmup + 1, every)
        return min(2 * pp + (self.last_rank_extra if pp_rank == pp - 1 else 0), every)

    def bubble_fraction(self, pp: int, microbatches: int, stages_per_rank: int) -> float:
        """The idle share of a step in theory: (pp - 1) / (m·v + pp - 1) for v stages per rank
        (zero-bubble schedules fill most of it; this is their upper bound)."""
        return (pp - 1) / (microbatches * stages_per_rank + pp - 1)


SCHEDULES: dict[str, ScheduleFacts] = {
    facts.name.lower(): facts
    for facts in (
        ScheduleFacts("GPipe", multi_stage=False, holds_all_microbatches=True),
        ScheduleFacts("1F1B", multi_stage=False),
        ScheduleFacts("Interleaved1F1B", multi_stage=True, interleaved_warmup=2),
        ScheduleFacts("LoopedBFS", multi_stage=True, holds_all_microbatches=True),
        ScheduleFacts("InterleavedZeroBubble", multi_stage=True, zero_bubble=True, interleaved_warmup=1),
        ScheduleFacts("ZBVZeroBubble", multi_stage=True, v_shape=True, zero_bubble=True),
        ScheduleFacts(
            "DualPipeV",
            multi_stage=True,
            v_shape=True,
            zero_bubble=True,
            microbatch_per_stage=True,
            last_rank_extra=1,
        ),
    )
}
"""Keyed by the lower-cased name, as torch matches names."""


def schedule_facts(name: str) -> ScheduleFacts | None:
    return SCHEDULES.get(name.lower())
