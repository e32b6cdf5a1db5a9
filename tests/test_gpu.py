"""GPU-only checks: bf16 on CUDA with NCCL, CUDA peak memory, FSDP1 CPU offload (which needs
pinned memory). Skipped, with the reason shown, on machines without a CUDA GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import assert_ok, gpu_count, read_metrics, requires_gpu, run_cli

pytestmark = [pytest.mark.gpu, pytest.mark.distributed, requires_gpu]

GPU = ["accelerator=gpu", "trainer.max_steps=20", "data.seq_len=128", "data.global_batch_size=16"]


@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp", "ddp"])
def test_bf16_mixed_on_every_visible_gpu(tmp_path: Path, strategy: str) -> None:
    run_dir = tmp_path / strategy
    summary = assert_ok(run_cli([f"strategy={strategy}", "precision=bf16-mixed", *GPU], run_dir), run_dir)
    assert summary["world_size"] == gpu_count()
    assert min(summary["peak_memory_bytes"]) > 0  # the CUDA allocator's peak, not host RSS
    rows = read_metrics(run_dir)
    assert rows[-1]["loss"] < rows[0]["loss"]
    if strategy == "fsdp2":
        assert summary["setup"]["param_device"] == ["cuda"]
        assert summary["setup"]["dtypes"]["compute"] == "bfloat16"
        assert summary["setup"]["dtypes"]["reduce"] == "float32"


def test_fsdp1_cpu_offload_on_gpu(tmp_path: Path) -> None:
    run_dir = tmp_path / "offload"
    assert_ok(run_cli(["strategy=fsdp", "strategy.cpu_offload=true", *GPU], run_dir), run_dir)


def test_fsdp2_cpu_offload_on_gpu(tmp_path: Path) -> None:
    run_dir = tmp_path / "offload2"
    summary = assert_ok(run_cli(["strategy=fsdp2", "strategy.cpu_offload=true", *GPU], run_dir), run_dir)
    assert summary["setup"]["param_device"] == ["cpu"], "the sharded parameters live in host memory"
