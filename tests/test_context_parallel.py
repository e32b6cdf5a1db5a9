"""Context parallel (``cp``): the sequence of every micro-batch split over cp ranks, attention
exchanged all-to-all over heads (fsdp_cli/parallel/context_parallel.py).

The library's layouts against one process, losses and gradients (the built-in model in float64,
transformers' Llama in float32), with the two traps measured (tests/context_parallel_check.py);
fsdp-train at cp=2 in bf16 with float8, compile and offload, and a user's LightningModule through
the hook, against one process (cp x HSDP with LoRA on packed chat data, the token-weighted loss
and a resume at cp=1: tests/test_composition.py's composed hf run); the plan, the search and the
long-context recipe; the layouts that cannot run, refused before launch in one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    assert_ok,
    cli_in_process,
    composed,
    grad_norms,
    losses,
    relative_gap,
    run_cli,
    run_of,
    torchrun_rows,
)
from harness import REPO

CPU = {"CUDA_VISIBLE_DEVICES": ""}
CHECK = REPO / "tests" / "context_parallel_check.py"


def check(nproc: int, *args: str) -> list[dict[str, Any]]:
    return torchrun_rows(CHECK, nproc, *args)


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("nproc", "layouts", "ways", "lora"),
    [
        (2, ["cp2"], "right,local_positions,shift_per_slice", "tp2"),
        (4, ["cp2xdp2", "cp2xtp2"], "right,sequence_parallel", "cp2xtp2"),
    ],
    ids=["cp2", "cp2xdp2_and_cp2xtp2"],
)
def test_context_parallel_equals_one_process_in_float64(
    nproc: int, layouts: list[str], ways: str, lora: str, tmp_path: Path
) -> None:
    """8 SGD steps of the built-in Llama in float64 (grouped-query attention: 2 key/value heads
    for 4 query heads), unpacked and packed: losses and whole gradients equal one process's
    (1e-10); each slice's positions counted from 0, or labels shifted inside each slice, move the
    gradients (by far more than 1e-3): the test sees either trap. The same for a Hugging Face
    LlamaForCausalLM in float32 (1e-5; its gradients over the first 3 steps; its attention
    through transformers' registry). In the same processes, LoRA under tensor parallel (tp=2, and
    cp=2 x tp=2; with and without sequence parallel): the losses and the adapters' gradients
    equal one process's (1e-10) (a frozen weight that trains moves the losses: seen, torch's
    SequenceParallel thawing the frozen norms)."""
    from test_pipeline import hf_folder

    rows = check(
        nproc,
        f"--layouts={','.join(layouts)}",
        f"--ways={ways}",
        f"--hf-folder={hf_folder(tmp_path)}",
        f"--lora-layouts={lora}",
    )
    expected = {
        (layout, "llama", w, p)
        for layout in layouts
        for w in ways.split(",")
        for p in (False, True)
        if w != "sequence_parallel" or layout == "cp2xtp2"
    }
    expected |= {(layout, "hf", "right", p) for layout in layouts for p in (False, True)}
    expected |= {(lora, "llama_lora", w, p) for w in ("right", "sequence_parallel") for p in (False, True)}
    assert {(r["layout"], r["model"], r["way"], r["packed"]) for r in rows} == expected, rows
    for row in rows:
        if row["model"] == "hf":
            assert row["loss_rel"] < 1e-5 and row["grad_rel"] < 1e-5, row
        elif row["way"] in ("right", "sequence_parallel"):
            assert row["loss_rel"] < 1e-12 and row["grad_rel"] < 1e-10, row
        elif row["way"] == "shift_per_slice" or not row["packed"]:  # (packing sets the positions)
            assert row["grad_rel"] > 1e-3, row


# --------------------------------------------------------------------------- fsdp-train


COMMON = [
    "trainer.max_steps=4",
    "accelerator=cpu",
    "seed=5",
    # Logs each step's gradient norm and clips nothing: AdamW's losses hide a gradient scaled by a
    # constant (a cp factor lost), the norms do not.
    "trainer.gradient_clip_val=1000000",
]
TINY = ["model=tiny", "model.vocab_size=64"]
LIGHTNING = [
    "model=custom",
    "model._target_=tests.assets.context_parallel_modules.ContextParallelLM",
    "precision=32-true",
]
"""(Its own loader: no data.* key.)"""


def _runs() -> dict[str, tuple[list[str], list[str]]]:
    """name -> (the cp run's overrides, its one-process reference's). (model=hf at cp x HSDP with
    LoRA on packed chat data, resumed at cp=1: tests/test_composition.py's composed hf run; the
    HF model unpacked and packed at cp=2, cp x dp, cp x tp: the float64 check above.)"""
    bf16 = [
        *TINY,
        "data.seq_len=32",
        "data.global_batch_size=8",
        "precision=bf16-mixed",
        "strategy.float8=true",
    ]
    return {
        "bf16": (
            [*bf16, "devices=2", "cp=2", "strategy.compile=true", "strategy.cpu_offload=true"],
            [*bf16, "devices=1"],
        ),
        "lightning": ([*LIGHTNING, "devices=2", "cp=2"], [*LIGHTNING, "devices=1"]),
    }


@pytest.fixture(scope="module")
def cp_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each cp run and its one-process reference."""
    root = tmp_path_factory.mktemp("cp-runs")
    out: dict[str, Path] = {}
    for name, (cp_args, reference) in _runs().items():
        for label, args in ((name, cp_args), (f"{name}_one", reference)):
            run_dir = root / label
            assert_ok(run_cli([*COMMON, *args], run_dir, env=CPU), run_dir)
            out[label] = run_dir
    return out


