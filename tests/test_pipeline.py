"""Pipeline parallel (issue 29): layouts refused before launch, every schedule against one process,
and fsdp-train end to end with pp=2."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import cli_in_process, losses, read_metrics, run, run_cli
from harness import REPO

from fsdp_cli.checkpoint.convert import load
from fsdp_cli.errors import ConfigError
from fsdp_cli.parallel.dims import ParallelDims

CPU = {"CUDA_VISIBLE_DEVICES": ""}
SWEEP = REPO / "tests" / "pipeline_sweep.py"


# ---------------------------------------------------------------- fast tier: bad input


@pytest.mark.parametrize(
    ("overrides", "key", "words"),
    [
        (["pp=3"], "pp=3", ["divide the world size 2", "allowed: 1, 2"]),
        (["pp=2", "strategy=ddp"], "pp=2", ["strategy=ddp", "strategy=fsdp2"]),
        (["pp=2", "pipeline.schedule=Foo"], "pipeline.schedule=Foo", ["1F1B", "DualPipeV"]),
        (
            ["pp=2", "pipeline.schedule=ZBVZeroBubble", "pipeline.stages_per_rank=3"],
            "pipeline.stages_per_rank=3",
            ["allowed: 2"],
        ),
        (
            ["pp=2", "pipeline.schedule=1F1B", "pipeline.stages_per_rank=2"],
            "pipeline.stages_per_rank=2",
            ["allowed: 1"],
        ),
        (["pp=2", "pipeline.microbatches=3"], "pipeline.microbatches=3", ["8 sequences", "1, 2, 4, 8"]),
        (["pp=2", "pipeline.microbatches=1"], "pipeline.microbatches=1", ["at least pp=2"]),
        (
            ["pp=2", "pipeline.schedule=DualPipeV", "pipeline.microbatches=2"],
            "pipeline.microbatches=2",
            ["DualPipeV needs a micro-batch per stage", "at least pp x stages_per_rank = 4"],
        ),
        (["devices=4", "pp=4", "pipeline.schedule=Interleaved1F1B"], "pp=4", ["4 blocks", "8 stages"]),
        (["pp=2", "pipeline.cut=explicit", "pipeline.cuts=[3,1]"], "pipeline.cuts", ["1 cut points"]),
        (["pp=2", "strategy.sequence_parallel=true", "tp=1"], "strategy.sequence_parallel", ["pp=2"]),
        (["pp=2", "model.tie_embeddings=true"], "model.tie_embeddings=True", ["first stage", "false"]),
        (["pp=2", "checkpoint=full"], "checkpoint.format=full", ["sharded", "fsdp-ckpt convert"]),
        (
            ["pp=2", "model=custom", "model._target_=tests.assets.own_loaders.BoringModel"],
            "pp=2",
            ["BoringModel", "lacks pipeline_inputs, pipeline_loss"],
        ),
    ],
)
def test_an_impossible_pipeline_layout_is_one_line_before_launch(
    overrides: list[str], key: str, words: list[str], tmp_path: Path
) -> None:
    result = cli_in_process(["recipe=cpu_smoke", *overrides], tmp_path / "run", env=CPU)
    assert result.returncode == 2, result
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("fsdp-train: error: "), result.stderr
    assert key in lines[0], lines[0]
    for word in words:
        assert word in lines[0], lines[0]


def test_pp_is_a_named_dimension_of_the_mesh_sizes() -> None:
    dims = ParallelDims.resolve(world_size=8, pp=2, tp=2)
    assert (dims.pp, dims.dp, dims.tp, dims.world_size) == (2, 2, 2, 8)
    assert list(dims.sizes()) == [
        "pipeline_parallel",
        "data_parallel_replicate",
        "data_parallel_shard",
        "tensor_parallel",
    ]
    with pytest.raises(ConfigError, match=r"dp\(4\) \* tp\(2\) != world size 4 \(= 8 / pp=2"):
        ParallelDims.resolve(world_size=8, pp=2, tp=2, dp=4)


# ---------------------------------------------------------------- every schedule against one process


def sweep(nproc: int, *args: str) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", str(SWEEP), *args]
    result = run(cmd, timeout=600, cwd=REPO)
    assert result.returncode == 0, result
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def hf_folder(tmp_path: Path) -> Path:
    """A tiny LlamaForCausalLM's config.json (fresh weights: nothing to download)."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    config.save_pretrained(tmp_path / "hf")
    return tmp_path / "hf"


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("nproc", "layout"),
    [(2, ["--pp=2"]), (4, ["--pp=2", "--dp=2"]), (4, ["--pp=2", "--tp=2"])],
    ids=["pp2", "pp2xdp2", "pp2xtp2"],
)
def test_every_schedule_equals_one_process(nproc: int, layout: list[str], tmp_path: Path) -> None:
    """8 steps of AdamW on the built-in Llama (8 blocks, so each stage holds several FSDP units:
    the zero-bubble and V schedules give wrong gradients when a unit reshards after forward), a
    Hugging Face LlamaForCausalLM built from its config (never downloaded) and a plain module."""
    rows = sweep(
        nproc, *layout, "--models=llama,module,hf", f"--hf-folder={hf_folder(tmp_path)}", "--steps=8"
    )
    assert len(rows) == 3 * 7, rows
    for row in rows:
        assert row["rel"] < 1e-5, (row["model"], row["schedule"], row["losses"], row["reference"])


