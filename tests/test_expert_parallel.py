"""Expert parallel (``ep``): each MoE layer's experts split over ep of the data-parallel ranks,
tokens routed all-to-all (fsdp_cli/parallel/expert_parallel.py).

The library's layouts against one process, losses and gradients (Qwen3-MoE in float64 at ep=2 on
2 and 4 ranks, HSDP and ep=4; Mixtral and OLMoE in float32), the two traps measured (routing
statistics per rank, expert gradients not divided by ep) and a DCP round trip to ep=1
(tests/expert_parallel_check.py); fsdp-train at ep=2 on HSDP with packed chat data, bf16, float8,
activation checkpointing and offload against one process, its checkpoint resumed at ep=1 and
exported in the hub's layout (one tensor per expert) that transformers loads; hub-format folders
read as transformers reads them; the load-balancing loss as transformers computes it; the layouts
that cannot run, refused before launch in one line."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import (
    assert_ok,
    cli_in_process,
    grad_norms,
    losses,
    read_metrics,
    read_summary,
    relative_gap,
    run_cli,
    torchrun_rows,
)
from expert_parallel_check import moe_folder
from harness import REPO

CPU = {"CUDA_VISIBLE_DEVICES": ""}
CHECK = REPO / "tests" / "expert_parallel_check.py"
BF16_TOLERANCE = 0.02
"""Relative, per step, between a bf16-mixed layout and one bf16-mixed process (as test_composition's)."""


# --------------------------------------------------------------------------- sizes and parts


def test_ep_is_borrowed_from_the_shard_dimension_of_the_mesh() -> None:
    from fsdp_cli.errors import ConfigError
    from fsdp_cli.parallel.dims import CP, DP_REPLICATE, EP, EXPERT_SHARD, PP, TP, ParallelDims

    dims = ParallelDims.resolve(world_size=8, replicate=2, ep=2)
    assert (dims.dp_replicate, dims.dp_shard, dims.ep) == (2, 4, 2)
    assert dims.mesh_sizes() == {PP: 1, DP_REPLICATE: 2, EXPERT_SHARD: 2, EP: 2, CP: 1, TP: 1}
    assert dims.world_size == 8
    with pytest.raises(ConfigError) as error:
        ParallelDims.resolve(world_size=8, replicate=2, ep=8)
    assert error.value.key == "ep" and "shard size 4" in str(error.value)


def test_the_balance_loss_is_transformers_own_at_one_process() -> None:
    """At one process the load-balancing loss is transformers' (its float32 sums)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from fsdp_cli.parallel.expert_parallel import balance_loss

    gen = torch.Generator().manual_seed(0)
    logits = tuple(torch.randn(24, 6, generator=gen) for _ in range(3))
    ours, stats = balance_loss(logits, 6, 2)
    theirs = load_balancing_loss_func(logits, 6, 2)
    assert torch.allclose(ours, theirs, rtol=1e-6), (ours, theirs)
    assert torch.allclose(stats.loss, theirs, rtol=1e-6)
    assert int(stats.tokens.sum()) == 3 * 24 * 2  # every layer's top-2 assignments
    loads = stats.loads()
    assert loads["moe_tokens_min"] <= 24 * 2 / 6 <= loads["moe_tokens_max"] and loads["moe_imbalance"] >= 1


def test_the_routing_bias_chooses_experts_weighs_nothing_and_moves_towards_balance() -> None:
    """Auxiliary-loss-free balancing (model.balance_bias_rate): the bias decides which experts a
    token goes to, its gates stay the router's own probabilities (renormalised over the chosen);
    after a step every expert's bias moves by the rate, down where it got more tokens than the
    mean, up where fewer; the counts are consumed (the next update starts from none)."""
    from fsdp_cli.models.args import LlamaArgs, OptimizerArgs
    from fsdp_cli.models.causal_lm import CausalLMModule
    from fsdp_cli.models.llama import Llama, MoE

    cfg = LlamaArgs(vocab_size=32, dim=16, n_layers=1, n_heads=2, n_experts=4, experts_per_token=2)
    cfg = dataclasses.replace(cfg, moe_hidden_dim=8, aux_loss_coef=0.0, balance_bias_rate=0.1)
    model = Llama(cfg, seed=0).train()
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    assert moe.expert_bias is not None and "layers.0.feed_forward.expert_bias" in model.state_dict()
    seen: dict[str, torch.Tensor] = {}
    forward = moe.experts.forward
    moe.experts.forward = lambda flat, index, weights: (
        seen.update(flat=flat, weights=weights) or forward(flat, index, weights)
    )
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        moe.expert_bias.copy_(torch.tensor([0.0, 0.0, 5.0, 5.0]))  # experts 2 and 3 for every token
        model(ids)
        assert torch.equal(moe.chosen.sort(dim=-1).values, torch.tensor([[2, 3]]).expand(16, 2))
        probs = torch.softmax(moe.router(seen["flat"]), dim=-1)
        gates = probs.gather(-1, moe.chosen)
        assert torch.allclose(seen["weights"], gates / gates.sum(dim=-1, keepdim=True))
    # The LightningModule's optimizer step moves it (what fsdp-train runs after each step).
    module = CausalLMModule(lambda: model, OptimizerArgs(), max_steps=1)
    module.configure_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    module.optimizer_step(0, 0, optimizer, lambda: None)
    assert torch.allclose(moe.expert_bias, torch.tensor([0.1, 0.1, 4.9, 4.9]))
    module.optimizer_step(0, 1, optimizer, lambda: None)  # nothing counted since: unchanged
    assert torch.allclose(moe.expert_bias, torch.tensor([0.1, 0.1, 4.9, 4.9]))


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_a_hub_layout_moe_folder_loads_as_transformers_loads_it(family: str, tmp_path: Path) -> None:
    """One tensor per expert in the files, fused in the model: each fused tensor filled from its
    experts' tensors (Mixtral's renamed ones too), bit for bit as ``from_pretrained``."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from fsdp_cli.models.args import HFModelArgs
    from fsdp_cli.models.hf import build_hf_model

    folder = moe_folder(tmp_path / family, family)
    with safe_open(str(folder / "model.safetensors"), "pt") as reader:
        assert any(".experts.3." in key for key in reader.keys())  # the hub's layout
    theirs = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ours = build_hf_model(HFModelArgs(path=str(folder)), seed=0)
    ours.to_empty(device="cpu")
    ours.init_weights()
    mine = dict(ours.hf.named_parameters())
    for name, param in theirs.named_parameters():
        assert torch.equal(mine[name], param), name


