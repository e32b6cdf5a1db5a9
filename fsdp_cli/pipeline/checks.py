"""A pipeline layout checked before launch (torch-free): each problem one ConfigError naming the
key, the value, what is allowed and a hint. The caller (fsdp_cli.config.validate) passes plain
numbers: the strategy's name, the model's block count (None: known only once it is built), the
batch one forward sees on a rank."""

from __future__ import annotations

from fsdp_cli.errors import ConfigError
from fsdp_cli.pipeline.cuts import cut_problem
from fsdp_cli.pipeline.options import CutPolicy, PipelineOptions
from fsdp_cli.pipeline.schedules import SCHEDULES, ScheduleFacts, schedule_facts

PIPELINE_STRATEGIES = ("fsdp2",)
"""Strategies that drive a schedule: FSDP2Strategy (its stages are FSDP2 roots)."""


def check_pipeline(
    pp: int, options: PipelineOptions, *, strategy: str, n_blocks: int | None, forward_batch: int
) -> None:
    """Every pre-launch check of ``pp`` and ``pipeline.*``, in order."""
    if pp == 1:
        return
    if strategy not in PIPELINE_STRATEGIES:
        raise ConfigError(
            "pp",
            pp,
            f"strategy={strategy} has no pipeline schedule (the stages are FSDP2 modules driven by torch's schedules)",
            allowed="pp=1 with this strategy; pp > 1 with strategy=fsdp2",
            hint="strategy=fsdp2",
        )
    check_cuts_policy(options)
    facts = schedule_of(options.schedule)
    per_rank = stages_per_rank_of(options, facts)
    n_stages = pp * per_rank
    if n_blocks is not None:
        check_cut(pp, options, n_blocks, n_stages)
    check_microbatches(pp, options, facts, n_stages, forward_batch)


def check_cuts_policy(options: PipelineOptions) -> None:
    """``pipeline.cuts`` is read only with ``pipeline.cut=explicit``: given with another policy it
    would be ignored without a word."""
    if options.cuts and options.cut is not CutPolicy.explicit:
        raise ConfigError(
            "pipeline.cuts",
            list(options.cuts),
            f"ignored by pipeline.cut={options.cut.value}, which places the cuts itself",
            allowed="[] unless pipeline.cut=explicit",
            hint="pipeline.cut=explicit to cut at these blocks, or drop pipeline.cuts",
        )


def check_cut(pp: int, options: PipelineOptions, n_blocks: int, n_stages: int) -> None:
    """The blocks go round the stages: at least one each, at the explicit cut points if given."""
    problem = cut_problem(n_blocks, n_stages, options.cut, options.cuts)
    if problem is not None:
        key, value = ("pipeline.cuts", options.cuts) if "cut" in problem else ("pp", pp)
        raise ConfigError(key, value, problem, hint="fewer stages or a deeper model")


def schedule_of(name: str) -> ScheduleFacts:
    """The facts of the schedule torch ships under ``name``; ConfigError for one it does not."""
    facts = schedule_facts(name)
    if facts is None:
        raise ConfigError(
            "pipeline.schedule",
            name,
            "not a schedule torch ships",
            allowed=", ".join(f.name for f in SCHEDULES.values()),
            hint="1F1B (the default) or Interleaved1F1B",
        )
    return facts


def stages_per_rank_of(options: PipelineOptions, facts: ScheduleFacts) -> int:
    """Stages each rank holds: the option, or the schedule's own; ConfigError where it cannot."""
    per_rank = options.stages_per_rank or facts.default_stages_per_rank()
    if facts.v_shape and per_rank != 2:
        allowed = "2"
    elif not facts.multi_stage and per_rank != 1:
        allowed = "1"
    else:
        return per_rank
    raise ConfigError(
        "pipeline.stages_per_rank",
        per_rank,
        f"{facts.name} holds {allowed} stage(s) per rank",
        allowed=allowed,
        hint="leave pipeline.stages_per_rank=null for the schedule's own, or pick an interleaved schedule",
    )


def check_microbatches(
    pp: int, options: PipelineOptions, facts: ScheduleFacts, n_stages: int, batch: int
) -> None:
    """Micro-batches divide a rank's batch, fill the pipeline, and (DualPipeV) give every stage one."""
    micro = options.microbatches or n_stages
    if batch % micro != 0:
        divisors = [d for d in range(1, batch + 1) if batch % d == 0]
        raise ConfigError(
            "pipeline.microbatches",
            micro,
            f"must divide the batch of one forward on a rank ({batch} sequences)",
            allowed=", ".join(map(str, divisors)),
            hint="change pipeline.microbatches, or data.micro_batch_size / data.global_batch_size",
        )
    if facts.microbatch_per_stage and micro < n_stages:
        raise ConfigError(
            "pipeline.microbatches",
            micro,
            f"{facts.name} needs a micro-batch per stage: at least pp x stages_per_rank = {n_stages}",
            allowed=f">= {n_stages}",
            hint=f"pipeline.microbatches={n_stages}",
        )
    if not facts.holds_all_microbatches and micro < pp:
        raise ConfigError(
            "pipeline.microbatches",
            micro,
            f"{facts.name} needs at least pp={pp} micro-batches to fill the pipeline",
            allowed=f"{pp} or more",
            hint=f"pipeline.microbatches={pp}, or schedule GPipe",
        )