COMMON = ["recipe=cpu_pp", "trainer.max_steps=8", "trainer.log_every_n_steps=1"]
SAVES = ["checkpoint.every_n_steps=4"]
ACCUMULATE = ["data.micro_batch_size=4", "pipeline.microbatches=2"]


@pytest.mark.distributed
def test_fsdp_train_pp2_equals_one_process_and_resumes_on_other_layouts(tmp_path: Path) -> None:
    """fsdp-train recipe=cpu_pp (pp=2, 1F1B, accumulating 2 batches per step) against one process
    (no accumulation) over 8 steps; its sharded
    step-4 save resumed at pp=1 and at tp=2 repeats the uninterrupted run's last 4 losses; the
    save converts to one file (the whole model's weights and optimizer) that verifies."""
    # Two batches of 4 per optimizer step (gradient accumulation), each in 2 micro-batches.
    piped = run_cli([*COMMON, *SAVES, *ACCUMULATE], tmp_path / "pp2", env=CPU)
    single = run_cli(
        [*COMMON, "checkpoint.every_n_steps=null", "pp=1", "devices=1"], tmp_path / "one", env=CPU
    )
    assert piped.returncode == 0 and single.returncode == 0, (piped, single)
    straight = losses(tmp_path / "pp2")
    assert len(straight) == 8
    assert straight == pytest.approx(losses(tmp_path / "one"), rel=1e-5)
    save = tmp_path / "pp2" / "checkpoints" / "step_00000004"
    for name, layout in (("to_pp1", ["pp=1", "devices=1"]), ("to_tp2", ["pp=1", "tp=2"])):
        resumed = run_cli([*COMMON, *SAVES, *ACCUMULATE, *layout, f"resume={save}"], tmp_path / name, env=CPU)
        assert resumed.returncode == 0, resumed
        assert losses(tmp_path / name) == pytest.approx(straight[4:], rel=1e-5), name
    converted = tmp_path / "full.pt"
    assert fsdp_ckpt("convert", str(save), str(converted), "--to", "full") == 0
    assert fsdp_ckpt("verify", str(converted)) == 0
    whole = load(converted)
    names = {n for n in whole.state_dict if n.startswith("model.")}
    assert {"model.tok_embeddings.weight", "model.output.weight", "model.layers.3.ffn_norm.weight"} <= names
    assert len(whole.optimizer_states[0]["state"]) == len(whole.state_dict)


