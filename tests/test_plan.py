"""The memory plan (``fsdp-plan``): what it predicts each rank holds equals what real runs hold."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import cli_in_process, composed, entry_point, read_summary, run
from harness import Result

from fsdp_cli.config.convert import load_train_config
from fsdp_cli.config.resolved import ResolvedRun
from fsdp_cli.config.schema import LlamaConfig, WrapConfig
from fsdp_cli.launch.layout import resolve_layout
from fsdp_cli.plan.check import plan_for, plan_problem
from fsdp_cli.plan.model import llama_activations, llama_spec, module_spec

HELD = ("params", "grads", "optimizer")
CPU = {"CUDA_VISIBLE_DEVICES": ""}


def assert_plan_matches_the_run(run_dir: Path) -> None:
    """Per rank, the plan's parameter, gradient and optimizer bytes equal the bytes the run's local
    shards held after its first step (recorded in summary.json by the setup report)."""
    held = read_summary(run_dir)["setup"]["held_bytes"]
    plan = plan_for(ResolvedRun.of(load_train_config(run_dir / "config.yaml")))
    assert plan is not None
    predicted = [{k: getattr(rank, k) for k in HELD} for rank in plan.ranks]
    assert predicted == held


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["single", "ddp", "fsdp2", "fsdp2_tp2", "fsdp"])
def test_plan_equals_the_bytes_each_rank_holds(layout_run: Any, name: str) -> None:
    assert_plan_matches_the_run(layout_run(name))


def test_llama_description_equals_a_meta_build() -> None:
    """The torch-free description of the built-in model (names, shapes, tensor-parallel dims,
    units) equals one read off a meta-device build; its activation formula is within 5% of the
    saved-tensor probe (in fp32 and bf16), in all and on the residual stream."""
    import torch

    from fsdp_cli.models.llama import Llama

    for tied in (False, True):
        cfg = LlamaConfig(vocab_size=256, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, tie_embeddings=tied)
        with torch.device("meta"):
            model = Llama(cfg)
        tp_plan = None if tied else model.tp_plan(sequence_parallel=False)
        built = module_spec(model, WrapConfig(), vocab_size=256, tp_plan=tp_plan)
        analytic = llama_spec(cfg, WrapConfig())
        assert analytic is not None
        if tied:  # no tensor parallel with tied embeddings: compare names and shapes
            assert [(p.name, p.shape) for p in built.params] == [(p.name, p.shape) for p in analytic.params]
        else:
            assert built.params == analytic.params
        assert built.units == analytic.units == [f"layers.{i}" for i in range(3)]
        for act in (4, 2):
            probed, formula = built.activations(64, act), llama_activations(cfg, 64, act)
            assert formula.block_inputs == probed.block_inputs
            # (and the bytes on the residual stream, whole on every tensor-parallel rank without
            # sequence parallel, the same from the saved tensors' shapes)
            assert formula.block_whole is not None and probed.block_whole is not None
            pairs = [*zip(formula.blocks, probed.blocks), *zip(formula.block_whole, probed.block_whole)]
            for a, b in [*pairs, (formula.other, probed.other)]:
                assert abs(a - b) <= 0.05 * b, (act, formula, probed)


def test_custom_model_is_planned_from_a_meta_build() -> None:
    cfg = resolve_layout(
        composed(
            "model=custom",
            "model._target_=tests.assets.custom_models.TinyLM",
            "data.vocab_size=256",
            "devices=2",
        ),
        CPU,
    )
    plan = plan_for(ResolvedRun.of(cfg))
    assert plan is not None and len(plan.ranks) == 2
    params = sum(
        p.numel() for p in __import__("tests.assets.custom_models", fromlist=["TinyLM"]).TinyLM().parameters()
    )
    # FSDP2 over 2 ranks: each holds about half of the fp32 parameters (padding rounds up).
    assert 2 * params <= plan.ranks[0].params <= 2 * params + 4 * 64 * 16
    assert plan.ranks[0].activations_full_ac < plan.ranks[0].activations_no_ac


def test_plan_problem_names_the_numbers_and_a_hint() -> None:
    cfg = resolve_layout(
        composed("model=llama_1b", "devices=8", "precision=bf16-mixed", "data.seq_len=4096"),
        {"CUDA_VISIBLE_DEVICES": ",".join(map(str, range(8)))},
        gpus=8,  # a node of 8 GPUs, whatever this machine has
    )
    assert plan_problem(ResolvedRun.of(cfg), device_memory=80 * 2**30) is None
    problem = plan_problem(ResolvedRun.of(cfg), device_memory=8 * 2**30)
    assert problem is not None and "memory plan: rank" in problem and "GiB" in problem and "hint:" in problem
    # No GPU visible and no memory given: nothing to check against, whatever this machine has.
    assert plan_problem(ResolvedRun.of(cfg), env=CPU) is None


def _fsdp_plan(*args: str) -> Result:
    return cli_in_process(list(args), prog="fsdp-plan")


def test_fsdp_plan_json_and_table() -> None:
    result = _fsdp_plan("model=llama_124m", "--gpus", "4", "--device-memory", "80GiB", "--json")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["strategy"] == "fsdp2" and plan["layout"]["world"] == 4 and len(plan["ranks"]) == 4
    assert plan["fits"] is True
    for rank in plan["ranks"]:
        assert rank["total"] == sum(
            rank[k] for k in ("params", "grads", "optimizer", "activations", "buffers")
        )
    table = _fsdp_plan("model=llama_124m", "--gpus", "4", "--device-memory", "80GiB")
    assert table.returncode == 0 and "fits" in table.stdout and "optimizer" in table.stdout


def test_fsdp_plan_search_lists_the_layouts_that_fit_first_each_as_its_own_plan() -> None:
    """(How long it takes: benchmarks/plan_search.py.)"""
    from fsdp_cli.cli.plan import resolved

    common = ["recipe=llama_8b_hsdp", "num_nodes=1"]
    result = _fsdp_plan(*common, "--gpus", "8", "--device-memory", "80GB", "--search", "--json")
    assert result.returncode == 0, result.stderr
    rows = [r for r in json.loads(result.stdout) if "skipped" not in r]
    fits = [r["fits"] for r in rows]
    assert True in fits and False in fits and fits == sorted(fits, reverse=True), fits
    assert all((r["total_bytes"] <= 0.95 * 80e9) == r["fits"] for r in rows)
    # DDP keeps all 8B fp32 parameters, gradients and Adam moments on every GPU: 128 GB.
    (ddp,) = [r for r in rows if r["overrides"].startswith("strategy=ddp")]
    assert not ddp["fits"] and ddp["total_bytes"] > 16 * 8e9
    # Each row is the plan fsdp-plan makes of that layout alone (the recipe's FSDP2 ones here).
    fsdp2 = [r for r in rows if r["overrides"].startswith("strategy=fsdp2 ")]
    for row in (fsdp2[0], next(r for r in fsdp2 if not r["fits"])):
        plan = plan_for(resolved([*common, *row["overrides"].split()], gpus=8), 80 * 10**9)
        assert plan is not None and plan.peak.total == row["total_bytes"], row


@pytest.mark.distributed  # a process of its own: this one has imported torch
def test_the_built_in_model_is_planned_without_importing_torch() -> None:
    args = [*entry_point("fsdp-plan"), "model=llama_8b", "--gpus", "8", "--json"]
    result = run(args, timeout=120, env={"PYTHONPROFILEIMPORTTIME": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if "|" in line}
    assert imported and "torch" not in imported


def test_fsdp_plan_errors_are_one_line() -> None:
    result = _fsdp_plan("tp=3", "--gpus", "4")
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("fsdp-plan: error: tp=3"), result.stderr


def test_fsdp_plan_plans_a_lightning_module_with_the_layers_its_configure_model_builds() -> None:
    """As the rehearsal builds it: the hook called on the meta device, its parameters sharded."""
    result = _fsdp_plan(
        "model=custom",
        "model._target_=tests.assets.lightning_style.ConfiguredLM",
        "+model.dim=32",
        "data.vocab_size=64",
        "--json",
    )
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    dim, vocab = 32, 64
    parameters = vocab * dim + 2 * (dim * dim + dim) + dim * vocab + vocab
    assert sum(rank["params"] for rank in plan["ranks"]) == 4 * parameters, plan  # fp32 bytes, sharded
    assert all(rank["activations"] > 0 for rank in plan["ranks"]), "its forward ran on the meta device"


def test_a_custom_model_without_a_vocabulary_key_gets_an_activation_estimate() -> None:
    """memory.md's custom-model command (no ``+model.vocab_size``, so ``data.vocab_size`` is
    null): the meta-device probe takes the vocabulary from the model's logits instead of giving up."""
    from conftest import run_of

    from fsdp_cli.plan.check import model_spec

    cfg = composed("model=custom", "model._target_=benchmarks.gpt.GPT", "+model.dim=64", "+model.n_layers=2")
    assert cfg.data.vocab_size is None
    spec = model_spec(run_of(cfg))
    activations = spec.activations(64, 4)
    assert spec.notes == [] and len(activations.blocks) == 2 and min(activations.blocks) > 0


