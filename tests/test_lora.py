"""LoRA adapters (peft=lora): what trains, what is refused before launch, what the plan counts,
and (distributed) losses equal across strategies, exact resume, and the PEFT / merged exports."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import FAST, assert_ok, cli_in_process, composed, losses, read_summary, run_cli, run_of

from fsdp_cli.adapters.lora import apply_lora
from fsdp_cli.adapters.options import AdapterDtype, AdapterMethod, AdapterOptions
from fsdp_cli.adapters.targets import adapter_layers
from fsdp_cli.config.schema import LlamaConfig
from fsdp_cli.models.llama import Llama

CPU = {"CUDA_VISIBLE_DEVICES": ""}
TINY = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)
LORA = AdapterOptions(name=AdapterMethod.lora, r=4, alpha=8.0)
LM = ["model=custom", "model._target_=tests.assets.lightning_style.EncoderDecoderLM"]


MOE = ["model.n_experts=4", "model.experts_per_token=2", "model.moe_hidden_dim=32"]


def lora_llama(options: AdapterOptions = LORA, seed: int = 3) -> Llama:
    model = Llama(TINY, seed=seed)
    apply_lora(model, options, seed=seed)
    return model


# --------------------------------------------------------------------------- fast tier


@pytest.mark.parametrize(
    "overrides, key, words",
    [
        (["peft.targets=[nope]"], "peft.targets=nope", ["matches no linear layer", "allowed"]),
        (["peft.r=0"], "peft.r=0", ["at least 1"]),
        (["peft.r=200"], "peft.r=200", ["exceeds layer", "1..128"]),
        (["peft.trainable=[xyz]"], "peft.trainable=xyz", ["matches no module"]),
        # adapters on fused experts (peft.targets=[experts])
        (["peft.targets=[experts]"], "peft.targets=experts", ["no mixture-of-experts layers"]),
        (
            [*MOE, "peft.targets=[experts]", "peft.dropout=0.1"],
            "peft.dropout=0.1",
            ["leaves no input to drop"],
        ),
        ([*MOE, "peft.targets=[experts]", "peft.r=40"], "peft.r=40", ["exceeds the experts' w2", "1..32"]),
        (
            [*MOE, "peft=qlora", "peft.targets=[experts]"],
            "peft.targets=experts",
            ["NF4, not the fused experts"],
        ),
        (["tp=2", "peft=qlora"], "tp > 1", ["NF4 base is sharded by FSDP2 alone", "tp=1"]),
        (["strategy=model_parallel", *LM], "strategy=model_parallel", ["peft=lora needs fsdp-train"]),
        (LM, "peft=lora", ["builds its layers in its own configure_model"]),
        (["strategy=fsdp", "devices=1"], "strategy.use_orig_params", ["unsharded FSDP1"]),
    ],
)
def test_bad_lora_input_is_one_line_exit_2_before_launch(
    tmp_path: Path, overrides: list[str], key: str, words: list[str]
) -> None:
    result = cli_in_process(["peft=lora", "devices=2", *overrides], tmp_path / "run", env=CPU)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("fsdp-train: error: ") and key in lines[0], lines[0]
    for word in words:
        assert word in lines[0], (word, lines[0])


def test_only_adapters_and_named_modules_train_and_the_start_equals_the_base() -> None:
    options = AdapterOptions(name=AdapterMethod.lora, r=4, trainable=["norms"])
    model, base = lora_llama(options), Llama(TINY, seed=3)
    trains = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trains and all(".lora_" in n or "norm" in n for n in trains), trains
    assert sum(".lora_A." in n for n in trains) == 2 * 7  # every linear layer of both blocks
    ids = torch.randint(0, TINY.vocab_size, (2, 8))
    assert torch.equal(model(ids), base(ids))  # lora_B = 0 and the base keeps its own init
    model(ids).sum().backward()
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert all(model.get_parameter(n).grad is None for n in frozen)


def test_the_optimizer_holds_the_trainable_parameters_only() -> None:
    from fsdp_cli.models.args import OptimizerArgs
    from fsdp_cli.models.causal_lm import CausalLMModule

    module = CausalLMModule(lora_llama, optim=OptimizerArgs(), max_steps=4)
    module.configure_model()
    optimizer = module.configure_optimizers()["optimizer"]
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert held == {id(p) for p in module.parameters() if p.requires_grad}


def test_adapters_built_on_meta_and_filled_later_equal_adapters_built_whole() -> None:
    whole = lora_llama()
    with torch.device("meta"):
        meta = Llama(TINY, seed=3)
    apply_lora(meta, LORA, seed=3)
    meta.to_empty(device="cpu")
    meta.init_weights()  # what FSDP2 calls once each rank holds its shards
    for (name, a), (_, b) in zip(whole.state_dict().items(), meta.state_dict().items()):
        assert torch.equal(a, b), name
    assert any(
        n.endswith("lora_A.default.weight") and t.abs().sum() > 0 for n, t in meta.state_dict().items()
    )


def test_a_plain_module_takes_targets_by_name_and_aliases() -> None:
    from tests.assets.custom_models import TinyLM

    model = TinyLM(vocab_size=32, hidden=16, layers=2)
    named = adapter_layers(model, AdapterOptions(name=AdapterMethod.lora, r=2, targets=["mlp.2"]))
    assert named == ["blocks.0.mlp.2", "blocks.1.mlp.2"], named
    every = adapter_layers(model, AdapterOptions(name=AdapterMethod.lora, r=2, targets=["all"]))
    assert "head" not in every and len(every) == 4, every


@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp", "ddp"])
def test_the_plan_gives_gradients_and_optimizer_state_to_the_adapters_only(strategy: str) -> None:
    from fsdp_cli.plan.check import model_spec
    from fsdp_cli.plan.memory import plan_memory

    plans = {}
    for peft in ("none", "lora"):
        run = run_of(composed(f"strategy={strategy}", "devices=2", f"peft={peft}", "precision=32-true"))
        plans[peft] = plan_memory(run, model_spec(run)).ranks[0]
        spec = model_spec(run)
    trainable = sum(p.numel for p in spec.params if p.trainable)
    assert plans["lora"].params >= plans["none"].params
    assert 0 < plans["lora"].grads <= trainable * 4 < plans["none"].grads / 5
    assert 0 < plans["lora"].optimizer < plans["none"].optimizer / 5


def test_fsdp1_puts_trainable_leaves_in_units_of_their_own() -> None:
    from fsdp_cli.models.llama import TransformerBlock
    from fsdp_cli.strategies.fsdp1 import trainable_apart_policy

    model = lora_llama()
    wrap = trainable_apart_policy({TransformerBlock})._lambda_fn
    units = {n for n, m in model.named_modules() if wrap(m)}
    assert "layers.0" in units and "layers.0.attention.wq.lora_A.default" in units
    assert "layers.0.attention.wq.base_layer" not in units and "layers.0.attention_norm" not in units


def _bf16_true_lora(
    adapter_dtype: AdapterDtype = AdapterDtype.float32, *, built_in_bf16: bool = True
) -> torch.nn.Module:
    """The tiny LoRA Llama as a bf16-true run builds it: under the plugin's bf16 default dtype
    (or in fp32, as a Hugging Face model is), then converted by the plugin (what every strategy's
    setup does)."""
    from contextlib import nullcontext

    from fsdp_cli.builders.precision import AdapterHalfPrecision

    plugin = AdapterHalfPrecision("bf16-true")
    options = AdapterOptions(
        name=AdapterMethod.lora, r=4, alpha=8.0, trainable=["norms"], adapter_dtype=adapter_dtype
    )
    with plugin.module_init_context() if built_in_bf16 else nullcontext():
        model = lora_llama(options)
    return plugin.convert_module(model)


@pytest.mark.parametrize("built_in_bf16", [True, False], ids=["built-bf16", "built-fp32-like-hf"])
def test_bf16_true_stores_and_updates_the_adapters_in_fp32_over_a_bf16_base(built_in_bf16: bool) -> None:
    model = _bf16_true_lora(built_in_bf16=built_in_bf16)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    trained = [p for p in model.parameters() if p.requires_grad]
    assert {p.dtype for p in trained} == {torch.float32}
    assert {v.dtype for v in frozen.values()} == {torch.bfloat16}
    assert any("norm" in n for n, p in model.named_parameters() if p.requires_grad)
    optimizer = torch.optim.AdamW(trained, lr=1e-2)
    ids = torch.randint(0, TINY.vocab_size, (4, 17), generator=torch.Generator().manual_seed(0))
    seen = []
    for _ in range(8):
        logits = model(ids[:, :-1])
        assert logits.dtype == torch.bfloat16  # the head (frozen) computes in the base's dtype
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        assert {p.grad.dtype for p in trained} == {torch.float32}
        optimizer.step()
        optimizer.zero_grad()
        seen.append(loss.item())
    moments = {v.dtype for state in optimizer.state.values() for k, v in state.items() if k != "step"}
    assert moments == {torch.float32}
    assert all(torch.isfinite(torch.tensor(seen))) and seen == sorted(seen, reverse=True), seen
    assert seen[-1] < seen[0] - 0.1, seen
    for name, value in frozen.items():
        assert torch.equal(model.get_parameter(name), value), name


def test_adapter_dtype_same_keeps_the_adapters_in_the_bases_dtype() -> None:
    model = _bf16_true_lora(AdapterDtype.same)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp", "ddp"])
def test_the_plan_of_fp32_adapters_over_a_bf16_base_equals_the_rehearsal(strategy: str) -> None:
    from fsdp_cli.plan.check import model_spec
    from fsdp_cli.plan.memory import plan_memory
    from fsdp_cli.plan.rehearsal import rehearse

    held = {}
    for adapter_dtype in ("float32", "same"):
        args = [f"strategy={strategy}", "devices=2", "peft=lora", "peft.r=4", "precision=bf16-true"]
        run = run_of(composed(*args, "peft.trainable=[norms]", f"peft.adapter_dtype={adapter_dtype}"))
        plan = plan_memory(run, model_spec(run)).ranks[0]
        rehearsed = rehearse(run, 0, step=False).held_bytes
        assert (plan.params, plan.grads, plan.optimizer) == (
            rehearsed.params,
            rehearsed.grads,
            rehearsed.optimizer,
        ), adapter_dtype
        held[adapter_dtype] = rehearsed
    # fp32 adapters: their parameters, gradients and moments take twice the bytes of bf16 ones.
    assert held["float32"].grads == 2 * held["same"].grads
    assert held["float32"].optimizer - 4 * 200 <= 2 * held["same"].optimizer
    assert held["float32"].params - held["same"].params == held["same"].grads


@pytest.mark.parametrize(
    "layout", [["tp=2", "strategy.sequence_parallel=true"], ["pp=2"]], ids=["tp2", "pp2"]
)
def test_the_plan_of_lora_under_tp_and_pp_equals_the_rehearsal(layout: list[str]) -> None:
    """Each rank's parameters, gradients and optimizer state: adapters laid out as the layers they
    wrap (tp), or in the stage holding their layer (pp); the norms train."""
    from fsdp_cli.plan.check import model_spec
    from fsdp_cli.plan.memory import plan_memory
    from fsdp_cli.plan.rehearsal import rehearse

    args = ["strategy=fsdp2", "devices=2", "peft=lora", "peft.r=4", "precision=bf16-true", *layout]
    run = run_of(composed(*args, "peft.trainable=[norms]"))
    plans = plan_memory(run, model_spec(run)).ranks
    for rank in (0, 1):
        rehearsed = rehearse(run, rank, step=False).held_bytes
        planned = plans[rank]
        assert (planned.params, planned.grads, planned.optimizer) == (
            rehearsed.params,
            rehearsed.grads,
            rehearsed.optimizer,
        ), rank


def test_fsdp1_units_of_a_bf16_true_lora_run_compute_and_reduce_in_their_own_dtype() -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from fsdp_cli.plan.fake_rank import built_rank
    from fsdp_cli.plan.fake_world import FakeWorld, fake_process_group

    run = run_of(composed("strategy=fsdp", "devices=2", "peft=lora", "peft.r=4", "precision=bf16-true"))
    world = FakeWorld(num_nodes=1, per_node=2, rank=0)
    with fake_process_group(world), built_rank(run, world) as built:
        units = [m for m in built.strategy.model.modules() if isinstance(m, FSDP)]
        # (Lightning's bf16-true policy would gather and reduce the fp32 adapters in bf16.)
        policies = {(u.mixed_precision.param_dtype, u.mixed_precision.reduce_dtype) for u in units}
        dtypes = {n: p.dtype for n, p in built.module.named_parameters()}
    assert len(units) > 2 and policies == {(None, None)}, policies
    assert {d for n, d in dtypes.items() if ".lora_" in n} == {torch.float32}
    assert {d for n, d in dtypes.items() if ".lora_" not in n} == {torch.bfloat16}


# --------------------------------------------------------------------------- real runs

LORA_RUN = [
    *FAST,
    "trainer.max_steps=8",
    "peft=lora",
    "peft.r=4",
    "precision=32-true",
    "accelerator=cpu",
    "seed=11",
    "checkpoint.every_n_steps=4",
]
LAYOUTS = {
    "single": ["strategy=ddp", "devices=1"],
    "fsdp2": ["strategy=fsdp2", "devices=2", "peft.save_base=true"],
    "fsdp": ["strategy=fsdp", "devices=2"],
    "ddp": ["strategy=ddp", "devices=2"],
    # Adapters laid out as the layers they wrap; and in the stages that hold their layers.
    "tp": ["strategy=fsdp2", "devices=2", "tp=2", "strategy.sequence_parallel=true"],
    "pp": ["strategy=fsdp2", "devices=2", "pp=2"],
}


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    out = {}
    for name, args in LAYOUTS.items():
        out[name] = root / name
        assert_ok(run_cli([*args, *LORA_RUN], out[name]), out[name])
    return out


def _relative_gap(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) >= 4
    return max(abs(x - y) / abs(x) for x, y in zip(a, b))


def _ckpt(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step_{step:08d}"


def _config(run: Path) -> Any:
    from fsdp_cli.config.convert import load_train_config

    return load_train_config(run / "config.yaml")


@pytest.mark.distributed
def test_lora_losses_equal_one_process_under_fsdp2_fsdp_and_ddp(lora_runs: dict[str, Path]) -> None:
    """And under tensor and pipeline parallel (FSDP2 at tp=2, at pp=2): the adapters' gradients at
    tp are the float64 check's (tests/context_parallel_check.py, llama_lora)."""
    reference = losses(lora_runs["single"])
    assert len(reference) == 8
    for name in ("fsdp2", "fsdp", "ddp", "tp", "pp"):
        assert _relative_gap(reference, losses(lora_runs[name])) < 1e-5, name


