"""fsdp-plan of pipeline-parallel layouts: each stage's parameters and the activations its
schedule holds, checked against the pp=1 plan split by hand and the model's own activation
formula; the sizes a pipeline layout must have, one line each."""

from __future__ import annotations

import functools
import json
import math
from typing import Any

import pytest
from conftest import cli_in_process, composed, run_of

from fsdp_cli.errors import ConfigError
from fsdp_cli.models.llama_shapes import llama_params
from fsdp_cli.pipeline.options import PipelineOptions
from fsdp_cli.pipeline.schedules import schedule_facts
from fsdp_cli.pipeline.sizes import pipeline_sizes
from fsdp_cli.plan.check import plan_for
from fsdp_cli.plan.model import llama_activations

GPUS = 8
MODEL = ["model=llama_124m", "strategy=fsdp2", "data.seq_len=512", "data.global_batch_size=32"]
"""12 blocks, every dimension divisible by 4: FSDP2's chunks over 4 ranks are exact quarters."""
HELD = ("params", "grads", "optimizer")


def plan_of(*overrides: str, gpus: int = GPUS) -> Any:
    plan = plan_for(run_of(composed(*MODEL, *overrides), gpus=gpus))
    assert plan is not None
    return plan


def stage_numel(params: list[Any], first: bool) -> int:
    """Elements of stage 0 (embedding + blocks 0-5) or stage 1 (blocks 6-11 + norm + head), by name."""
    in_first = [
        p.name.startswith("tok_embeddings") or p.name.split(".")[1:2] in [[str(i)] for i in range(6)]
        for p in params
    ]
    return sum(p.numel for p, f in zip(params, in_first, strict=True) if f == first)


def test_each_stage_holds_its_part_of_the_pp1_plan() -> None:
    """pp=2 x dp=4 on 8 GPUs: each stage's parameter, gradient and optimizer bytes are its share
    of the whole model sharded over the same 4 data-parallel ranks (the pp=1 plan on 4 GPUs),
    and the two stages add up to it."""
    whole = plan_of("data.micro_batch_size=8", gpus=4).ranks[0]
    plan = plan_of("pp=2", "data.micro_batch_size=8")
    assert plan.layout["pp"] == 2 and plan.layout["shard"] == 4 and len(plan.ranks) == 8
    first, last = plan.ranks[0], plan.ranks[7]
    assert (first.stages, last.stages) == ([0], [1])
    params = llama_params(composed(*MODEL).model)
    for rank, is_first in ((first, True), (last, False)):
        assert rank.params == stage_numel(params, is_first) // 4 * 4  # fp32 parameters, a quarter each
    for kind in HELD:
        assert getattr(first, kind) + getattr(last, kind) == getattr(whole, kind), kind
    assert all(plan.ranks[r].params == first.params for r in range(4))


@pytest.mark.parametrize(("schedule", "held_first", "held_last"), [("GPipe", 8, 8), ("1F1B", 2, 1)])
def test_activations_are_the_forwards_the_schedule_holds(
    schedule: str, held_first: int, held_last: int
) -> None:
    """8 sequences per rank in 8 micro-batches of one: GPipe keeps all 8 forwards on every
    stage, 1F1B two on the first stage and one on the last; each forward is that stage's blocks
    (and on the last, the head and loss) at one sequence, from the model's activation formula."""
    plan = plan_of(
        "pp=2", "data.micro_batch_size=8", "pipeline.microbatches=8", f"pipeline.schedule={schedule}"
    )
    acts = llama_activations(composed(*MODEL).model, 512, 2)  # bf16 activations on GPUs
    block = acts.blocks[0]
    assert plan.ranks[0].activations == held_first * 6 * block + block
    assert plan.ranks[7].activations == held_last * (6 * block + acts.other) + block
    assert plan.pipeline["held_forwards"] == [held_first, held_last]


def test_interleaved_holds_torchs_warmup_forwards() -> None:
    """Interleaved1F1B at pp=4, 2 stages per rank, 8 micro-batches: torch warms rank r up with
    (2 - 1) x 4 + 2 x (3 - r) forwards and holds one more in the steady 1F1B phase."""
    facts = schedule_facts("Interleaved1F1B")
    assert facts is not None
    assert [facts.held_activation_sets(4, 8, 2, r) for r in range(4)] == [11, 9, 7, 5]
    assert facts.rank_stages(4, 2, 1) == [1, 5]
    v_facts = schedule_facts("ZBVZeroBubble")
    assert v_facts is not None and v_facts.rank_stages(4, 2, 1) == [1, 6]