def test_a_lora_run_on_a_hub_layout_moe_merges_into_its_fused_experts(tmp_path: Path) -> None:
    """``--to hf --merge`` of a LoRA run whose checkpoint holds the adapters only reads the frozen
    base from the model folder: a MoE folder in the hub's layout (one tensor per expert) is fused
    as the model holds it (it stopped with "does not hold a Qwen3MoeForCausalLM ... missing
    mlp.experts.gate_up_proj"), the adapted layer merged to W + alpha/r B A, the experts the
    folder's own; written back in the hub's layout, every key of the folder."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from fsdp_cli.checkpoint.hf_export import hf_weights
    from fsdp_cli.checkpoint.peft_export import merged

    folder = moe_folder(tmp_path / "qwen3_moe")
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    q = "model.layers.0.self_attn.q_proj"
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(4, 16, generator=gen), torch.randn(base[f"{q}.weight"].shape[0], 4, generator=gen)
    adapters = {f"model.hf.{q}.lora_A.default.weight": a, f"model.hf.{q}.lora_B.default.weight": b}
    manifest = {"config": {"peft": {"name": "lora", "r": 4, "alpha": 8.0}}}
    out = merged(adapters, manifest, folder)
    assert set(out) == {f"model.hf.{k}" for k in base}
    assert torch.allclose(out[f"model.hf.{q}.weight"], base[f"{q}.weight"] + 2.0 * b @ a, atol=1e-6)
    for key, tensor in base.items():
        if key != f"{q}.weight":
            assert torch.equal(out[f"model.hf.{key}"], tensor), key
    with safe_open(str(folder / "model.safetensors"), "pt") as original:
        assert sorted(hf_weights(out, folder)) == sorted(original.keys())


def test_lora_on_a_full_fine_tune_reads_every_tensor_but_the_experts_adapters() -> None:
    """``peft=lora resume=<a full fine-tune>`` fills the model's tensors from the checkpoint, all
    but its adapters: the pairs beside fused experts are adapters too (taken for base tensors,
    the run stopped: "the checkpoint lacks ...experts.down_proj_lora_A ...")."""
    from fsdp_cli.checkpoint.start_from import is_adapter

    experts = "model.hf.model.layers.0.mlp.experts"
    assert is_adapter(f"{experts}.gate_up_proj_lora_A") and is_adapter(f"{experts}.down_proj_lora_B")
    assert is_adapter("model.hf.model.layers.0.self_attn.q_proj.lora_A.default.weight")
    assert not is_adapter(f"{experts}.gate_up_proj") and not is_adapter("model.hf.lm_head.weight")


def test_a_model_hf_under_float8_is_filled_like_without_it(tmp_path: Path) -> None:
    """float8 swaps each block's nn.Linear for a new Float8Linear before the weights are read:
    the swapped layers get the folder's weights too (they were left as ``to_empty`` made them,
    and the run went non-finite at step 1)."""
    from fsdp_cli.models.args import HFModelArgs
    from fsdp_cli.models.hf import build_hf_model
    from fsdp_cli.parallel.float8 import apply_float8

    folder = moe_folder(tmp_path / "moe")
    plain, swapped = (build_hf_model(HFModelArgs(path=str(folder)), seed=0) for _ in range(2))
    assert apply_float8(swapped, emulate=True) > 0
    for model in (plain, swapped):
        model.to_empty(device="cpu")
        model.init_weights()
    mine = dict(swapped.named_parameters())
    for name, param in plain.named_parameters():
        assert torch.equal(mine[name], param), name


def test_flops_of_a_mixture_of_experts_count_the_active_experts(tmp_path: Path) -> None:
    """tokens/s -> TFLOP/s and MFU for a MoE: 6 x (the dense matmul weights + each layer's experts
    x top-k / experts) + 12 L d T per token; counting every expert would overstate it."""
    from fsdp_cli.models.args import HFModelArgs
    from fsdp_cli.models.flops import active_flops_per_token
    from fsdp_cli.models.hf import build_hf_model

    folder = moe_folder(tmp_path / "moe", weights=False)

    def build():
        return build_hf_model(HFModelArgs(path=str(folder), pretrained=False), seed=0)

    model = build()
    experts = sum(p.numel() for m in model.expert_modules() for p in m.parameters())
    dense = sum(p.numel() for p in model.parameters() if p.dim() > 1) - experts - 64 * 16  # (embedding)
    expected = 6.0 * (dense + experts * 2 / 4) + 12.0 * 2 * 16 * 32
    assert active_flops_per_token(build, 32) == pytest.approx(expected)
    assert experts > 0 and active_flops_per_token(build, 32) < 6.0 * (dense + experts) + 12.0 * 2 * 16 * 32


QWEN3_235B_A22B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "moe_intermediate_size": 1536,
    "num_hidden_layers": 94,
    "num_attention_heads": 64,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": False,
    "output_router_logits": True,
}
"""Qwen3-235B-A22B's sizes (its config.json's, as published)."""


def test_the_layout_search_splits_a_long_context_moe_over_cp_and_ep_together() -> None:
    """``fsdp-plan --search`` for the 30B-A3B recipe on 16k-token sequences (one node of 8 GPUs):
    ep beside cp is a candidate (it was tried with tp = cp = pp = 1 only) and fits (cp=4 x ep=2),
    each row the plan of its own layout."""
    args = ["recipe=moe_30b_a3b", "data.seq_len=16384", "model.max_seq_len=16384"]
    result = cli_in_process(
        [*args, "--gpus", "8", "--device-memory", "80GB", "--search", "--json"], prog="fsdp-plan"
    )
    assert result.returncode == 0, result
    rows = [r for r in json.loads(result.stdout) if "skipped" not in r]
    both = [r for r in rows if " cp=4 ep=2 " in f" {r['overrides']} "]
    assert both and any(r["fits"] for r in both), [r["overrides"] for r in rows if r["fits"]]
    assert not any(r["fits"] for r in rows if " cp=" not in f" {r['overrides']}")  # (16k tokens need cp)


@pytest.mark.parametrize(("pp", "cp"), [(1, 1), (4, 1), (1, 2)], ids=["pp1", "pp4", "cp2"])
def test_a_235b_moe_layout_rehearses_at_512_ranks_as_planned(pp: int, cp: int, tmp_path: Path) -> None:
    """Rank 511 of 64 nodes x 8 GPUs at ep=8, built on the fake backend: its mesh place, its held
    bytes as the plan says, and the experts sharded along their rows (128 experts over 8 ep ranks
    leave 16 per rank for 64 shard ranks): about 1.8 GB of bf16-mixed fp32 parameters per rank,
    where sharding the experts along dim 0 would leave every rank one whole expert per layer (7 GB).
    At pp=4 x ep=8 (its last stage: 23 MoE layers, each stage's experts split over its own 8 ep
    ranks, over 16 shard ranks): the stages' shapes found with the experts' value-dependent routing
    left out (meta and fake tensors have no values to route by), held bytes as planned. At cp=2 x
    ep=8 (each sequence split over 2 ranks, the experts sharded over the expert-shard and cp ranks
    together, 32 x 2): the same bytes as at cp=1, where 64 shard ranks share them."""
    from fsdp_cli.plan.rehearsal import HELD

    config = {**QWEN3_235B_A22B, "output_router_logits": pp == 1}  # (no balance loss under pp)
    (tmp_path / "config.json").write_text(json.dumps(config))
    args = [
        "--rehearse",
        "model=hf",
        f"model.path={tmp_path}",
        "model.pretrained=false",
        "num_nodes=64",
        "ep=8",
        f"pp={pp}",
        f"cp={cp}",
        "precision=bf16-mixed",
        "data.seq_len=4096",
        "data.global_batch_size=512",
    ]
    r = cli_in_process([*args, "--gpus", "8", "--rank", "511", "--json"], prog="fsdp-plan")
    assert r.returncode == 0, r
    out = json.loads(r.stdout)
    rehearsal = out["rehearsal"]
    assert (rehearsal["world_size"], rehearsal["rank"]) == (512, 511)
    shard_ranks = 64 // (pp * cp)
    assert rehearsal["mesh_coordinates"] == {
        **({"pipeline_parallel": pp - 1} if pp > 1 else {}),
        "data_parallel_replicate": 0,
        "expert_data_parallel_shard": shard_ranks - 1,
        **({"context_parallel": cp - 1} if cp > 1 else {}),
        "expert_parallel": 7,
        "tensor_parallel": 0,
    }
    layers = 94 if pp == 1 else 23  # (blocks 71-93 on the last of 4 stages)
    assert sum(u.endswith("mlp.experts") for u in rehearsal["fsdp_units"]) == layers
    assert rehearsal["disagreements"] == []
    assert rehearsal["held_bytes"] == {k: out["ranks"][511][k] for k in HELD}
    if pp == 1:  # (cp=2: the experts over 32 x 2 ranks, the rest over 256 x 2)
        assert 1.7e9 < rehearsal["held_bytes"]["params"] < 1.9e9


# --------------------------------------------------------------------------- refused before launch


@pytest.fixture(scope="module")
def moe_configs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("moe-configs")
    mismatch = moe_folder(root / "mismatch")  # weights of 4 experts, a config.json saying 6
    config = json.loads((mismatch / "config.json").read_text())
    (mismatch / "config.json").write_text(json.dumps({**config, "num_experts": 6}))
    return {
        "four": str(moe_folder(root / "four", weights=False)),
        "six": str(moe_folder(root / "six", experts=6, weights=False)),
        "mismatch": str(mismatch),
    }


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["model=tiny", "ep=2", "devices=4"], "ep=2: the model (llama) is not a mixture of experts"),
        (["model.path={four}", "ep=3", "devices=4"], "must divide the data-parallel shard size 4"),
        (["model.path={six}", "ep=4", "devices=4"], "the 6 experts of each MoE layer"),
        (["model.path={four}", "ep=2", "devices=4", "strategy=fsdp"], "ep=2: not with strategy=fsdp"),
        (["model.path={four}", "ep=2", "devices=4", "tp=2"], "ep=2: not with tp > 1"),
        (["model.path={four}", "strategy=ddp", "precision=64-true"], "model.experts_implementation"),
        (["model.path={four}", "pp=2", "devices=2"], "pp=2: the model trains a load-balancing loss"),
        (
            ["model.path={mismatch}", "ep=2"],
            "the checkpoint holds 4 experts per MoE layer, config.json says 6",
        ),
    ],
    ids=[
        "dense",
        "shard",
        "experts",
        "fsdp1",
        "tp",
        "float64-kernel",
        "pp-balance-loss",
        "checkpoint-experts",
    ],
)
def test_an_ep_layout_that_cannot_run_is_one_line_before_launch(
    overrides: list[str], words: str, moe_configs: dict[str, str], tmp_path: Path
) -> None:
    args = [o.format(**moe_configs) for o in overrides]
    if any(a.startswith("model.path") for a in args):
        weights = any("{mismatch}" in o for o in overrides)
        args = ["model=hf", *([] if weights else ["model.pretrained=false"]), *args]
    result = cli_in_process(["accelerator=cpu", *args], tmp_path / "run", env=CPU)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, (args, result.stderr)
    assert words in lines[0], lines[0]


# --------------------------------------------------------------------------- the library's layouts


def check(nproc: int, *args: str) -> list[dict[str, Any]]:
    return torchrun_rows(CHECK, nproc, *args)


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("nproc", "layouts", "families", "ways"),
    [
        (
            2,
            "ep2",
            "qwen3_moe,builtin,builtin_bias,qwen3_moe_lora,qwen3_moe_compiled",
            "right,per_rank_balance,unscaled",
        ),
        (4, "ep2xdp2,ep2xhsdp,ep4", "qwen3_moe,qwen3_moe_2,mixtral,olmoe,builtin,builtin_bias", "right"),
    ],
    ids=["ep2", "ep2xdp2_hsdp_ep4"],
)
def test_expert_parallel_equals_one_process_in_float64(
    nproc: int, layouts: str, families: str, ways: str, tmp_path: Path
) -> None:
    """5 SGD steps of a tiny Qwen3-MoE (4 experts, top-2, load-balancing loss at 0.1; read from
    the hub's layout) in float64 with the eager experts: the per-step losses (balance loss
    included) and whole gradients of ep=2 on 2 ranks, ep=2 x dp=2, ep=2 x HSDP and ep=4 on 4
    equal one process's within 1e-10; with 2 experts at ep=2 x dp=2 (one expert per rank, its rows
    sharded by FSDP2 over 2 ranks) too, and the built-in Llama with 4 experts and a shared one at
    ep=2 on 2 and 4 ranks, with its load-balancing loss and balanced by a routing bias instead
    (auxiliary-loss-free, moved after every step from every rank's token counts); the Qwen3-MoE
    with peft=lora's adapters on its attention at ep=2 (experts frozen, the adapters' gradients
    through the token exchange); the Qwen3-MoE under strategy.compile's per-block torch.compile
    (the token exchange left eager: compiled in the first step, no recompiles) within 1e-5 (its
    router's softmax runs in float32, as transformers writes it, which inductor's kernels round
    otherwise than eager's: 1e-6 measured; the built-in MoE so compiled: 3.4e-14, run by hand as
    family builtin_compiled, left out for the suite's time); Mixtral and
    OLMoE (transformers' default experts kernel, fresh weights) in float32 within 1e-5. Each rank's
    own routing statistics in the balance loss (seen: 3.0), or expert gradients not divided by ep
    (seen: 1.0 — AdamW's losses would hide it), move the gradients by far more than 1e-3. The
    ep=2 x dp=2 model saved with DCP loads at ep=1 bit for bit."""
    rows = check(
        nproc,
        f"--layouts={layouts}",
        f"--families={families}",
        f"--ways={ways}",
        f"--folder={tmp_path}",
        *(["--round-trip"] if nproc == 4 else []),
    )
    first, *others = families.split(",")
    expected = {(layout, first, way) for layout in layouts.split(",") for way in ways.split(",")}
    expected |= {(layouts.split(",")[0], family, "right") for family in others}
    assert {(r["layout"], r["family"], r["way"]) for r in rows} == expected, rows
    for row in rows:
        if row["way"] != "right":
            assert row["grad_gap"] > 1e-3, row
            continue
        exact = ("qwen3_moe", "qwen3_moe_2", "qwen3_moe_lora", "builtin")
        bound = 1e-10 if row["family"] in exact else 1e-5  # (float32 families, float32 ops compiled)
        assert row["loss_gap"] < bound and row["grad_gap"] < bound, row
        if row["family"] == "qwen3_moe_2":
            assert row["expert_placements"].startswith("(Shard(dim=1)"), row
        first, end = row["dynamo"]
        if row["family"].endswith("_compiled"):  # compiled in the first step, never again
            assert first["graphs"] > 0 and end == first, row["dynamo"]
        else:
            assert end["graphs"] == 0, row["dynamo"]
    # The built-in model's peaked routing leaves a rank without any token in some layers: it
    # still takes part in the exchange's backward (it hung before).
    if nproc == 4:
        (builtin,) = [r for r in rows if r["family"] == "builtin"]
        assert builtin["empty_receives"] > 0, builtin
    if nproc == 4:
        assert [r["round_trip_equal"] for r in rows if "round_trip_equal" in r] == [True], rows


# --------------------------------------------------------------------------- fsdp-train


COMMON = [
    "model=hf",
    "data=chat",
    "data.packing=true",
    "data.seq_len=48",
    "data.global_batch_size=8",
    "trainer.max_steps=4",
    "accelerator=cpu",
    "seed=5",
    "precision=bf16-mixed",
    "strategy.float8=true",
]
AC_OFFLOAD = ["strategy.activation_checkpointing=full", "strategy.cpu_offload=true"]


@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """fsdp-train at ep=2 on 4 ranks (HSDP: 2 replicas x 2 shard ranks, each pair splitting the
    experts), one process, and the ep run's step-2 full file resumed at ep=1 on one process."""
    from test_chat_data import CHATML, chats, save_chat_tokenizer, write_chats

    root = tmp_path_factory.mktemp("moe")
    model = moe_folder(root / "model")
    for file in save_chat_tokenizer(root / "tokenizer", CHATML).iterdir():
        shutil.copy(file, model / file.name)
    conversations = write_chats(root / "train.jsonl", chats(40, seed=1))
    common = [
        *COMMON,
        f"model.path={model}",
        f"data.path={conversations}",
        f"data.tokenizer={model}",
        f"data.cache_dir={root / 'cache'}",
    ]
    runs = {
        "ep": [
            *common,
            "devices=4",
            "ep=2",
            "strategy.replicate_size=2",
            *AC_OFFLOAD,
            "checkpoint=full",
            "checkpoint.every_n_steps=2",
        ],
        "one": [*common, "devices=1"],
    }
    out = {}
    for name, args in runs.items():
        out[name] = root / name
        assert_ok(run_cli(args, out[name], env=CPU), out[name])
    checkpoint = out["ep"] / "checkpoints" / "step_00000002.pt"
    out["resumed"] = root / "resumed"
    resumed = [*common, "devices=1", f"resume={checkpoint}"]
    assert_ok(run_cli(resumed, out["resumed"], env=CPU), out["resumed"])
    out["model"] = model
    return out


@pytest.mark.distributed
def test_fsdp_train_at_ep2_on_hsdp_equals_one_process(moe_runs: dict[str, Path]) -> None:
    """A Qwen3-MoE folder in the hub's layout (pretrained), packed chat data, bf16-mixed with
    float8, activation checkpointing and CPU offload, ep=2 within HSDP on 4 ranks: one bf16 float8
    process's losses and load-balancing loss, within bf16's tolerance (as the other bf16 composed
    runs; the gradients' exactness at ep is the float64 check's: bf16 and float8 alone move these
    gradient norms by 2-3%); metrics.jsonl shows the experts' load, the summary ep=2, the setup
    report the split MoE layers."""
    ep, one = moe_runs["ep"], moe_runs["one"]
    assert relative_gap(losses(ep), losses(one)) < BF16_TOLERANCE
    aux = [[row["moe_aux_loss"] for row in read_metrics(run_dir)] for run_dir in (ep, one)]
    assert relative_gap(*aux) < BF16_TOLERANCE
    row = read_metrics(ep)[-1]
    assert row["moe_tokens_min"] <= row["moe_tokens_max"] and row["moe_imbalance"] >= 1
    summary = read_summary(ep)
    assert summary["ep"] == 2 and summary["setup"]["expert_parallel_modules"] == 2
    assert summary["setup"]["mesh"]["expert_parallel"] == 2


@pytest.mark.distributed
def test_an_ep2_checkpoint_resumes_at_ep1(moe_runs: dict[str, Path]) -> None:
    """The ep run's step-2 full file continued at ep=1 on one process: one process's steps 3 and 4,
    within bf16's tolerance (the weights' bit-exact DCP round trip to ep=1 is the float64 check's)."""
    resumed = moe_runs["resumed"]
    assert relative_gap(losses(resumed), losses(moe_runs["one"])[2:]) < BF16_TOLERANCE


@pytest.mark.distributed
def test_an_ep2_checkpoint_exports_in_the_hub_layout(moe_runs: dict[str, Path], tmp_path: Path) -> None:
    """``fsdp-ckpt convert --to hf`` of the ep run's last file: one tensor per expert, as the
    folder it started from, and transformers loads the trained weights bit for bit."""
    from safetensors import safe_open
    from test_checkpoints import fsdp_ckpt
    from transformers import AutoModelForCausalLM

    checkpoint = moe_runs["ep"] / "checkpoints" / "step_00000004.pt"
    out = tmp_path / "hf"
    assert fsdp_ckpt("convert", str(checkpoint), str(out), "--to", "hf") == 0
    with (
        safe_open(str(out / "model.safetensors"), "pt") as exported,
        safe_open(str(moe_runs["model"] / "model.safetensors"), "pt") as original,
    ):
        assert sorted(exported.keys()) == sorted(original.keys())
    trained = torch.load(checkpoint, weights_only=True, mmap=True)["state_dict"]
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    for name, param in model.named_parameters():
        assert torch.equal(param, trained[f"model.hf.{name}"].float()), name


@pytest.mark.distributed
def test_adapters_on_the_fused_experts_train_at_ep2_and_load_in_peft(tmp_path: Path) -> None:
    """``peft=lora peft.targets=[all,experts]`` on a Qwen3-MoE folder at ep=2 (2 ranks): the
    checkpoint holds the adapters alone (a pair per expert beside each fused tensor, no base);
    ``--to peft`` writes them as peft's ``target_parameters`` adapters, which
    ``PeftModel.from_pretrained`` loads onto the transformers model: its logits are those of
    fsdp_cli's own model with the checkpoint's adapters (the trained ones: far from the base's),
    and those of ``--to hf --merge``'s folder (the experts merged per expert, in the hub's layout)."""
    from peft import PeftModel
    from test_checkpoints import fsdp_ckpt
    from transformers import AutoModelForCausalLM

    from fsdp_cli.adapters.lora import apply_lora
    from fsdp_cli.adapters.options import AdapterMethod, AdapterOptions
    from fsdp_cli.models.args import HFModelArgs
    from fsdp_cli.models.hf import build_hf_model

    model = moe_folder(tmp_path / "model")
    args = [
        "model=hf",
        f"model.path={model}",
        "model.experts_implementation=eager",
        "data=synthetic",
        "data.vocab_size=64",
        "data.seq_len=16",
        "data.global_batch_size=8",
        "trainer.max_steps=4",
        "precision=32-true",
        "accelerator=cpu",
        "peft=lora",
        "peft.r=4",
        "peft.targets=[all,experts]",
        "optim.lr=0.01",
        "checkpoint=full",
        "devices=2",
        "ep=2",
    ]
    assert_ok(run_cli(args, tmp_path / "run", env=CPU), tmp_path / "run")
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000004.pt"
    saved = torch.load(checkpoint, weights_only=True, mmap=True)["state_dict"]
    assert all("lora_" in key for key in saved), sorted(saved)
    assert saved["model.hf.model.layers.1.mlp.experts.gate_up_proj_lora_A"].shape == (4, 4, 16)
    assert fsdp_ckpt("convert", str(checkpoint), str(tmp_path / "peft"), "--to", "peft") == 0
    assert fsdp_ckpt("convert", str(checkpoint), str(tmp_path / "merged"), "--to", "hf", "--merge") == 0

    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    ours = build_hf_model(HFModelArgs(path=str(model), experts_implementation="eager"), seed=0)
    apply_lora(ours, AdapterOptions(name=AdapterMethod.lora, r=4, targets=["all", "experts"]), seed=0)
    ours.to_empty(device="cpu")
    ours.init_weights()
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    with torch.no_grad():
        untrained = base(ids).logits.clone()
        assert torch.allclose(ours(ids), untrained, atol=1e-6)  # (B = 0: the base's)
        missing, unexpected = ours.load_state_dict(
            {k.removeprefix("model."): v for k, v in saved.items()}, strict=False
        )
        assert not unexpected and all("lora_" not in k for k in missing)
        mine = ours(ids)
        theirs = PeftModel.from_pretrained(base, tmp_path / "peft")(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)(ids).logits
    assert (mine - untrained).abs().max() > 1e-2
    assert torch.allclose(theirs, mine, atol=1e-5), (theirs - mine).abs().max()
    assert torch.allclose(merged, mine, atol=1e-5), (merged - mine).abs().max()


def test_pipeline_stages_count_their_own_layers_routing_and_the_sum_is_the_whole_models() -> None:
    """The routing bias under pp: each stage counts its own blocks' tokens per expert in the rows
    of those blocks (the stage forward, as Llama.forward does for the whole model); the ranks'
    counts summed are the whole model's, and each stage's bias update moves its own layers by
    their rows."""
    import copy

    from fsdp_cli.models.args import LlamaArgs
    from fsdp_cli.models.llama import Llama, moe_layers
    from fsdp_cli.pipeline.stages import prune, views

    cfg = LlamaArgs(vocab_size=32, dim=16, n_layers=4, n_heads=2, n_experts=4, experts_per_token=2)
    cfg = dataclasses.replace(cfg, moe_hidden_dim=8, aux_loss_coef=0.0, balance_bias_rate=0.1)
    whole = Llama(cfg, seed=0).train()
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole(ids)
    counts = []
    for stage, blocks in enumerate((range(0, 2), range(2, 4))):
        model = copy.deepcopy(whole)
        model.pop_routed()
        split = model.pipeline_split()
        ranges = [range(0, 2), range(2, 4)]
        prune(split, ranges, [stage])
        (view,) = views(split, ranges, [stage])
        hidden = whole.tok_embeddings(ids) if stage else ids
        if stage:
            for layer in list(whole.layers.values())[:2]:
                hidden = layer(hidden, whole.rope[:8])
        with torch.no_grad():
            view(hidden)
        counts.append(model.pop_routed())
        assert sorted(moe_layers(model.layers)) == list(blocks)
        rows = counts[-1].sum(dim=1)
        assert all((rows[i] > 0) == (i in blocks) for i in range(4)), rows
    assert torch.equal(counts[0] + counts[1], whole.pop_routed())


@pytest.mark.distributed
def test_the_routing_bias_under_pp_and_cp_moves_as_in_one_process(tmp_path: Path) -> None:
    """The built-in MoE balanced by its routing bias (no balance loss) at pp=2 x HSDP 2x2, its
    experts split over ep=2 inside each stage, and at ep=2 x cp=2 (each sequence split over 2 ranks,
    the experts over the other 2, FSDP2 sharding them over the cp ranks), against one process, fp32,
    6 steps: losses within 1e-5, the first step's gradient norm equal (expert gradients not divided
    by ep, or not averaged over the cp ranks, would move it), and every layer's expert_bias in the
    step-6 full files bit for bit one process's (the stages count their own layers' tokens, the cp
    ranks their own slices'; the tokens of torch's metadata-inference forward, before the first
    step, are not counted: counted, layer 3's bias moved the other way after step 1)."""
    args = [
        "recipe=cpu_pp",
        "model.n_experts=4",
        "model.experts_per_token=2",
        "model.aux_loss_coef=0",
        "model.balance_bias_rate=0.01",
        "trainer.max_steps=6",
        "trainer.log_every_n_steps=1",
        "data.seq_len=32",
        "precision=32-true",
        "seed=11",
        "trainer.gradient_clip_val=1000000",
        "checkpoint=full",
    ]
    # pp=2 x HSDP 2x2 (8 ranks), each stage's experts split over its 2 shard ranks (ep=2): the
    # stages' counts summed over the replicas and shards too.
    runs = {
        "pp2": ["devices=8", "strategy.replicate_size=2", "ep=2", "pipeline.microbatches=2"],
        "cp2": ["pp=1", "devices=4", "cp=2", "ep=2"],
        "one": ["pp=1", "devices=1"],
    }
    for name, layout in runs.items():
        assert_ok(run_cli([*args, *layout], tmp_path / name, env=CPU), tmp_path / name)
    setup = read_summary(tmp_path / "pp2")["setup"]
    assert setup["mesh"]["expert_parallel"] == 2 and setup["mesh"]["pipeline_parallel"] == 2
    assert [u for u in setup["fsdp_units"] if u.endswith("experts")] == [
        f"layers.{i}.feed_forward.experts" for i in range(2)
    ]
    cp_setup = read_summary(tmp_path / "cp2")["setup"]
    assert cp_setup["mesh"]["expert_parallel"] == 2 and cp_setup["mesh"]["context_parallel"] == 2
    for name in ("pp2", "cp2"):
        assert relative_gap(losses(tmp_path / name), losses(tmp_path / "one")) < 1e-5, name
    norms = {name: grad_norms(tmp_path / name)[0] for name in runs}
    assert abs(norms["pp2"] - norms["one"]) <= 1e-6 * norms["one"], norms
    assert abs(norms["cp2"] - norms["one"]) <= 1e-5 * norms["one"], norms
    saved = {
        name: torch.load(tmp_path / name / "checkpoints" / "step_00000006.pt", weights_only=False)[
            "state_dict"
        ]
        for name in runs
    }
    biases = [key for key in saved["one"] if key.endswith("expert_bias")]
    assert len(biases) == 4
    for key in biases:
        for name in ("pp2", "cp2"):
            assert torch.equal(saved[name][key], saved["one"][key]), (
                name,
                key,
                saved[name][key],
                saved["one"][key],
            )
