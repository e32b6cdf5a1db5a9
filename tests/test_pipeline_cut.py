"""A plain module cut into pipeline stages by its block list (issue 29): its forward is traced on
the meta device before launch and in the rank, and one that is not the chain the stages run is
refused in one line, the same words in both places."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import assert_ok, cli_in_process, composed, grad_norms, losses, relative_gap, run_cli, run_of

from benchmarks.gpt import GPT
from fsdp_cli.errors import ConfigError
from fsdp_cli.pipeline.cut_check import check_sequential_cut, token_example
from fsdp_cli.pipeline.options import CutPolicy, PipelineOptions
from fsdp_cli.pipeline.stages import split_of
from tests.assets import cut_modules as cut
from tests.assets.custom_models import TinyLM, TinyLMWithOutput

REFUSED = [
    (cut.SkipsABlock, "blocks.1 never runs in forward"),
    (cut.OutOfOrder, "blocks.3 runs where the cut runs blocks.0 (out of order)"),
    (cut.RunsABlockTwice, "blocks.0 runs 2 times in one forward"),
    (cut.OneBlockTwice, "blocks.0 and blocks.2 are one module"),
    (cut.TiedHead, "head.weight is embed.weight (tied weights)"),
    # Work between the parts that a whole-forward trace cannot cut either: its reason follows.
    (cut.LongResidual, "traced whole by torch.distributed.pipelining: blocks.2 would receive 2 tensors"),
    (cut.TwoTensors, "traced whole by torch.distributed.pipelining: blocks.1 would receive 2 tensors"),
    (cut.ScalesByAParameter, "its forward reads scale outside the modules it calls"),
    (cut.ReturnsATuple, "its forward returns a tuple"),
    (cut.BlocksReturnTuples, "blocks.0 returns tuple, not one tensor"),
    (cut.BranchesOnValues, "its forward did not run on a meta batch of token ids [1, 8]"),
]


def refusal(model: object) -> str:
    with pytest.raises(ConfigError) as caught:
        check_sequential_cut(split_of(model), token_example(8))
    return str(caught.value)


@pytest.mark.parametrize(("cls", "words"), REFUSED, ids=[c.__name__ for c, _ in REFUSED])
def test_a_forward_that_is_not_the_chain_of_its_parts_is_refused(cls: type, words: str) -> None:
    line = refusal(cls())
    assert line.startswith(f"model={cls.__name__}: cannot be cut into pipeline stages by its block list"), (
        line
    )
    assert words in line and "\n" not in line, line
    assert "pipeline_split()" in line and "pp=1" in line, line


@pytest.mark.parametrize(
    "make",
    [
        cut.Chain,
        TinyLM,
        TinyLMWithOutput,
        lambda: TinyLM(vocab_size=64, hidden=16, layers=4),
        cut.CountsCalls,
    ],
    ids=["chain", "TinyLM", "logits_object", "PipelinedLM_model", "counts_calls"],
)
def test_a_forward_that_is_the_chain_passes_and_real_weights_stay_as_they_are(make: object) -> None:
    model = make()
    before = {n: t.clone() for n, t in [*model.named_parameters(), *model.named_buffers()]}
    check_sequential_cut(split_of(model), token_example(8))
    after = dict([*model.named_parameters(), *model.named_buffers()])
    assert all(not t.is_meta and t.equal(before[n]) for n, t in after.items())


def test_the_pipeline_sweeps_plain_module_passes() -> None:
    from pipeline_sweep import PlainModel

    check_sequential_cut(split_of(PlainModel()), token_example(8))


def test_a_split_with_its_own_stage_forward_is_trusted() -> None:
    from fsdp_cli.config.schema import LlamaConfig
    from fsdp_cli.models.llama import Llama

    model = Llama(LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16))
    split = model.pipeline_split()
    assert split.forward is not None
    check_sequential_cut(split, token_example(8))


CUSTOM = ["recipe=cpu_smoke", "pp=2", "model=custom"]


def test_a_bad_cut_is_one_line_before_launch(tmp_path: Path) -> None:
    result = cli_in_process(
        [*CUSTOM, "model._target_=tests.assets.cut_modules.LongResidual"],
        tmp_path / "run",
        env={"CUDA_VISIBLE_DEVICES": ""},
    )
    assert result.returncode == 2, result
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("fsdp-train: error: model=LongResidual: "), result.stderr
    assert "blocks.3's input is not blocks.2's output" in lines[0]


@pytest.mark.parametrize(
    ("target", "extra", "words"),
    [
        ("tests.assets.cut_modules.Chain", [], None),
        ("benchmarks.gpt.GPT", ["+model.n_layers=4"], None),
        (
            "tests.assets.cut_modules.Chain",
            ["pipeline.schedule=Interleaved1F1B", "pipeline.stages_per_rank=3"],
            "pp=2: the model has 4 blocks, fewer than pp x stages_per_rank = 6",
        ),
        (
            "torch.nn.Linear",
            ["+model.in_features=2", "+model.out_features=2"],
            "pp=> 1: Linear cannot be cut into pipeline stages: it has no direct child",
        ),
    ],
    ids=["chain", "gpt", "too_few_blocks", "no_block_list"],
)
def test_the_pre_launch_check_builds_the_module_on_meta(
    target: str, extra: list[str], words: str | None
) -> None:
    from fsdp_cli.config.pipeline_cut import pipeline_cut_check

    run = run_of(composed(*CUSTOM, f"model._target_={target}", *extra))
    if words is None:
        pipeline_cut_check(run)
        return
    with pytest.raises(ConfigError) as caught:
        pipeline_cut_check(run)
    assert str(caught.value).startswith(words), caught.value


def rank_refusal(model: object, options: PipelineOptions | None = None) -> str:
    """What FSDP2Strategy says in the rank, before it needs a process group."""
    from fsdp_cli.parallel.dims import ParallelDims
    from fsdp_cli.strategies import FSDP2Strategy
    from tests.assets.pipeline_modules import PipelinedLM

    strategy = FSDP2Strategy(pipeline_parallel_size=2, pipeline=options)
    strategy.dims = ParallelDims.resolve(world_size=2, pp=2)
    module = PipelinedLM()
    module.model = model
    strategy._lightning_module = module
    with pytest.raises(ConfigError) as caught:
        strategy._parallelize_stages(model)
    return str(caught.value)


def test_the_rank_refuses_a_bad_cut_in_the_same_words() -> None:
    assert rank_refusal(cut.LongResidual()) == refusal(cut.LongResidual())


def test_the_library_path_refuses_bad_pipeline_options_in_one_line() -> None:
    from fsdp_cli.strategies import FSDP2Strategy

    with pytest.raises(ConfigError, match=r"^pipeline.schedule=Foo: not a schedule torch ships"):
        FSDP2Strategy(pipeline_parallel_size=2, pipeline=PipelineOptions(schedule="Foo"))
    line = rank_refusal(cut.Chain(), PipelineOptions(cut=CutPolicy.explicit, cuts=[1, 2]))
    assert line.startswith("pipeline.cuts=[1, 2]: 2 stages need 1 cut points, got 2"), line


TRACED = [
    (lambda: GPT(n_layers=4), ("tok", "pos"), ("ln_f", "head")),
    (cut.ScalesBetweenBlocks, ("embed",), ("head",)),
    (cut.ScalesInPlace, ("embed",), ("head",)),
]


@pytest.mark.parametrize(("make", "first", "last"), TRACED, ids=["gpt", "scales_between", "scales_in_place"])
def test_work_between_the_parts_is_cut_by_torchs_tracer_and_runs_as_the_whole_forward(
    make: object, first: tuple[str, ...], last: tuple[str, ...]
) -> None:
    """nanoGPT's positions added before the blocks (and work between blocks): torch's tracing front
    end cuts the forward; two stages over the model's own modules give its forward and gradients
    exactly, for the traced shape and for another one (traced again), in train and eval mode."""
    import copy

    import torch

    from fsdp_cli.pipeline.stages import prune, views
    from fsdp_cli.pipeline.traced import TracedForward

    torch.manual_seed(0)
    model = make()
    whole = copy.deepcopy(model)
    split = check_sequential_cut(split_of(model), token_example(8))
    assert isinstance(split.forward, TracedForward) and (split.first, split.last) == (first, last)
    assert not any("forward" in m.__dict__ for m in model.modules())  # the tracer's wrappers removed
    ranges = [range(0, 2), range(2, 4)]
    prune(split, ranges, [0, 1])
    stages = views(split, ranges, [0, 1])
    for shape, train in (((2, 8), True), ((3, 5), True), ((3, 5), False)):
        ids = torch.randint(0, 64, shape)
        for m in (whole, *stages):
            m.train(train)
        split.forward.prepare(ids, train=train, device=torch.device("cpu"))
        out, expected = stages[1](stages[0](ids)), whole(ids)
        assert torch.equal(out, expected), (shape, train)
        out.square().mean().backward()
        expected.square().mean().backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        assert set(grads) == {n for n, _ in whole.named_parameters()}
        for name, param in whole.named_parameters():
            assert torch.equal(grads[name], param.grad), name
        model.zero_grad(), whole.zero_grad()


@pytest.mark.distributed
def test_a_nanogpt_style_module_trains_at_pp2_as_one_process(tmp_path: Path) -> None:
    """fsdp-train with benchmarks.gpt.GPT (positions added to the token embedding in forward) at
    pp=2: its stages cut by torch's tracer, 8 steps equal to one process (losses and gradient norms,
    fp32), its full file laid out as one process's (the model's names), and its step-4 file resumed
    under FSDP1 and DDP on 2 ranks and HSDP 2x2 on 4, each continuing as the one process did."""
    common = [
        "model=custom",
        "model._target_=benchmarks.gpt.GPT",
        "+model.n_layers=4",
        "data.vocab_size=256",
        "trainer.max_steps=8",
        "data.global_batch_size=8",
        "data.seq_len=32",
        "precision=32-true",
        "accelerator=cpu",
        "seed=11",
        "trainer.gradient_clip_val=1000000",
        "checkpoint=full",
    ]
    piped, one = tmp_path / "pp2", tmp_path / "one"
    env = {"CUDA_VISIBLE_DEVICES": ""}
    assert_ok(run_cli([*common, "pp=2", "devices=2", "checkpoint.every_n_steps=4"], piped, env=env), piped)
    assert_ok(run_cli([*common, "strategy=ddp", "devices=1"], one, env=env), one)
    assert relative_gap(losses(piped), losses(one)) < 1e-5
    assert relative_gap(grad_norms(piped), grad_norms(one)) < 1e-5
    from test_pipeline import assert_a_pp1_full_file

    last = Path("checkpoints") / "step_00000008.pt"
    assert_a_pp1_full_file(piped / last, one / last)
    saved = piped / "checkpoints" / "step_00000004.pt"
    layouts = {
        "fsdp": ["strategy=fsdp", "devices=2"],
        "ddp": ["strategy=ddp", "devices=2"],
        "hsdp": ["strategy=fsdp2", "devices=4", "strategy.replicate_size=2"],
    }
    for name, layout in layouts.items():
        resumed = tmp_path / name
        assert_ok(run_cli([*common, *layout, f"resume={saved}"], resumed, env=env), resumed)
        assert relative_gap(losses(resumed), losses(one)[4:]) < 1e-5, name