@pytest.mark.distributed
def test_held_bytes_count_gradients_and_optimizer_state_of_the_adapters_only(
    lora_runs: dict[str, Path],
) -> None:
    cfg = _config(lora_runs["ddp"])
    model = Llama(cfg.model, seed=cfg.seed)
    apply_lora(model, cfg.peft, seed=cfg.seed)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    everything = sum(p.numel() for p in model.parameters())
    setup = read_summary(lora_runs["ddp"])["setup"]
    assert setup["trainable"] == {
        "parameters": trainable,
        "of": everything,
        "dtype": ["float32"],
        "frozen_dtype": ["float32"],
    }
    # (torch's SequenceParallel thaws the norms it replicates: they stay frozen at tp=2)
    assert read_summary(lora_runs["tp"])["setup"]["trainable"]["parameters"] == trainable
    ddp = setup["held_bytes"][0]
    assert ddp["grads"] == 4 * trainable and ddp["params"] == 4 * everything
    for name in ("fsdp2", "fsdp"):  # sharded over 2 ranks (+ padding)
        held = read_summary(lora_runs[name])["setup"]["held_bytes"][0]
        assert 2 * trainable <= held["grads"] <= 2 * trainable * 1.1, (name, held)
        assert held["optimizer"] <= 2 * held["grads"] + 4 * 200, (name, held)