@pytest.mark.distributed
def test_cp_in_bf16_with_float8_compile_and_offload_equals_one_process(cp_runs: dict[str, Path]) -> None:
    """cp=2 in bf16-mixed with float8, compiled blocks and CPU offload: one eager bf16 float8
    process's losses within bf16's tolerance."""
    assert relative_gap(losses(cp_runs["bf16"]), losses(cp_runs["bf16_one"])) < 0.02
    assert relative_gap(grad_norms(cp_runs["bf16"]), grad_norms(cp_runs["bf16_one"])) < 0.05


@pytest.mark.distributed
def test_a_lightning_module_with_the_hook_equals_one_process_at_cp2(cp_runs: dict[str, Path]) -> None:
    """A user's LightningModule (its own loader, SGD) that declares ``context_parallel`` and
    splits its batch with it, its model the built-in Llama: cp=2 gives one process's losses."""
    assert relative_gap(losses(cp_runs["lightning"]), losses(cp_runs["lightning_one"])) < 1e-5


# --------------------------------------------------------------------------- sizes and the plan


def test_cp_is_a_dimension_of_the_mesh_between_shard_and_tp() -> None:
    from fsdp_cli.errors import ConfigError
    from fsdp_cli.parallel.dims import CP, DP_REPLICATE, DP_SHARD, PP, TP, ParallelDims

    dims = ParallelDims.resolve(world_size=8, cp=2, tp=2)
    assert (dims.dp, dims.cp, dims.tp, dims.world_size) == (2, 2, 2, 8)
    assert list(dims.sizes()) == [PP, DP_REPLICATE, DP_SHARD, CP, TP]
    assert dims.fsdp_enabled  # sharded over dp x cp
    assert ParallelDims.resolve(world_size=2, cp=2).fsdp_enabled  # (over the cp ranks alone)
    with pytest.raises(ConfigError, match=r"^cp=3: must divide the world size 8"):
        ParallelDims.resolve(world_size=8, cp=3)


def test_the_plan_holds_a_cp_slice_of_each_sequence_and_shards_over_dp_x_cp() -> None:
    """4 ranks at dp=4, then at dp=2 x cp=2: the same parameter shard (a quarter), half the
    activations (each rank holds half of every sequence, of twice the sequences)."""
    from fsdp_cli.cli.plan import resolved
    from fsdp_cli.plan.check import plan_for

    base = ["model=tiny", "data.seq_len=256", "data.global_batch_size=8", "data.micro_batch_size=2"]
    plans = [plan_for(resolved([*base, f"cp={cp}"], 4)) for cp in (1, 2)]
    one, two = (p.ranks[0] for p in plans if p is not None)
    assert two.params == one.params and 0.45 < two.activations / one.activations < 0.55


def test_the_long_context_recipe_fits_only_with_cp_and_the_search_finds_it() -> None:
    """llama_8b_128k_cp (an 8B Llama, 131,072-token sequences, 8 GPUs of 80 GB): its plan fits
    at cp=8; every layout ``--search`` finds fitting splits the sequence (cp > 1), none of tp, pp
    or HSDP alone does. (Its rank 0 and rank 7 rehearsed at world size 8 hold the plan's bytes:
    tests/test_recipes.py.)"""
    common = ["recipe=llama_8b_128k_cp", "--device-memory", "80GB", "--json"]
    plan = cli_in_process(common, prog="fsdp-plan")
    assert plan.returncode == 0, plan.stderr
    assert json.loads(plan.stdout)["fits"] is True
    found = cli_in_process([*common, "--search"], prog="fsdp-plan")
    rows = [r for r in json.loads(found.stdout) if "skipped" not in r]
    fitting = [r["overrides"] for r in rows if r["fits"]]
    assert fitting and all(" cp=" in f" {o}" for o in fitting), fitting
    assert any(" cp=" not in f" {r['overrides']}" for r in rows)  # (cp=1 layouts were tried)


