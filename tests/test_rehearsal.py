"""``fsdp-plan --rehearse``: one CPU process builds rank R of a layout of any size on torch's fake
process group with the code a real rank runs; what it holds equals the formula plan, a layout
the model cannot take is one line, the fake step's peak is measured.

Everything here runs in this process (the fast tier): a rehearsal starts no rank, and the
commands run through their console scripts' functions (``cli_in_process``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import cli_in_process, read_summary

from fsdp_cli.cli.plan import resolved
from fsdp_cli.errors import ConfigError
from fsdp_cli.plan import fake_step
from fsdp_cli.plan.check import plan_for
from fsdp_cli.plan.rehearsal import HELD, Rehearsal, disagreements, rehearse

TINY_HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 250,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
}


def rehearsed(*overrides: str, gpus: int, rank: int = 0, step: bool = False) -> tuple[Any, Rehearsal]:
    cfg = resolved(list(overrides), gpus)
    return cfg, rehearse(cfg, rank, step=step)


def assert_equals_the_plan(cfg: Any, result: Rehearsal) -> None:
    plan = plan_for(cfg)
    assert plan is not None
    planned = plan.ranks[result.rank]
    assert {k: getattr(result.held_bytes, k) for k in HELD} == {k: getattr(planned, k) for k in HELD}
    assert disagreements(result, plan) == []


# Six ranks over the tiny model (dim 128, vocabulary 256, 4 blocks): shards of 128 rows over 6
# or 3 ranks are uneven, so the first and the last rank hold different, padded, amounts.
LAYOUTS = {
    "fsdp2": ["strategy=fsdp2"],
    "fsdp2_tp": ["strategy=fsdp2", "tp=2", "strategy.sequence_parallel=true"],
    # Context parallel: parameters sharded over shard x cp = 3 x 2 ranks.
    "fsdp2_cp": ["strategy=fsdp2", "cp=2"],
    "hsdp": ["strategy=fsdp2", "strategy.replicate_size=2", "strategy.activation_checkpointing=full"],
    "fsdp1": ["strategy=fsdp"],
    "fsdp1_hybrid": [
        "strategy=fsdp",
        "strategy.sharding_strategy=HYBRID_SHARD",
        "strategy.hybrid_shard_size=3",
    ],
    "ddp": ["strategy=ddp"],
    "fsdp2_bf16_true": ["strategy=fsdp2", "precision=bf16-true"],
    # torchao's float8 conversion (emulated off a GPU) before fully_shard, with float8 all-gathers:
    # the shards stay in the parameter dtype, so the plan's bytes hold.
    "fsdp2_float8": ["strategy=fsdp2", "precision=bf16-mixed", "strategy.float8=true"],
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_held_bytes_equal_the_plan_on_the_first_and_last_rank(name: str) -> None:
    for rank in (0, 5):
        cfg, result = rehearsed("model=tiny", "data.global_batch_size=12", *LAYOUTS[name], gpus=6, rank=rank)
        assert result.world_size == 6 and result.rank == rank
        assert result.held_bytes.params > 0
        assert_equals_the_plan(cfg, result)
    if name == "fsdp2_tp":
        assert result.mesh_coordinates == {
            "data_parallel_replicate": 0,
            "data_parallel_shard": 2,
            "tensor_parallel": 1,
        }
    if name == "fsdp2_cp":
        assert result.mesh_coordinates == {
            "data_parallel_replicate": 0,
            "data_parallel_shard": 2,
            "context_parallel": 1,
            "tensor_parallel": 0,
        }
    if name == "ddp":  # every rank holds the whole model
        import torch

        from fsdp_cli.models.llama import Llama

        with torch.device("meta"):
            numel = sum(p.numel() for p in Llama(cfg.cfg.model).parameters())
        assert result.held_bytes.params == 4 * numel and result.fsdp_units == []
    # Every linear layer of the 4 blocks (7 each) converted, the LM head left as it is.
    assert result.float8_linears == (4 * 7 if name == "fsdp2_float8" else 0)


def test_a_layout_the_model_cannot_take_is_refused_in_one_line() -> None:
    model = ["model=custom", "data.vocab_size=256", "accelerator=cpu"]
    # Three heads split over two tensor-parallel ranks: the plan knows nothing of heads, the fake
    # step's forward cannot view a rank's 1.5 heads.
    with pytest.raises(ConfigError) as refused:
        rehearsed(
            *model,
            "model._target_=tests.assets.rehearsal_models.HeadsLM",
            "tp=2",
            "devices=2",
            gpus=2,
            step=True,
        )
    line = refused.value.one_line()
    assert "\n" not in line
    assert line.startswith(
        "layout=fsdp2 dp=1 tp=2 (2 ranks): the model cannot train on it (rank 0): RuntimeError"
    )
    # The same model over three tensor-parallel ranks (one head each) trains.
    _, result = rehearsed(
        *model, "model._target_=tests.assets.rehearsal_models.HeadsLM", "tp=3", "devices=3", gpus=3, step=True
    )
    assert result.step is not None and result.step["peak_bytes"] > 0
    # A plan naming a module the model does not have (torch itself only warns and moves on).
    with pytest.raises(ConfigError, match=r"^tensor-parallel plan=blocks\.1\.proj_inn: names no module"):
        rehearsed(*model, "model._target_=tests.assets.rehearsal_models.MisnamedPlanLM", "tp=2", gpus=2)


def test_a_users_parallelize_fn_is_what_is_rehearsed() -> None:
    cfg, result = rehearsed(
        "model=custom",
        "model._target_=tests.assets.custom_models.TinyLM",
        "data.vocab_size=256",
        "strategy.parallelize_fn=tests.assets.parallelize_fns.shard_whole_model_only",
        gpus=4,
        rank=3,
    )
    assert result.fsdp_units == ["<root>"]  # the function's one unit, not the built-in per-block units
    assert_equals_the_plan(cfg, result)  # FSDP2 shards each parameter alike whatever the units


def test_a_users_configure_model_is_what_is_rehearsed() -> None:
    from tests.assets.model_parallel_module import FeedForwardLM

    cfg, result = rehearsed(
        "strategy=model_parallel",
        "model=custom",
        "model._target_=tests.assets.model_parallel_module.FeedForwardLM",
        "tp=2",
        gpus=4,
        rank=3,
        step=True,
    )
    assert plan_for(cfg) is None  # no formula for a module that parallelizes itself
    assert result.mesh_coordinates == {"data_parallel": 1, "tensor_parallel": 1}
    assert result.fsdp_units == ["<root>"]
    # Its configure_model: w1 column-split and w2 row-split over tp=2, then everything sharded
    # over dp=2 along dimension 0; AdamW keeps two moments like each parameter and a 4-byte step.
    m = FeedForwardLM()
    local = {
        "embed": m.embed.weight.numel() // 2,
        "w1": m.w1.weight.numel() // 2 // 2,
        "w2": m.w2.weight.numel() // 2 // 2,
        "head": m.head.weight.numel() // 2,
    }
    assert result.held_bytes.params == result.held_bytes.grads == 4 * sum(local.values())
    assert result.held_bytes.optimizer == 2 * 4 * sum(local.values()) + 4 * len(local)
    assert result.step == {
        "skipped": "a LightningModule's own training_step needs its own batches: no fake step"
    }


@pytest.mark.parametrize(
    ("layout", "rank"),
    [(["strategy=fsdp2", "tp=2"], 3), (["strategy=fsdp"], 0), (["strategy=ddp"], 1)],
    ids=["fsdp2_tp", "fsdp1", "ddp"],
)
def test_a_hugging_face_model_from_its_config_json_alone(
    tmp_path: Path, layout: list[str], rank: int
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY_HF_CONFIG))  # no weights, no tokenizer
    cfg, result = rehearsed(
        "model=hf", f"model.path={tmp_path}", "model.pretrained=false", *layout, gpus=4, rank=rank
    )
    assert_equals_the_plan(cfg, result)  # its tied embedding counted once, as the run holds it


def test_the_fake_step_extended_from_4_and_5_blocks_equals_the_whole_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    overrides = [
        "model=tiny",
        "model.n_layers=7",
        "strategy.activation_checkpointing=full",
        "data.seq_len=64",
    ]
    cfg, extended = rehearsed(*overrides, gpus=4, rank=3, step=True)
    assert extended.step is not None and extended.step["measured_blocks"] == [4, 5]
    monkeypatch.setattr(fake_step, "STABLE_DEPTH", 100)  # measure all 7 blocks
    _, whole = rehearsed(*overrides, gpus=4, rank=3, step=True)
    assert whole.step is not None and whole.step["measured_blocks"] == [7]
    for phase in fake_step.PHASES:
        a, b = extended.step["phases"][phase], whole.step["phases"][phase]
        assert abs(a - b) <= 0.01 * b, (phase, a, b)
    step = whole.step
    held = extended.held_bytes
    assert step["peak_bytes"] > held.params + held.optimizer  # the step holds more than the state
    # FSDP2's all-gathered parameters and the activations are in the peak, measured.
    assert step["by_kind"].get("unsharded_param", 0) > 0 and step["by_kind"].get("activation", 0) > 0


def test_a_forward_that_needs_values_keeps_the_rest_of_the_rehearsal() -> None:
    cfg, result = rehearsed(
        "model=custom",
        "model._target_=tests.assets.rehearsal_models.ValueDependentLM",
        "data.vocab_size=256",
        "accelerator=cpu",
        gpus=2,
        step=True,
    )
    assert result.step is not None
    assert result.step["skipped"].startswith("the model's forward needs tensor values (")
    assert_equals_the_plan(cfg, result)


def test_a_rehearsal_leaves_no_process_group_and_a_second_one_starts_fresh() -> None:
    import torch.distributed as dist
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    before = rank_zero_only.rank
    rehearsed("model=tiny", gpus=4, rank=3)
    assert not dist.is_initialized() and rank_zero_only.rank == before
    _, again = rehearsed("model=tiny", gpus=2, rank=1)
    assert again.world_size == 2 and again.mesh_coordinates["data_parallel_shard"] == 1


def test_a_rank_outside_the_layout_is_one_line() -> None:
    with pytest.raises(ConfigError, match=r"^--rank=4: not one of this layout's 4 ranks; allowed: 0\.\.3$"):
        rehearsed("model=tiny", gpus=4, rank=4)


def test_a_layout_beyond_this_machine_is_what_a_sweep_rehearses() -> None:
    from fsdp_cli.resolve import exceeds_this_machine

    def layout(*overrides: str, gpus: int | None) -> Any:
        return resolved(list(overrides), gpus).layout

    no_gpus = {"CUDA_VISIBLE_DEVICES": ""}
    assert exceeds_this_machine(layout("recipe=llama_8b_hsdp", gpus=8), no_gpus)  # two nodes
    assert exceeds_this_machine(layout("model=tiny", gpus=8), no_gpus)  # 8 GPUs, none here
    assert not exceeds_this_machine(layout("model=tiny", "accelerator=cpu", gpus=None), no_gpus)


# --------------------------------------------------------------------------- the commands


def test_fsdp_plan_rehearses_the_last_of_512_ranks_with_a_fake_step() -> None:
    started = time.perf_counter()
    args = ["--rehearse", "recipe=llama_70b_hsdp", "num_nodes=64", "data.global_batch_size=512"]
    r = cli_in_process([*args, "--gpus", "8", "--rank", "511", "--json"], prog="fsdp-plan")
    elapsed = time.perf_counter() - started
    assert r.returncode == 0, r
    out = json.loads(r.stdout)
    rehearsal = out["rehearsal"]
    assert (rehearsal["world_size"], rehearsal["rank"]) == (512, 511)
    # HSDP: 2 replicas of 256-rank shard groups; rank 511 is the last of the second replica.
    assert rehearsal["mesh_coordinates"] == {
        "data_parallel_replicate": 1,
        "data_parallel_shard": 255,
        "tensor_parallel": 0,
    }
    units = rehearsal["fsdp_units"]
    assert len(units) == 81 and units[-1] == "<root>"  # 80 blocks and the root
    assert rehearsal["disagreements"] == []
    assert rehearsal["held_bytes"] == {k: out["ranks"][511][k] for k in HELD}
    # 70.6B fp32 parameters over 256 shards: about 1.1 GB, padding included.
    assert 1.0e9 < rehearsal["held_bytes"]["params"] < 1.2e9
    step = rehearsal["step"]
    assert step["blocks"] == 80 and step["measured_blocks"] == [4, 5]
    assert step["peak_bytes"] > sum(rehearsal["held_bytes"].values()) - rehearsal["held_bytes"]["grads"]
    print(f"fsdp-plan --rehearse, rank 511 of llama_70b with the fake step: {elapsed:.1f} s (in process)")


def test_fsdp_plan_refuses_a_layout_in_one_line_and_exit_2() -> None:
    r = cli_in_process(
        [
            "model=custom",
            "model._target_=tests.assets.rehearsal_models.HeadsLM",
            "data.vocab_size=256",
            "tp=2",
            "--gpus",
            "2",
            "--rehearse",
        ],
        prog="fsdp-plan",
    )
    assert r.returncode == 2
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("fsdp-plan: error: layout=fsdp2 dp=1 tp=2"), r


def test_fsdp_train_dry_run_rehearses_and_starts_nothing(tmp_path: Path) -> None:
    cpu = {"CUDA_VISIBLE_DEVICES": ""}
    r = cli_in_process(["accelerator=cpu", "tp=2", "--dry-run"], tmp_path / "run", env=cpu)
    assert r.returncode == 0, r
    assert (
        "rehearsal: rank 0 of 2 (data_parallel_replicate=0 data_parallel_shard=0 tensor_parallel=0)" in r.out
    )
    assert "fake step: peak" in r.out
    assert not (tmp_path / "run").exists(), "a dry run leaves no run folder (not even Hydra's files)"
    r = cli_in_process(["-m", "tp=1,2", "--dry-run"], env=cpu)
    assert r.returncode == 2
    assert r.out.startswith("fsdp-train: error: --dry-run and --multirun cannot be combined"), r
    # The flag is the command's, not the process's: the next command in this process would train.
    from fsdp_cli.cli import main as train_main

    cli_in_process(["accelerator=cpu", "tp=3"], tmp_path / "next", env=cpu)  # (a config error: exit 2)
    assert train_main._dry_run is False


def test_a_sweep_skips_a_job_its_rehearsal_refuses_before_any_job_starts(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    args = [
        "-m",
        "model=custom",
        "model._target_=tests.assets.rehearsal_models.MisnamedPlanLM",
        "data.vocab_size=256",
        "accelerator=cpu",
        "devices=2",
        "tp=2",
        # Two nodes: a layout this machine cannot try, so the sweep rehearses it first.
        "num_nodes=2",
        "launcher.rdzv_endpoint=localhost:29999",
        "seed=1,2",
        f"hydra.sweep.dir={sweep}",
    ]
    # (Were a job launched, it would start a process: the fast tier refuses that.)
    r = cli_in_process(args, env={"CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 2, r  # skipped jobs are no failure, but no job ran
    for job in ("0", "1"):
        summary = read_summary(sweep / job)
        assert summary["status"] == "skipped"
        assert summary["reason"].startswith("tensor-parallel plan=blocks.1.proj_inn: names no module")
        assert not (sweep / job / ".heartbeat").exists()
    assert "(2 of 2 skipped as invalid)" in r.out  # decided before the first job


def _activations_per_sequence(tp: int, sp: bool) -> tuple[int, int]:
    """The plan's activations of one sequence on rank 0, and the fake step's: its peak at two
    sequences per micro-batch less its peak at one (everything else in the peak is the same)."""
    peaks, planned = [], 0
    for micro in (1, 2):
        cfg, result = rehearsed(
            "model=tiny",
            "model.n_kv_heads=4",
            "data.seq_len=256",
            "data.global_batch_size=8",
            f"data.micro_batch_size={micro}",
            f"tp={tp}",
            f"strategy.sequence_parallel={str(sp).lower()}",
            "precision=bf16-mixed",
            gpus=4,
            step=True,
        )
        assert result.step is not None
        peaks.append(result.step["peak_bytes"])
        plan = plan_for(cfg)
        assert plan is not None
        planned = plan.ranks[0].activations if micro == 1 else planned
    return planned, peaks[1] - peaks[0]


def test_the_planned_activations_under_tensor_parallel_scale_as_the_fake_steps() -> None:
    """Without sequence parallel the norms' saved tensors are whole on every tensor-parallel rank,
    only the heads' and the MLP's are split (with it, all but the all-gathered inputs of attention
    and the MLP): the plan's activations at tp=2 and 4, sequence parallel off and on, keep the
    bounds they keep at tp=1 against the fake step's: never below it, at most 25% above (the plan
    is ~18% above the step at tp=1 on this model, 8-13% at tp > 1: its backward transient is a
    whole block, more than the step's peak holds). (tp=2 with and tp=4 without sequence parallel
    held the same bounds when measured, 2026-12-06.)"""
    for tp, sp in [(1, False), (2, False), (4, True)]:
        planned, step = _activations_per_sequence(tp, sp)
        assert step <= planned <= 1.25 * step, (tp, sp, planned, step, planned / step)