@pytest.mark.distributed
def test_frozen_weights_are_bitwise_unchanged_in_the_saved_checkpoint(lora_runs: dict[str, Path]) -> None:
    from fsdp_cli.checkpoint.convert import load

    cfg = _config(lora_runs["fsdp2"])
    start = Llama(cfg.model, seed=cfg.seed).state_dict()
    saved = load(_ckpt(lora_runs["fsdp2"], 8), weights_only_model=True).state_dict
    base = {k[len("model.") :].replace(".base_layer.", "."): v for k, v in saved.items() if ".lora_" not in k}
    assert set(base) == set(start)
    for name, value in base.items():
        assert torch.equal(value, start[name]), name
    # Without peft.save_base the checkpoint holds the adapters alone.
    only = load(_ckpt(lora_runs["ddp"], 8), weights_only_model=True).state_dict
    assert only and all(".lora_" in k for k in only), sorted(only)[:4]


@pytest.mark.distributed
def test_a_bf16_true_run_trains_fp32_adapters_over_a_bf16_base_left_bitwise_unchanged(tmp_path: Path) -> None:
    from fsdp_cli.checkpoint.convert import load

    run_dir = tmp_path / "bf16"
    args = [a for a in LORA_RUN if not a.startswith("precision=")]
    result = run_cli(
        ["strategy=fsdp2", "devices=2", *args, "precision=bf16-true", "peft.save_base=true"], run_dir
    )
    setup = assert_ok(result, run_dir)["setup"]
    assert (setup["trainable"]["dtype"], setup["trainable"]["frozen_dtype"]) == (["float32"], ["bfloat16"])
    assert "| stored float32, frozen bfloat16" in result.stdout + result.stderr
    assert setup["dtypes"]["reduce"] == "float32" and setup["dtypes"]["optimizer_state"] == ["float32"]
    assert len(losses(run_dir)) == 8 and all(torch.isfinite(torch.tensor(losses(run_dir))))
    cfg = _config(run_dir)
    start = Llama(cfg.model, seed=cfg.seed).to(torch.bfloat16).state_dict()
    saved = load(_ckpt(run_dir, 8), weights_only_model=True).state_dict
    adapters = {k: v for k, v in saved.items() if ".lora_" in k}
    assert adapters and {v.dtype for v in adapters.values()} == {torch.float32}
    base = {k[len("model.") :].replace(".base_layer.", "."): v for k, v in saved.items() if ".lora_" not in k}
    assert set(base) == set(start)
    for name, value in base.items():
        assert value.dtype == torch.bfloat16 and torch.equal(value, start[name]), name


