"""QLoRA (``peft=qlora``: LoRA over a base whose adapted layers are held in torchao's NF4).

Distributed: fsdp-train against a hand-written torchao-NF4 + peft + FSDP2 loop
(``benchmarks/qlora.py``) on the same Hugging Face folder, the same batches and the same starting
adapters; the run resumed on one process; a composed run (HSDP x context parallel, packed chat,
activation checkpointing, offload, full saves) and a bf16-true run each against one process; the
checkpoint merged (``--to hf --merge``: into the dequantized base) and answered from
(``fsdp-generate``). Fast: the checks before launch, the plan's 4-bit bytes, the NF4 helpers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import (
    assert_ok,
    cli_in_process,
    composed,
    grad_norms,
    losses,
    read_summary,
    relative_gap,
    run,
    run_cli,
)
from test_chat_data import hf_chat_files

from benchmarks.qlora import build_folder, fsdp_train_args, hand_loop_command

CPU = {"CUDA_VISIBLE_DEVICES": ""}
BF16_TOLERANCE = 0.02
"""Relative, per step, between bf16 layouts (as tests/test_composition.py's)."""
SIZES = {"seq": 32, "batch": 4, "steps": 8, "devices": 2, "r": 8}
# The built-in model at a size whose adapted weights split into NF4 blocks on 4 shards.
BUILTIN = [
    "model=tiny",
    "model.dim=256",
    "model.n_heads=4",
    "model.n_kv_heads=4",
    "model.ffn_hidden_dim=512",
    "model.n_layers=2",
    "model.vocab_size=64",
]


# --------------------------------------------------------------------------- against a hand loop


@pytest.fixture(scope="module")
def hand_and_ours(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The hand loop, fsdp-train on 2 ranks (saving at steps 4 and 8), and its step-4 save
    resumed on one process."""
    root = tmp_path_factory.mktemp("qlora")
    model, tokens = build_folder(root, hidden=256, layers=2, seq=SIZES["seq"], windows=SIZES["batch"] * 9)
    hand = root / "hand.json"
    result = run(hand_loop_command(hand, model, tokens, **SIZES), timeout=300, cwd=root, env=CPU)
    assert result.returncode == 0, result
    ours = root / "ours"
    args = [
        *fsdp_train_args(model, tokens, **SIZES),
        "checkpoint.every_n_steps=4",
        "checkpoint.save_last=true",
    ]
    assert_ok(run_cli(args, ours, env=CPU), ours)
    resumed = root / "resumed"
    step4 = ours / "checkpoints" / "step_00000004"
    assert_ok(
        run_cli([*args, "devices=1", "data.micro_batch_size=4", f"resume={step4}"], resumed, env=CPU), resumed
    )
    return {
        "hand": json.loads(hand.read_text()),
        "ours": ours,
        "resumed": resumed,
        "model": model,
        "root": root,
    }


@pytest.mark.distributed
def test_qlora_equals_a_hand_written_nf4_peft_fsdp2_loop(hand_and_ours: dict[str, Any]) -> None:
    """8 steps of fsdp-train peft=qlora on 2 ranks: each loss within 1e-5 of torchao's to_nf4 +
    peft + fully_shard written by hand; the setup report read the adapted weights as NF4 off the
    live tensors, and the rank held them at about half a byte each."""
    ours = losses(hand_and_ours["ours"])
    assert len(ours) == 8
    assert relative_gap(ours, hand_and_ours["hand"]["losses"]) < 1e-5
    setup = read_summary(hand_and_ours["ours"])["setup"]
    quantized = setup["trainable"]["quantized"]
    layer = 256 * 256
    assert quantized["weights"] == 14 and quantized["parameters"] == 2 * (4 * layer + 3 * 2 * layer)
    assert "nf4" in setup["trainable"]["frozen_dtype"] and setup["trainable"]["dtype"] == ["float32"]


@pytest.mark.distributed
def test_a_qlora_checkpoint_resumes_on_one_process(hand_and_ours: dict[str, Any]) -> None:
    """The step-4 save (adapters only) continued on one process (where the NF4 weights stay out of
    FSDP2): steps 5-8 as the 2-rank run took them."""
    assert relative_gap(losses(hand_and_ours["resumed"]), losses(hand_and_ours["ours"])[4:]) < 1e-5
    manifest = json.loads(
        (hand_and_ours["ours"] / "checkpoints" / "step_00000004" / "manifest.json").read_text()
    )
    assert manifest["trained"] and all(".lora_" in name for name in manifest["trained"])


@pytest.mark.distributed
def test_a_qlora_merge_folds_the_adapters_into_the_dequantized_base(hand_and_ours: dict[str, Any]) -> None:
    """``--to hf --merge`` of a QLoRA checkpoint: each adapted weight is the NF4 round trip of the
    folder's (what the run's forward saw) plus alpha / r * B @ A; fsdp-generate from the checkpoint
    answers as transformers does from the merged folder (greedy, token for token)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from fsdp_cli.parallel.nf4 import nf4_round_trip

    root, step8 = hand_and_ours["root"], hand_and_ours["ours"] / "checkpoints" / "step_00000008"
    for to, out in (("hf", root / "merged"), ("peft", root / "adapters")):
        extra = ["--merge"] if to == "hf" else []
        result = cli_in_process(
            ["convert", str(step8), str(out), "--to", to, *extra], prog="fsdp-ckpt", env=CPU
        )
        assert result.returncode == 0, result
    merged, base = (
        load_file(str(root / "merged" / "model.safetensors")),
        load_file(str(hand_and_ours["model"] / "model.safetensors")),
    )
    adapters = load_file(str(root / "adapters" / "adapter_model.safetensors"))
    name = "model.layers.1.self_attn.q_proj"
    a, b = (
        adapters[f"base_model.model.{name}.lora_A.weight"],
        adapters[f"base_model.model.{name}.lora_B.weight"],
    )
    expected = nf4_round_trip(base[f"{name}.weight"], torch.float32) + 2.0 * b @ a
    torch.testing.assert_close(merged[f"{name}.weight"], expected, rtol=0, atol=1e-6)
    assert not torch.allclose(merged[f"{name}.weight"], base[f"{name}.weight"] + 2.0 * b @ a, atol=1e-4)

    prompts = root / "prompts.jsonl"
    prompts.write_text(json.dumps({"input_ids": [1, 17, 5, 9]}) + "\n")
    out = root / "answers.jsonl"
    result = cli_in_process(
        [str(step8), "--prompts", str(prompts), "--out", str(out), "--max-new-tokens", "6"],
        prog="fsdp-generate",
        env=CPU,
    )
    assert result.returncode == 0, result
    answer = [int(t) for t in json.loads(out.read_text())["answer"].split()]
    hf = AutoModelForCausalLM.from_pretrained(root / "merged", dtype=torch.float32)
    generated = hf.generate(torch.tensor([[1, 17, 5, 9]]), max_new_tokens=6, do_sample=False)[0, 4:].tolist()
    assert answer == generated[: len(answer)] and len(answer) >= 1


# --------------------------------------------------------------------------- against one process


@pytest.fixture(scope="module")
def composed_qlora(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The composed run and its one-process reference (fp32); a bf16-true run on 2 ranks."""
    root = tmp_path_factory.mktemp("qlora-composed")
    files = hf_chat_files(root)
    common = [
        *BUILTIN,
        "peft=qlora",
        "peft.r=4",
        "data=chat",
        f"data.path={files['chats']}",
        f"data.tokenizer={files['tokenizer']}",
        "data.packing=true",
        "data.seq_len=48",
        "data.global_batch_size=8",
        f"data.cache_dir={root / 'cache'}",
        "trainer.max_steps=4",
        "trainer.gradient_clip_val=1000000",  # each step's gradient norm logged, nothing clipped
        "accelerator=cpu",
        "seed=5",
    ]
    layouts = {
        "composed": [*common, "precision=32-true", "devices=4", "strategy.replicate_size=2", "cp=2",
                     "strategy.activation_checkpointing=full", "strategy.cpu_offload=true",
                     "checkpoint=full", "checkpoint.every_n_steps=2"],
        "composed_one": [*common, "precision=32-true", "devices=1"],
        "bf16": [*common, "precision=bf16-true", "devices=2"],
    }  # fmt: skip
    out = {}
    for name, args in layouts.items():
        assert_ok(run_cli(args, root / name, env=CPU), root / name)
        out[name] = root / name
    return out


@pytest.mark.distributed
def test_a_composed_qlora_run_on_hsdp_and_cp_equals_one_process(composed_qlora: dict[str, Path]) -> None:
    """The built-in model, QLoRA, HSDP (2 replicas) x context parallel (cp=2) on 4 ranks: the NF4
    weights sharded over the 2 x 2 shard ranks; packed chat, activation checkpointing, offload and
    full saves, in fp32: the losses and gradient norms of one process."""
    assert relative_gap(losses(composed_qlora["composed"]), losses(composed_qlora["composed_one"])) < 1e-5
    assert (
        relative_gap(grad_norms(composed_qlora["composed"]), grad_norms(composed_qlora["composed_one"]))
        < 1e-5
    )


@pytest.mark.distributed
def test_qlora_in_bf16_true_on_two_ranks_equals_one_process(composed_qlora: dict[str, Path]) -> None:
    """bf16-true: the NF4 weights stand for bf16 ones, the adapters stay fp32 (read off the live
    tensors by the setup report); 2 ranks within bf16's tolerance of one fp32 process."""
    assert (
        relative_gap(losses(composed_qlora["bf16"]), losses(composed_qlora["composed_one"])) < BF16_TOLERANCE
    )
    trainable = read_summary(composed_qlora["bf16"])["setup"]["trainable"]
    assert trainable["dtype"] == ["float32"] and trainable["quantized"]["dequantized_to"] == ["bfloat16"]
    assert set(trainable["frozen_dtype"]) == {"bfloat16", "nf4"}


# --------------------------------------------------------------------------- before launch


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["peft.quantize_base=nf4"], "peft.quantize_base=nf4: quantizes the base that adapters train over"),
        (["peft=qlora"], "layers.0.attention.wq.weight cannot be held in NF4: 128 rows split over 2 ranks"),
        ([*BUILTIN, "peft=qlora", "peft.save_base=true"], "peft.save_base=True: a 4-bit base is rebuilt"),
        ([*BUILTIN, "peft=qlora", "strategy=ddp"], "peft.quantize_base=nf4: not with strategy=ddp"),
        (
            [*BUILTIN, "peft=qlora", "strategy.compile=true"],
            "peft.quantize_base=nf4: not with strategy.compile",
        ),
        (
            [
                "model=custom",
                "model._target_=tests.assets.custom_models.TinyLM",
                "data.vocab_size=64",
                "peft=qlora",
            ],
            "model kind module fills its own",
        ),
    ],
)
def test_qlora_mistakes_are_one_line_before_launch(
    overrides: list[str], expected: str, tmp_path: Path
) -> None:
    result = cli_in_process(["accelerator=cpu", "devices=2", *overrides], tmp_path / "run", env=CPU)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1 and expected in lines[0], result.stderr