def test_the_plan_table_shows_each_stage() -> None:
    args = [*MODEL, "pp=2", "data.micro_batch_size=8", "--gpus", "8", "--device-memory", "80GB"]
    table = cli_in_process(args, prog="fsdp-plan")
    assert table.returncode == 0, table.stderr
    assert "stages" in table.stdout and "0-3" in table.stdout and "4-7" in table.stdout
    assert (
        "pipeline: 1F1B, 1 stage(s) per rank, 2 micro-batches of 4; blocks per stage 0-5 6-11" in table.stdout
    )
    data = json.loads(cli_in_process([*args, "--json"], prog="fsdp-plan").stdout)
    assert data["pipeline"]["bubble_fraction"] == pytest.approx(1 / 3)
    assert [r["stages"] for r in data["ranks"]] == [[0]] * 4 + [[1]] * 4


@pytest.mark.parametrize(
    ("pp", "options", "batch", "key", "words"),
    [
        (2, PipelineOptions(schedule="1F2B"), 8, "pipeline.schedule", "not a schedule torch ships"),
        (
            2,
            PipelineOptions(schedule="ZBVZeroBubble", stages_per_rank=3),
            8,
            "pipeline.stages_per_rank",
            "allowed: 2",
        ),
        (
            2,
            PipelineOptions(schedule="GPipe", stages_per_rank=2),
            8,
            "pipeline.stages_per_rank",
            "allowed: 1",
        ),
        (8, PipelineOptions(), 8, "pp", "fewer than pp x stages_per_rank"),
        (2, PipelineOptions(microbatches=3), 8, "pipeline.microbatches", "allowed: 1, 2, 4, 8"),
        (4, PipelineOptions(microbatches=2), 8, "pipeline.microbatches", "needs at least pp=4"),
        (
            2,
            PipelineOptions(schedule="DualPipeV", microbatches=2),
            8,
            "pipeline.microbatches",
            "allowed: >= 4",
        ),
    ],
)
def test_a_pipeline_layout_torch_cannot_run_is_one_line(
    pp: int, options: PipelineOptions, batch: int, key: str, words: str
) -> None:
    with pytest.raises(ConfigError) as err:
        pipeline_sizes(pp, options, n_blocks=6, batch=batch)
    line = err.value.one_line()
    assert err.value.key == key and words in line and "\n" not in line, line


def test_gpipe_takes_fewer_microbatches_than_stages() -> None:
    sizes = pipeline_sizes(4, PipelineOptions(schedule="GPipe", microbatches=2), n_blocks=8, batch=8)
    assert (sizes.microbatches, sizes.microbatch_size, sizes.held(0)) == (2, 4, 2)
    assert math.isclose(sizes.bubble, 3 / 5)


def test_pp_must_divide_the_world() -> None:
    result = cli_in_process([*MODEL, "pp=3", "--gpus", "8"], prog="fsdp-plan")
    assert result.returncode == 2
    assert (
        "pp=3: must divide the world size 8 (devices=8 x num_nodes=1); allowed: 1, 2, 4, 8" in result.stderr
    )


def test_search_considers_pp_and_says_why_it_skipped_a_layout() -> None:
    """8 GPUs, 12 blocks, a global batch of 32 in micro-batches of 1: pp=2 and pp=4 are
    planned (accumulation turned into pipeline micro-batches), pp=8 is skipped (it does not
    divide 12 blocks), each pipelined row is the plan of its own overrides."""
    from fsdp_cli.cli.plan import resolved

    common = [*MODEL, "data.micro_batch_size=1"]
    result = cli_in_process(
        [*common, "--gpus", "8", "--device-memory", "80GB", "--search", "--json"], prog="fsdp-plan"
    )
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    planned = [r for r in rows if "skipped" not in r]
    pipelined = {r["overrides"].split()[1] for r in planned if " pp=" in r["overrides"]}
    assert pipelined == {"pp=2", "pp=4"}, pipelined
    (pp8,) = [r for r in rows if r.get("skipped") and "pp=8 " in r["overrides"]]
    assert "pp=8: does not divide the model's 12 blocks" in pp8["skipped"]
    row = next(r for r in planned if "pp=4 " in r["overrides"])
    assert "data.micro_batch_size=16 pipeline.microbatches=16" in row["overrides"]  # 32 sequences / dp=2
    plan = plan_for(resolved([*common, *row["overrides"].split()], gpus=8), 80 * 10**9)
    assert (
        plan is not None and plan.peak.total == row["total_bytes"] and plan.pipeline["microbatch_size"] == 1
    )
    table = cli_in_process([*common, "--gpus", "8", "--device-memory", "80GB", "--search"], prog="fsdp-plan")
    skipped = [line for line in table.stdout.splitlines() if line.startswith("skipped: strategy=fsdp2 pp=8 ")]
    assert len(skipped) == 1 and "replicate_size=1: pp=8: does not divide the model's 12 blocks" in skipped[0]