@pytest.mark.distributed
def test_resume_is_exact_at_another_layout(lora_runs: dict[str, Path], tmp_path: Path) -> None:
    run_dir = tmp_path / "resumed"
    ckpt = _ckpt(lora_runs["fsdp"], 4)
    assert_ok(run_cli(["strategy=fsdp2", "devices=2", *LORA_RUN, f"resume={ckpt}"], run_dir), run_dir)
    assert _relative_gap(losses(lora_runs["single"])[4:], losses(run_dir)) < 1e-5


@pytest.mark.distributed
def test_a_pipelined_lora_checkpoint_resumes_under_ddp_on_one_process(
    lora_runs: dict[str, Path], tmp_path: Path
) -> None:
    """pp=2's adapters-only save (each stage's adapters) read back whole by DDP, frozen base rebuilt."""
    run_dir = tmp_path / "resumed"
    ckpt = _ckpt(lora_runs["pp"], 4)
    assert_ok(run_cli(["strategy=ddp", "devices=1", *LORA_RUN, f"resume={ckpt}"], run_dir), run_dir)
    assert _relative_gap(losses(lora_runs["single"])[4:], losses(run_dir)) < 1e-5


@pytest.mark.distributed
@pytest.mark.parametrize("full_run", ["fsdp2", "fsdp"], ids=["from-sharded", "from-full-file"])
def test_lora_on_a_full_fine_tune_starts_new_adapters_on_its_weights(
    layout_run: Any, full_run: str, tmp_path: Path
) -> None:
    """``peft=lora resume=FULL``: a new run (step 0, its own run id) whose frozen base is the full
    fine-tune's checkpoint, bit for bit (read into FSDP2's shards from a sharded save and from a
    full file). From the sharded one, the run saves adapters only and is resumed at step 1: the
    base is read from the full fine-tune again (its save holds none), and step 2 is the
    uninterrupted run's."""
    from conftest import PARITY

    from fsdp_cli.checkpoint.convert import load

    full = _ckpt(layout_run(full_run), 6)
    full = full if full.exists() else full.with_suffix(".pt")
    args = [*PARITY, "strategy=fsdp2", "devices=2", "peft=lora", "peft.r=4", "trainer.max_steps=2"]
    first, last = tmp_path / "lora", tmp_path / "resumed"
    adapters_only = full_run == "fsdp2"
    saves = (
        ["checkpoint.every_n_steps=1"]
        if adapters_only
        else ["peft.save_base=true", "checkpoint.every_n_steps=2"]
    )
    result = run_cli([*args, *saves, f"resume={full}"], first)
    assert_ok(result, first)
    assert f"resume={full} is a full fine-tune (step 6)" in result.stderr and "from step 0" in result.stderr
    checked = first
    if adapters_only:
        again = run_cli(
            [*args, "peft.save_base=true", "checkpoint.every_n_steps=2", f"resume={_ckpt(first, 1)}"], last
        )
        assert_ok(again, last)
        assert f"the frozen base is read from {full} again" in again.stderr, again.stderr
        (straight,), resumed = losses(first)[1:], losses(last)
        assert len(resumed) == 1 and abs(resumed[0] - straight) <= 1e-5 * abs(straight), (straight, resumed)
        checked = last
    saved = load(_ckpt(checked, 2), weights_only_model=True).state_dict
    base = {k.replace(".base_layer.", "."): v for k, v in saved.items() if ".lora_" not in k}
    expected = load(full, weights_only_model=True).state_dict
    assert set(base) == set(expected)
    for name, value in expected.items():
        assert torch.equal(base[name], value), name
    refused = cli_in_process([*args, f"resume={_ckpt(checked, 2)}", "peft.r=8"], tmp_path / "r8", env=CPU)
    assert refused.returncode == 2 and "saved with peft.r=4" in refused.stderr, refused.stderr
    full_again = cli_in_process(
        [*PARITY, "devices=2", f"resume={_ckpt(checked, 2)}"], tmp_path / "none", env=CPU
    )
    assert full_again.returncode == 2, full_again.stderr
    assert "holds peft=lora adapters" in full_again.stderr and "(peft=none)" in full_again.stderr


