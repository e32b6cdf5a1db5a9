"""A pipeline layout's sizes, decided once from the options (torch-free): the schedule's facts,
stages per rank, micro-batches, their size and each stage's blocks.

The plan and ``fsdp-plan --search`` read them; every impossible combination is one
:class:`~fsdp_cli.errors.ConfigError` naming the key, so a search can give it as the reason a
candidate was skipped.
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_cli.errors import ConfigError
from fsdp_cli.pipeline.cuts import cut_problem, stage_blocks
from fsdp_cli.pipeline.options import PipelineOptions
from fsdp_cli.pipeline.schedules import SCHEDULES, ScheduleFacts, schedule_facts


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
    facts = _facts(options.schedule)
    stages_per_rank = _stages_per_rank(facts, options.stages_per_rank)
    n_stages = pp * stages_per_rank
    problem = cut_problem(n_blocks, n_stages, options.cut, options.cuts)
    if problem:
        key, value = ("pipeline.cuts", options.cuts) if "cut points" in problem else ("pp", pp)
        raise ConfigError(key, value, problem, hint="a smaller pp or pipeline.stages_per_rank")
    microbatches = options.microbatches or n_stages
    _check_microbatches(facts, pp, microbatches, batch)
    if facts.microbatch_per_stage and microbatches < n_stages:
        raise ConfigError(
            "pipeline.microbatches",
            microbatches,
            f"{facts.name} needs a micro-batch per stage: at least pp x stages_per_rank = {n_stages}",
            allowed=f">= {n_stages}",
        )
    return PipelineSizes(
        pp=pp,
        facts=facts,
        stages_per_rank=stages_per_rank,
        microbatches=microbatches,
        microbatch_size=batch // microbatches,
        blocks=stage_blocks(n_blocks, n_stages, options.cut, options.cuts),
    )


def _facts(name: str) -> ScheduleFacts:
    facts = schedule_facts(name)
    if facts is None:
        raise ConfigError(
            "pipeline.schedule",
            name,
            "not a schedule torch ships",
            allowed=", ".join(f.name for f in SCHEDULES.values()),
        )
    return facts


def _stages_per_rank(facts: ScheduleFacts, given: int | None) -> int:
    """Single-stage schedules hold one stage per rank, the V-shaped ones exactly two."""
    stages = given or facts.default_stages_per_rank()
    if facts.v_shape and stages != 2:
        allowed = "2 (a V: rank r holds stages r and 2pp-1-r)"
    elif not facts.multi_stage and stages != 1:
        allowed = "1 (use Interleaved1F1B or LoopedBFS for more)"
    else:
        return stages
    raise ConfigError(
        "pipeline.stages_per_rank",
        stages,
        f"{facts.name} cannot hold {stages} stages per rank",
        allowed=allowed,
    )


def _check_microbatches(facts: ScheduleFacts, pp: int, microbatches: int, batch: int) -> None:
    """The per-rank batch splits evenly; the 1F1B family fills the pipeline (at least pp)."""
    if batch % microbatches:
        raise ConfigError(
            "pipeline.microbatches",
            microbatches,
            f"does not divide the per-rank batch of {batch} sequences",
            allowed=", ".join(str(d) for d in range(1, batch + 1) if batch % d == 0),
            hint="change data.micro_batch_size or pipeline.microbatches",
        )
    if not facts.holds_all_microbatches and microbatches < pp:
        raise ConfigError(
            "pipeline.microbatches",
            microbatches,
            f"{facts.name} needs at least pp={pp} micro-batches",
            allowed=f">= {pp}",
            hint="more micro-batches (a larger per-rank batch), or pipeline.schedule=GPipe",
        )
