"""GPU-only checks: bf16 on CUDA with NCCL, CUDA peak memory, FSDP1 CPU offload (which needs
pinned memory). Skipped, with the reason shown, on machines without a CUDA GPU."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from conftest import assert_ok, gpu_count, read_metrics, requires_gpu, run_cli
from test_precision import BF16, F32, MIXED, observed

from tests.assets.live_probe import probe_env, read_probe

pytestmark = [pytest.mark.gpu, pytest.mark.distributed, requires_gpu]

GPU = ["accelerator=gpu", "trainer.max_steps=20", "data.seq_len=128", "data.global_batch_size=16"]


@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp", "ddp"])
def test_bf16_mixed_on_every_visible_gpu(tmp_path: Path, strategy: str) -> None:
    """bf16-mixed over NCCL on every visible GPU: each rank's dtypes read from its live tensors
    (tests/assets/live_probe.py, as test_precision.py does on gloo): fp32 parameters, gradients
    and Adam moments, bf16 matmuls, gradients reduced in fp32 (the dtype the NCCL collectives of
    one backward ran in); the CUDA allocator's peak in the summary, and a falling loss."""
    run_dir = tmp_path / strategy / "run"
    result = run_cli(
        [f"strategy={strategy}", "precision=bf16-mixed", *GPU], run_dir, env=probe_env(tmp_path / strategy)
    )
    summary = assert_ok(result, run_dir)
    world = gpu_count()
    assert summary["world_size"] == world
    for rank in range(world):
        probe = read_probe(tmp_path / strategy, rank)
        # With one GPU there is nothing to reduce across: FSDP2 copies instead of running NCCL.
        got = observed(probe, reduced=world > 1)
        assert got == (MIXED if got.reduce is not None else replace(MIXED, reduce=None)), (rank, probe)
    assert summary["setup"]["dtypes"] == {
        "param": F32,
        "compute": BF16,
        "reduce": F32,
        "optimizer_state": [F32],
    }
    assert min(summary["peak_memory_bytes"]) > 0  # the CUDA allocator's peak, not host RSS
    rows = read_metrics(run_dir)
    assert rows[-1]["loss"] < rows[0]["loss"]
    if strategy == "fsdp2":
        assert summary["setup"]["param_device"] == ["cuda"]


def test_fsdp1_cpu_offload_on_gpu(tmp_path: Path) -> None:
    run_dir = tmp_path / "offload"
    assert_ok(run_cli(["strategy=fsdp", "strategy.cpu_offload=true", *GPU], run_dir), run_dir)


def test_fsdp2_cpu_offload_on_gpu(tmp_path: Path) -> None:
    run_dir = tmp_path / "offload2"
    summary = assert_ok(run_cli(["strategy=fsdp2", "strategy.cpu_offload=true", *GPU], run_dir), run_dir)
    assert summary["setup"]["param_device"] == ["cpu"], "the sharded parameters live in host memory"


def _float8_capable() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.skipif(
    not _float8_capable(), reason="needs a GPU with float8 tensor cores (compute capability 8.9+)"
)
def test_float8_trains_like_bf16_over_50_steps(tmp_path: Path) -> None:
    """float8 (torchao, float8 all-gather) on one GPU: losses within 2% of bf16-mixed after 50
    steps of the 124M model, and its tokens/s reported beside bf16's."""
    common = [
        "model=llama_124m",
        "devices=1",
        "precision=bf16-mixed",
        "trainer.max_steps=50",
        "trainer.log_every_n_steps=10",
        "data.seq_len=512",
        "data.global_batch_size=8",
        "checkpoint.save_last=false",
        "accelerator=gpu",
    ]
    runs = {}
    for name, extra in (("bf16", []), ("float8", ["strategy.float8=true"])):
        run_dir = tmp_path / name
        runs[name] = assert_ok(run_cli([*common, *extra], run_dir), run_dir)
    assert runs["float8"]["setup"]["float8_linears"] == 12 * 7
    bf16, fp8 = runs["bf16"]["final_loss"], runs["float8"]["final_loss"]
    assert abs(fp8 - bf16) <= 0.02 * bf16, (bf16, fp8)
    print(f"tokens/s bf16 {runs['bf16']['tokens_per_s']:,.0f}  float8 {runs['float8']['tokens_per_s']:,.0f}")


@pytest.mark.parametrize("model", ["llama_124m", "llama_1b"])
def test_memory_plan_total_is_within_15_percent_of_the_cuda_peak(tmp_path: Path, model: str) -> None:
    """fsdp-plan's total for rank 0 against torch.cuda.max_memory_allocated of the same run."""
    from fsdp_cli.config.convert import load_train_config
    from fsdp_cli.config.resolved import ResolvedRun
    from fsdp_cli.plan.check import plan_for

    run_dir = tmp_path / model
    args = [
        f"model={model}",
        "precision=bf16-mixed",
        "trainer.max_steps=6",
        "data.seq_len=1024",
        "data.global_batch_size=4",
    ]
    summary = assert_ok(run_cli([*args, "accelerator=gpu", "checkpoint.save_last=false"], run_dir), run_dir)
    plan = plan_for(ResolvedRun.of(load_train_config(run_dir / "config.yaml")))
    assert plan is not None
    predicted, measured = plan.ranks[0].total, summary["peak_memory_bytes"][0]
    assert abs(predicted - measured) <= 0.15 * measured, (predicted, measured)


@pytest.mark.skipif(gpu_count() < 2, reason="ring attention needs 2 GPUs (one NCCL rank per GPU)")
def test_ring_attention_at_cp2_equals_one_process(tmp_path: Path) -> None:
    """cp_impl=ring (torch's ring attention, head-tail slices) at cp=2 on 2 GPUs against one GPU,
    fp32 (torch's flash and efficient kernels take bf16: bf16-true compute, fp32 masters), 8
    steps: losses within bf16's tolerance, and apart from the all-to-all form's by bf16 rounding
    only."""
    common = [
        "model=tiny",
        "precision=bf16-mixed",
        "trainer.max_steps=8",
        "data.seq_len=128",
        "data.global_batch_size=8",
        "accelerator=gpu",
        "seed=11",
        "checkpoint.save_last=false",
    ]
    layouts = {
        "one": ["devices=1"],
        "ring": ["devices=2", "cp=2", "cp_impl=ring"],
        "all_to_all": ["devices=2", "cp=2"],
    }
    losses = {}
    for name, layout in layouts.items():
        run_dir = tmp_path / name
        assert_ok(run_cli([*common, *layout], run_dir), run_dir)
        losses[name] = [row["loss"] for row in read_metrics(run_dir)]
    for name in ("ring", "all_to_all"):
        gap = max(abs(a - b) / b for a, b in zip(losses[name], losses["one"], strict=True))
        assert gap < 0.02, (name, losses)