def _trained_model(run: Path) -> Llama:
    from fsdp_cli.checkpoint.convert import load

    cfg = _config(run)
    model = Llama(cfg.model, seed=cfg.seed)
    apply_lora(model, cfg.peft, seed=cfg.seed)
    state = load(_ckpt(run, 8), weights_only_model=True).state_dict
    missing, unexpected = model.load_state_dict(
        {k[len("model.") :]: v for k, v in state.items()}, strict=False
    )
    assert not unexpected and not [m for m in missing if ".lora_" in m]
    return model.eval()


@pytest.mark.distributed
def test_peft_export_loads_in_peft_with_the_runs_logits(lora_runs: dict[str, Path], tmp_path: Path) -> None:
    from peft import PeftModel

    out = tmp_path / "adapter"
    # (the tp=2 run's: adapters saved as DTensors over the tensor-parallel ranks, exported whole)
    result = run_cli(["convert", str(_ckpt(lora_runs["tp"], 8)), str(out), "--to", "peft"], prog="fsdp-ckpt")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""  # nothing of what torchao and torch log as peft imports them
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 4
    cfg = _config(lora_runs["ddp"])
    loaded = PeftModel.from_pretrained(Llama(cfg.model, seed=cfg.seed), str(out)).eval()
    # The names PEFT itself saves for this model, no more, no fewer.
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file

    assert set(load_file(str(out / "adapter_model.safetensors"))) == set(get_peft_model_state_dict(loaded))
    ids = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs, base = (
            _trained_model(lora_runs["tp"])(ids),
            loaded(ids),
            Llama(cfg.model, seed=cfg.seed)(ids),
        )
    assert (ours - theirs).abs().max() <= 1e-5 * ours.abs().max()
    assert (ours - base).abs().max() > 1e-3  # the adapters trained


