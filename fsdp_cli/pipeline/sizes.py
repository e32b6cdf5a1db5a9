"""A pipeline layout's sizes, decided once from the options (torch-free): the schedule's facts,
stages per rank, micro-batches, their size and each stage's blocks.

The plan and ``fsdp-plan --search`` read them; every impossible combination is one
:class:`~fsdp_cli.errors.ConfigError` naming the key, so a search can give it as the reason a
candidate was skipped. The checks are :mod:`fsdp_cli.pipeline.checks`', the ones ``fsdp-train``
runs before launch: the plan and the run refuse the same layouts in the same words.
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_cli.pipeline.checks import check_cut, check_microbatches, schedule_of, stages_per_rank_of
from fsdp_cli.pipeline.cuts import stage_blocks
from fsdp_cli.pipeline.options import PipelineOptions
from fsdp_cli.pipeline.schedules import ScheduleFacts


@dataclass(frozen=True)
class PipelineSizes:
    pp: int
    facts: ScheduleFacts
    stages_per_rank: int
    microbatches: int
    microbatch_size: int
    """Sequences per micro-batch: the per-rank batch / micro-batches."""
    blocks: list[range]
    """Each stage's block indices, in stage order."""

    def rank_stages(self, pp_rank: int) -> list[int]:
        return self.facts.rank_stages(self.pp, self.stages_per_rank, pp_rank)

    def held(self, pp_rank: int) -> int:
        """Forwards whose activations this pipeline rank keeps at its peak."""
        return self.facts.held_activation_sets(self.pp, self.microbatches, self.stages_per_rank, pp_rank)

    @property
    def bubble(self) -> float:
        return self.facts.bubble_fraction(self.pp, self.microbatches, self.stages_per_rank)


def pipeline_sizes(pp: int, options: PipelineOptions, *, n_blocks: int, batch: int) -> PipelineSizes:
    """The sizes of ``pp`` pipeline ranks cutting ``n_blocks`` blocks, each rank's ``batch``
    sequences split into micro-batches; ConfigError for a combination torch cannot run."""
    facts = schedule_of(options.schedule)
    stages_per_rank = stages_per_rank_of(options, facts)
    n_stages = pp * stages_per_rank
    check_cut(pp, options, n_blocks, n_stages)
    microbatches = options.microbatches or n_stages
    check_microbatches(pp, options, facts, n_stages, batch)
    return PipelineSizes(
        pp=pp,
        facts=facts,
        stages_per_rank=stages_per_rank,
        microbatches=microbatches,
        microbatch_size=batch // microbatches,
        blocks=stage_blocks(n_blocks, n_stages, options.cut, options.cuts),
    )