def fsdp_ckpt(*args: str) -> int:
    from fsdp_cli.cli.ckpt import main

    try:
        main(list(args))
    except SystemExit as stop:
        return int(stop.code or 0)
    return 0


@pytest.mark.distributed
def test_a_3d_pipeline_equals_one_process() -> None:
    """pp x dp x tp = 2 x 2 x 2 on 8 processes, the default schedule and a V schedule."""
    rows = sweep(
        8, "--pp=2", "--dp=2", "--tp=2", "--models=llama", "--schedules=1F1B,ZBVZeroBubble", "--steps=8"
    )
    assert [r["schedule"] for r in rows] == ["1F1B", "ZBVZeroBubble"]
    for row in rows:
        assert row["rel"] < 1e-5, row


def test_an_hf_models_cut_points_and_stages_name_its_real_modules(tmp_path: Path) -> None:
    """model=hf's block count comes from config.json before launch and names modules a meta build
    has; the cut keeps the whole model's names (a checkpoint is layout-free)."""
    from fsdp_cli.config.model_kinds import HF
    from fsdp_cli.config.schema import HFModelConfig
    from fsdp_cli.models.args import HFModelArgs
    from fsdp_cli.models.hf import build_hf_model
    from fsdp_cli.pipeline.cuts import stage_blocks
    from fsdp_cli.pipeline.options import CutPolicy
    from fsdp_cli.pipeline.stages import prune, split_of, views

    folder = hf_folder(tmp_path)
    points = HF.stage_split_points(HFModelConfig(path=str(folder)))
    model = build_hf_model(HFModelArgs(path=str(folder), pretrained=False), seed=0)
    whole = dict(model.named_parameters())
    assert points == [f"hf.model.layers.{i}" for i in range(4)]
    assert all(name in dict(model.named_modules()) for name in points)
    split = split_of(model)
    ranges = stage_blocks(4, 2, CutPolicy.balanced)
    prune(split, ranges, [1])
    kept = dict(model.named_parameters())
    assert set(kept) < set(whole)
    assert {n.split(".")[3] for n in kept if ".layers." in n} == {"2", "3"}
    assert "hf.lm_head.weight" in kept and "hf.model.embed_tokens.weight" not in kept
    (view,) = views(split, ranges, [1])
    assert view.is_last and not view.is_first
    assert {id(p) for p in view.parameters()} == {id(p) for p in kept.values()}


@pytest.mark.distributed
def test_a_lightning_module_with_the_pipeline_hooks_trains_under_pp(tmp_path: Path) -> None:
    """model=custom with a LightningModule of its own (its loaders, optimizer and the two
    pipeline hooks): pp=2 gives the losses of one process, and validation (the schedule forward
    only) its val_loss."""
    common = [
        "model=custom",
        "model._target_=tests.assets.pipeline_modules.PipelinedLM",
        "accelerator=cpu",
        "trainer.max_steps=8",
        "trainer.log_every_n_steps=1",
        "trainer.val_check_interval=4",
        "checkpoint.every_n_steps=null",
    ]
    piped = run_cli([*common, "pp=2", "devices=2"], tmp_path / "pp2", env=CPU)
    single = run_cli([*common, "devices=1"], tmp_path / "one", env=CPU)
    assert piped.returncode == 0 and single.returncode == 0, (piped, single)
    rows = {d: read_metrics(tmp_path / d) for d in ("pp2", "one")}
    trained = {d: [r["loss"] for r in rows[d] if "loss" in r] for d in rows}
    validated = {d: [r["val_loss"] for r in rows[d] if "val_loss" in r] for d in rows}
    assert len(trained["pp2"]) == 8 and len(validated["pp2"]) == 2
    assert trained["pp2"] == pytest.approx(trained["one"], rel=1e-5)
    assert validated["pp2"] == pytest.approx(validated["one"], rel=1e-5)