# --------------------------------------------------------------------------- refused before launch


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["devices=2", "cp=2", "strategy=ddp"], "cp"),
        (["devices=2", "cp=2", "strategy=fsdp"], "cp"),
        (["devices=4", "cp=3"], "cp"),
        (["devices=2", "cp=2", "data.seq_len=33"], "data.seq_len"),
        (["devices=4", "cp=2", "tp=2", "model.n_heads=2", "model.n_kv_heads=2", "model.dim=32"], "cp"),
        (["devices=4", "cp=2", "pp=2"], "pp"),
        (
            ["devices=2", "cp=2", "model=custom", "model._target_=tests.assets.custom_models.TinyLM"],
            "TinyLM: it declares no context_parallel",
        ),
        (
            ["devices=2", "cp=2", "model=custom", "model._target_=tests.assets.pipeline_modules.PipelinedLM"],
            "PipelinedLM: a LightningModule declares no context_parallel",
        ),
    ],
    ids=["ddp", "fsdp1", "world", "seq_len", "heads", "pp", "plain-module", "lightning-without-hook"],
)
def test_a_cp_layout_that_cannot_run_is_one_line_before_launch(
    overrides: list[str], words: str, tmp_path: Path
) -> None:
    result = cli_in_process(["accelerator=cpu", *overrides], tmp_path / "run", env=CPU)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, (overrides, result.stderr)
    assert words in lines[0], lines[0]


# --------------------------------------------------------------------------- torch's ring attention


@pytest.mark.parametrize(
    ("overrides", "gpus", "words"),
    [
        (["cp_impl=ring"], 0, "cp_impl=ring: torch's ring attention has no CPU kernel"),
        (
            ["cp_impl=ring", "data=chat", "data.path=c.jsonl", "data.tokenizer=t", "data.packing=true"],
            2,
            "cp_impl=ring: not with data.packing=true",
        ),
        (
            ["cp_impl=ring", "data.seq_len=34"],
            2,
            "data.seq_len=34: must divide by 2 x cp=4 with cp_impl=ring",
        ),
    ],
    ids=["cpu", "packing", "seq_len"],
)
def test_ring_attention_that_cannot_run_is_refused_before_launch(
    overrides: list[str], gpus: int, words: str
) -> None:
    """cp_impl=ring on CPU processes, with packed documents, on a sequence that does not split
    into 2 x cp chunks: one line each (the CPU case through fsdp-train itself, exit 2)."""
    from fsdp_cli.config.model_kinds import check_context_parallel
    from fsdp_cli.errors import ConfigError

    run = run_of(composed("devices=2", "cp=2", "data.seq_len=32", *overrides), gpus=gpus)
    with pytest.raises(ConfigError) as caught:
        check_context_parallel(run)
    assert str(caught.value).startswith(words), caught.value


def test_ring_attention_on_cpu_processes_is_one_line_from_fsdp_train(tmp_path: Path) -> None:
    result = cli_in_process(
        ["accelerator=cpu", "devices=2", "cp=2", "cp_impl=ring"], tmp_path / "run", env=CPU
    )
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("fsdp-train: error: cp_impl=ring: torch's ring attention has no CPU kernel")


def test_ring_slices_are_head_and_tail_chunks_with_their_global_positions_and_labels() -> None:
    """cp_impl=ring: rank r holds chunks r and 2cp-1-r of 2cp (torch's load balancing), and its
    positions and shifted labels are those chunks' (the whole sequence's, put back together)."""
    import torch

    from fsdp_cli.parallel.context_parallel import RingContextParallel

    cp, length = 4, 16
    ranks = [RingContextParallel(group=None, size=cp, rank=r) for r in range(cp)]
    batch = torch.arange(100, 100 + length + 1).expand(2, length + 1)
    parts = [rank.split_batch(batch) for rank in ranks]
    order = torch.cat([rank.split(torch.arange(length).unsqueeze(0)) for rank in ranks], dim=1)[0]
    assert order.tolist() == [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9]
    inputs, targets, positions = (torch.cat([p[i] for p in parts], dim=1) for i in range(3))
    assert torch.equal(inputs, batch[:, :-1][:, order]) and torch.equal(targets, batch[:, 1:][:, order])
    assert torch.equal(positions, order.expand(2, length))
    assert torch.equal(targets, inputs + 1)  # shifted before the split: no boundary lost
    rows = torch.randn(length, 3)
    assert torch.equal(torch.cat([r.split(rows, dim=0) for r in ranks]), rows[order])


def test_ring_attention_keeps_every_head_so_heads_need_not_split_over_cp() -> None:
    """2 heads at cp=4: refused for the all-to-all form (each rank takes whole heads), not for ring
    attention (each rank keeps every head of its slice)."""
    from fsdp_cli.config.model_kinds import check_context_parallel
    from fsdp_cli.errors import ConfigError

    sizes = ["devices=4", "cp=4", "model.n_heads=2", "model.n_kv_heads=2", "model.dim=32", "data.seq_len=32"]
    check_context_parallel(run_of(composed(*sizes, "cp_impl=ring"), gpus=4))
    with pytest.raises(ConfigError, match=r"^cp=4: model.n_heads=2 does not split over tp=1 x cp=4"):
        check_context_parallel(run_of(composed(*sizes), gpus=4))