@pytest.mark.distributed
def test_peft_export_of_a_run_without_adapters_is_one_line_exit_2(layout_run: Any, tmp_path: Path) -> None:
    full = _ckpt(layout_run("single"), 6)  # the shared full fine-tune
    result = cli_in_process(["convert", str(full), str(tmp_path / "a"), "--to", "peft"], prog="fsdp-ckpt")
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1 and "peft=none" in lines[0], result.stderr
    assert not (tmp_path / "a").exists()


@pytest.mark.distributed
def test_hf_lora_exports_load_in_peft_and_transformers_with_the_runs_logits(tmp_path: Path) -> None:
    from peft import PeftModel
    from test_hf import save_llama, write_token_stream
    from transformers import AutoModelForCausalLM

    from fsdp_cli.checkpoint.convert import load
    from fsdp_cli.models.hf import build_hf_model

    folder, tokens, run = (
        save_llama(tmp_path / "llama", tie=True),  # tied, as most small models are
        write_token_stream(tmp_path / "t.bin", 257),
        tmp_path / "run",
    )
    args = [
        "model=hf",
        f"model.path={folder}",
        "data=tokens",
        f"data.path={tokens}",
        "peft.trainable=[norms]",
    ]
    assert_ok(
        run_cli([*args, "strategy=fsdp2", "devices=2", *LORA_RUN[:-1], "trainer.max_steps=4"], run), run
    )
    ckpt = _ckpt(run, 4)
    for to in (["--to", "peft"], ["--to", "hf", "--merge"]):
        result = cli_in_process(["convert", str(ckpt), str(tmp_path / to[1]), *to], prog="fsdp-ckpt")
        assert result.returncode == 0, result.stderr
    cfg = _config(run)
    ours = build_hf_model(cfg.model, seed=cfg.seed)
    ours.materialize("cpu")  # the folder's weights, as DDP fills them
    apply_lora(ours, cfg.peft, seed=cfg.seed)
    state = load(ckpt, weights_only_model=True).state_dict
    # What trained is saved and exported: the adapters and the norms, not the frozen tied head.
    assert not [k for k in state if "lm_head" in k or "embed_tokens" in k], sorted(state)
    exported = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())["modules_to_save"]
    assert exported and all("norm" in m for m in exported), exported
    missing, unexpected = ours.load_state_dict(
        {k[len("model.") :]: v for k, v in state.items()}, strict=False
    )
    assert not unexpected and not [m for m in missing if ".lora_" in m or "norm" in m]
    peft_model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(folder), str(tmp_path / "peft")
    )
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    ids = torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ours.eval()(ids)
        for model in (peft_model, merged):
            got = model.eval()(ids).logits
            assert (got - expected).abs().max() <= 1e-5 * expected.abs().max(), type(model).__name__
        assert (AutoModelForCausalLM.from_pretrained(folder)(ids).logits - expected).abs().max() > 1e-3