def test_the_70b_pipeline_recipe_fits_80gb_at_512_ranks() -> None:
    """recipe=llama_70b_pp on 64 nodes x 8 GPUs of 80 GB: pp=4 x dp=16 x tp=8, every rank within
    the usable memory; rank 0 holds stages 0 and 4 (blocks 0-9 and 40-49 and the embedding),
    about 1/128 of their fp32 weights. (It fits with every second block recomputed: without,
    rank 0's activations alone need about 75 GiB under tp=8 without sequence parallel.)"""
    from fsdp_cli.cli.plan import resolved

    plan = plan_for(resolved(["recipe=llama_70b_pp"], gpus=8), 80 * 10**9)
    assert plan is not None and plan.fits and len(plan.ranks) == 512
    assert (plan.layout["pp"], plan.layout["shard"], plan.layout["tp"]) == (4, 16, 8)
    assert plan.pipeline["held_forwards"] == [11, 9, 7, 5] and plan.pipeline["microbatch_size"] == 1
    params = llama_params(composed("model=llama_70b").model)
    blocks = {str(i) for i in [*range(10), *range(40, 50)]}
    parts = [p.name.split(".") for p in params]
    numel = sum(
        p.numel
        for p, (first, index, *_) in zip(params, parts, strict=True)
        if first == "tok_embeddings" or (first == "layers" and index in blocks)
    )
    assert plan.ranks[0].stages == [0, 4]
    assert plan.ranks[0].params == pytest.approx(numel / 128 * 4, rel=0.01)
    assert plan.peak.total <= 0.95 * 80 * 10**9


def test_a_gpipe_plan_that_does_not_fit_is_told_to_hold_fewer_forwards() -> None:
    """GPipe keeps all 32 forwards of the 70B recipe (209 GiB): the hint is a 1F1B-family schedule."""
    from fsdp_cli.cli.plan import resolved
    from fsdp_cli.plan.check import hint

    run = resolved(["recipe=llama_70b_pp", "pipeline.schedule=GPipe", "pipeline.stages_per_rank=1"], gpus=8)
    plan = plan_for(run, 80 * 10**9)
    assert plan is not None and plan.fits is False
    assert hint(run, plan).startswith("pipeline.schedule=1F1B or Interleaved1F1B")