def test_the_plan_holds_the_quantized_weights_at_about_half_a_byte() -> None:
    """The plan of a QLoRA run: the adapted weights at NF4's 0.5 + 1/64 + 4/16384 bytes each (and
    each weight's code table and scale mean), the rest (embeddings, norms, head, adapters) as
    LoRA's plan has them. (test_recipes holds the plan to the rehearsal's bytes, to the byte.)"""
    from fsdp_cli.config.resolved import ResolvedRun
    from fsdp_cli.launch.layout import resolve_layout
    from fsdp_cli.parallel.nf4 import bytes_per_element, nf4_constant_bytes
    from fsdp_cli.plan.check import plan_for

    def params(*peft: str) -> int:
        plan = plan_for(ResolvedRun.of(resolve_layout(composed(*BUILTIN, "devices=2", *peft), CPU)))
        assert plan is not None
        return plan.peak.params

    quantized = 2 * (4 * 256 * 256 + 3 * 256 * 512) // 2  # per rank of 2
    saved = quantized * 4 - round(quantized * bytes_per_element(4)) - 14 * nf4_constant_bytes(4)
    assert params("peft=lora") - params("peft=qlora") == pytest.approx(saved, abs=64)


def test_a_weight_written_whole_holds_the_bits_of_the_whole_tensors_quantization() -> None:
    """write_full on a plain NF4 parameter: the whole weight quantized once (scale mean included),
    so its dequantized rows are those of quantizing the whole tensor; and the round trip differs
    from the weight (quantization took place)."""
    from torch import nn

    from fsdp_cli.parallel.nf4 import UNIT, nf4_module, nf4_round_trip, write_full

    _, to_nf4 = nf4_module()
    weight = torch.randn(128, UNIT // 64)
    param = nn.Parameter(to_nf4(torch.empty_like(weight, device="meta"), 64, 256), requires_grad=False)
    param = nn.Parameter(torch.empty_like(param, device="cpu"), requires_grad=False)
    write_full(param, weight)
    torch.testing.assert_close(
        param.get_original_weight(), nf4_round_trip(weight, torch.float32), rtol=0, atol=0
    )
    assert (param.get_original_weight() - weight).abs().max() > 1e-3


@pytest.mark.parametrize("pretrained", [True, False])
def test_a_model_folders_base_is_the_nf4_round_trip_of_what_lora_starts_from(
    tmp_path: Path, pretrained: bool
) -> None:
    """model=hf built as the ranks build it (meta, adapters, NF4, then filled): each base weight is
    the NF4 round trip of the weight the same LoRA model gets, read from the folder or drawn fresh
    by the model's own init (``model.pretrained=false``: drawn whole, then quantized)."""
    from fsdp_cli.adapters.lora import apply_lora
    from fsdp_cli.adapters.options import AdapterMethod, AdapterOptions, QuantizeBase
    from fsdp_cli.models.args import HFModelArgs
    from fsdp_cli.models.hf import build_hf_model
    from fsdp_cli.parallel.nf4 import is_quantized, nf4_round_trip

    model_dir, _ = build_folder(tmp_path, hidden=256, layers=1, seq=16, windows=1)
    built = {}
    for quantize in (QuantizeBase.none, QuantizeBase.nf4):
        model = build_hf_model(HFModelArgs(path=str(model_dir), pretrained=pretrained), seed=3)
        apply_lora(model, AdapterOptions(name=AdapterMethod.lora, quantize_base=quantize), seed=3)
        model.materialize("cpu")
        built[quantize] = model.hf.model.layers[0].mlp.down_proj.base_layer.weight
    plain, nf4 = built[QuantizeBase.none], built[QuantizeBase.nf4]
    assert is_quantized(nf4) and not is_quantized(plain)
    torch.testing.assert_close(
        nf4.get_original_weight(), nf4_round_trip(plain.detach(), torch.float32), rtol=0, atol=0
    )