def test_the_experts_pairs_are_stored_in_fp32_over_a_bf16_base() -> None:
    """``peft.targets=[experts]`` under bf16-true with ``peft.adapter_dtype=float32`` (the default):
    the pairs beside the fused experts are stored in fp32 like the linear adapters, the experts
    themselves bf16, and the precision plugin's conversion keeps them so (they were bf16: trainable
    tensors of a frozen module, which is no trainable leaf); the adapted weight is the base's dtype."""
    import dataclasses

    from fsdp_cli.adapters.dtype import convert_all_but_trainable_leaves

    moe = dataclasses.replace(TINY, n_experts=4, experts_per_token=2, moe_hidden_dim=32)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # (as Lightning builds the model under bf16-true)
    try:
        model = Llama(moe, seed=3)
    finally:
        torch.set_default_dtype(previous)
    options = AdapterOptions(name=AdapterMethod.lora, r=4, targets=["attention", "experts"])
    apply_lora(model, options, seed=3)
    convert_all_but_trainable_leaves(model, torch.bfloat16)
    experts = model.expert_modules()[0]
    assert experts.w13.dtype == torch.bfloat16 and not experts.w13.requires_grad
    pairs = [getattr(experts, n) for n in experts.expert_adapters.parameter_names()]
    assert len(pairs) == 4 and all(p.dtype == torch.float32 and p.requires_grad for p in pairs)
    trained = {p.dtype for p in model.parameters() if p.requires_grad}
    assert trained == {torch.float32}, trained
    adapted = experts.expert_adapters.adapted(dict(experts.named_parameters(recurse=False)))
    assert adapted["w13"].dtype == torch.bfloat16