def test_a_pp_rank_is_rehearsed_at_512_ranks() -> None:
    """The last rank of the 70B pipeline recipe, built on a fake process group of 512: it holds
    the bytes its stage's plan says. Without the fake step (--no-step): its 32 micro-batches
    through two stages take minutes on fake tensors; the tiny layouts below step."""
    result = cli_in_process(
        ["recipe=llama_70b_pp", "--gpus", "8", "--rehearse", "--no-step", "--rank", "511", "--json"],
        prog="fsdp-plan",
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["rehearsal"]["world_size"] == 512 and report["rehearsal"]["disagreements"] == []
    for kind in ("params", "grads", "optimizer"):
        assert report["rehearsal"]["held_bytes"][kind] == report["ranks"][511][kind], kind


TINY_PP = ["model=tiny", "strategy=fsdp2", "pp=2", "data.global_batch_size=16", "data.seq_len=64"]
"""pp=2 x dp=2 on 4 ranks, 4 blocks; 8 sequences per rank in 4 micro-batches of 2."""


@functools.cache
def tiny_pp_rehearsal(schedule: str, rank: int) -> tuple[Any, Any]:
    """Rank ``rank`` of TINY_PP under ``schedule`` in 4 micro-batches, rehearsed with its fake
    step (once per module: two tests read the 1F1B first rank's)."""
    from fsdp_cli.cli.plan import resolved
    from fsdp_cli.plan.rehearsal import rehearse

    run = resolved([*TINY_PP, f"pipeline.schedule={schedule}", "pipeline.microbatches=4"], 4)
    return run, rehearse(run, rank, step=True)


@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B"])
@pytest.mark.parametrize("rank", [0, 3])
def test_a_pp_rank_fake_steps_through_its_schedule_and_holds_the_planned_forwards(
    schedule: str, rank: int
) -> None:
    """The first and last stage's ranks run their fake step through the PipelineDriver and
    torch's schedule on the fake process group (each stage given its shapes): the forwards the
    schedule held at once are the plan's count for that pipeline rank, nothing disagrees, and the
    measured peak holds activations."""
    from fsdp_cli.plan.rehearsal import disagreements

    run, result = tiny_pp_rehearsal(schedule, rank)
    plan = plan_for(run)
    assert plan is not None and result.step is not None
    assert "skipped" not in result.step, result.step
    assert result.step["held_forwards"] == plan.pipeline["held_forwards"][rank // 2]
    assert disagreements(result, plan) == []
    assert result.step["by_kind"]["activation"] > 0 and result.step["peak_bytes"] > 0


def test_tied_float8_stages_hold_what_the_plan_says_and_convert_what_one_process_converts() -> None:
    """A tied model at pp=2 with float8: the last stage's copy of the tied weight (the head) is in
    the plan of that stage (plan = rehearsal on both ranks), and the two stages swap the linear
    layers one process swaps, 28 of them (the first stage once kept its own last layer out, taking
    it for the head)."""
    from fsdp_cli.cli.plan import resolved
    from fsdp_cli.plan.rehearsal import disagreements, rehearse

    run = resolved(
        ["recipe=cpu_pp", "model.tie_embeddings=true", "strategy.float8=true", "precision=bf16-mixed"], 2
    )
    plan = plan_for(run)
    assert plan is not None
    converted = 0
    for rank in (0, 1):
        result = rehearse(run, rank, step=False)
        assert disagreements(result, plan) == [], rank
        converted += result.float8_linears
    assert converted == 4 * 7


def test_the_plans_held_forwards_off_by_one_is_a_disagreement(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan counting one forward too many for 1F1B's first rank: the rehearsal's fake step
    disagrees, in one line naming both counts (fsdp-plan --rehearse then exits 1)."""
    from fsdp_cli.pipeline.schedules import ScheduleFacts
    from fsdp_cli.plan.rehearsal import disagreements

    run, result = tiny_pp_rehearsal("1F1B", 0)
    counted = ScheduleFacts.held_activation_sets
    monkeypatch.setattr(ScheduleFacts, "held_activation_sets", lambda *a: counted(*a) + 1)
    plan = plan_for(run)
    assert plan is not None
    assert disagreements(result, plan) == [
        "rank 0 forwards held (pipeline rank 0, 1F1B): rehearsed 2, planned 3"
    ]


def test_a_plain_module_is_cut_by_its_block_list() -> None:
    """benchmarks.gpt.GPT (token and position embeddings, a ModuleList of blocks, a final norm
    and head) at pp=2 x dp=2: stage 0 holds the embeddings and blocks 0-1, stage 1 blocks 2-3,
    the norm and the head, each halved by FSDP2 (every dimension even)."""
    from fsdp_cli.plan.check import model_spec

    gpt = ["model=custom", "model._target_=benchmarks.gpt.GPT", "+model.dim=64", "+model.n_layers=4"]
    run = run_of(composed(*gpt, "strategy=fsdp2", "pp=2", "data.global_batch_size=8"), gpus=4)
    spec = model_spec(run)
    assert spec is not None and spec.blocks == [f"blocks.{i}" for i in range(4)]
    plan = plan_for(run)
    assert plan is not None and [r.stages for r in plan.ranks] == [[0], [0], [1], [1]]

    def numel(first: bool) -> int:
        in_first = [p.name.startswith(("tok.", "pos.", "blocks.0.", "blocks.1.")) for p in spec.params]
        return sum(p.numel for p, f in zip(spec.params, in_first, strict=True) if f == first)

    assert (plan.ranks[0].params, plan.ranks[3].params) == (numel(True) // 2 * 4, numel(False) // 2 * 4)


def torch_peaks(name: str, pp: int, microbatches: int, v: int) -> list[int]:
    """The most forwards each pipeline rank holds in torch's own order of actions for a runtime
    schedule (torch's private ``_calculate_single_rank_operations``, on a bare instance: no
    process group): a forward holds until its full backward, or under zero-bubble splitting
    until its weight gradient (the layers' inputs stay until then)."""
    from torch.distributed.pipelining.schedules import get_schedule_class

    schedule = object.__new__(get_schedule_class(name))
    schedule.pp_group_size, schedule.n_local_stages, schedule._n_microbatches = pp, v, microbatches
    schedule.num_stages = schedule._num_stages = pp * v
    schedule.number_of_rounds = max(1, microbatches // pp)
    schedule.microbatches_per_round = microbatches // schedule.number_of_rounds
    peaks = []
    for rank in range(pp):
        schedule.rank, held, peak = rank, 0, 0
        for action in filter(None, schedule._calculate_single_rank_operations(rank)):
            kind = action.computation_type.name
            held += kind == "FORWARD"
            held -= kind in ("FULL_BACKWARD", "BACKWARD_WEIGHT")
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


@pytest.mark.parametrize("name", ["Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"])
@pytest.mark.parametrize(
    ("pp", "microbatches", "v"), [(2, 4, 2), (4, 8, 2), (4, 16, 2), (4, 12, 3), (3, 6, 2)]
)
def test_held_forwards_are_those_of_torchs_own_schedule(
    name: str, pp: int, microbatches: int, v: int
) -> None:
    """Exact for the interleaved schedules, an upper bound reached at the peak rank for the V ones."""
    facts = schedule_facts(name)
    assert facts is not None
    if facts.v_shape and v != 2:
        pytest.skip("V schedules hold exactly two stages per rank")
    ours = [facts.held_activation_sets(pp, microbatches, v, r) for r in range(pp)]
    torch_held = torch_peaks(name, pp, microbatches, v)
    if facts.v_shape:
        assert all(a >= b for a, b in zip(ours, torch_held, strict=True)) and max(ours) == max(torch_held)
    else:
        assert ours == torch_held


def test_a_zero_bubble_schedule_says_why_it_has_no_fake_step() -> None:
    """ZBVZeroBubble splits backward into input and weight passes, which torch's memory tracker
    cannot follow: the fake step is skipped with that one line, the held bytes still rehearsed."""
    from fsdp_cli.cli.plan import resolved
    from fsdp_cli.plan.rehearsal import disagreements, rehearse

    overrides = [
        "pipeline.schedule=ZBVZeroBubble",
        "pipeline.microbatches=4",
        "strategy.reshard_after_forward=false",
    ]
    run = resolved([*TINY_PP, *overrides], 4)
    result = rehearse(run, 0, step=True)
    assert result.step == {
        "skipped": "pipeline.schedule=ZBVZeroBubble: torch's memory tracker cannot follow a backward split "
        "into input and weight passes: no fake step"
    }
    plan = plan_for(run)
    assert plan is not None and disagreements(result, plan) == []


def test_a_pp_fake_step_extended_from_2_and_3_blocks_per_stage_equals_the_whole_stage(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """8 blocks at pp=2 (4 per stage): the fake step measured with 2 and 3 blocks per stage and
    extended to 4 equals the step of the whole stages, phase by phase (equal to the byte here)."""
    from fsdp_cli.cli.plan import resolved
    from fsdp_cli.plan import fake_step
    from fsdp_cli.plan.rehearsal import rehearse

    run = resolved([*TINY_PP, "model.n_layers=8", "pipeline.microbatches=4"], 4)
    extended = rehearse(run, 0, step=True).step
    monkeypatch.setattr(fake_step, "PIPELINE_STABLE_DEPTH", 100)  # measure all 4 blocks per stage
    whole = rehearse(run, 0, step=True).step
    assert extended is not None and whole is not None
    assert (extended["measured_blocks"], whole["measured_blocks"]) == ([2, 3], [4])
    for phase in fake_step.PHASES:
        assert extended["phases"][phase] == pytest.approx(whole["phases"][phase], rel=0.01), phase
    assert extended["held_forwards"] == whole["held_forwards"] == 2