# --------------------------------------------------------------------------- model=hf from config.json


def test_an_hf_plan_from_config_json_alone_estimates_activations_near_the_rehearsed_step(
    tmp_path: Path,
) -> None:
    """A model folder with config.json and no weights is planned (a plan reads no weight), its
    activations estimated on the meta device (transformers' masks built without reading values):
    the plan's total within 25% of the fake step's measured peak, and the rehearsal's verdict is
    the measured one."""
    from transformers import LlamaConfig as HFLlamaConfig

    HFLlamaConfig(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
    ).save_pretrained(tmp_path)
    args = ["model=hf", f"model.path={tmp_path}", "data.seq_len=512", "accelerator=cpu", "devices=2"]
    r = cli_in_process([*args, "--device-memory", "80GB", "--rehearse", "--json"], prog="fsdp-plan")
    assert r.returncode == 0, r
    assert "holds config.json but no weights: planned from config.json" in r.stderr
    out = json.loads(r.stdout)
    planned, step = out["ranks"][0], out["rehearsal"]["step"]
    assert out["activations_known"] and planned["activations"] > 0
    assert abs(planned["total"] - step["peak_bytes"]) <= 0.25 * step["peak_bytes"], (planned, step)
    text = cli_in_process([*args, "--device-memory", "80GB", "--rehearse"], prog="fsdp-plan").stdout
    assert "fits: yes" in text and "fits (measured by the fake step): yes" in text


def test_an_hf_plan_without_an_activation_estimate_says_unknown_never_fits(tmp_path: Path) -> None:
    """A forward the meta device cannot run (a mixture of experts' grouped kernel): the table says
    "unknown" for the activations and ">=" for the total, and the verdict is "unknown", not "fits"."""
    from transformers import Qwen3MoeConfig

    Qwen3MoeConfig(
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
    ).save_pretrained(tmp_path)
    args = ["model=hf", f"model.path={tmp_path}", "data.seq_len=128", "accelerator=cpu", "devices=2"]
    r = cli_in_process([*args, "--device-memory", "80GB"], prog="fsdp-plan")
    assert r.returncode == 0, r
    assert "unknown" in r.stdout.split("note:")[0] and ">= " in r.stdout
    assert "fits: unknown (without the activations" in r.stdout and "fits: yes" not in r.stdout
    out = json.loads(cli_in_process([*args, "--device-memory", "80GB", "--json"], prog="fsdp-plan").stdout)
    assert out["activations_known"] is False and out["fits"] is None
