"""Throughput and communication: no gradient sync on accumulation micro-batches (DDP here; FSDP2/HSDP
in test_fsdp2, FSDP1 in test_fsdp1), the profiler's trace, TFLOP/s and MFU, the progress lines."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import PARITY, assert_ok, assert_same_losses, composed, read_metrics, run_cli, run_of

from fsdp_cli.callbacks.progress import ProgressDisplay, format_eta, plain_line
from fsdp_cli.callbacks.throughput import (
    Throughput,
    counted_flops_per_token,
    device_peak_tflops,
    llama_flops_per_token,
)
from fsdp_cli.config.schema import LlamaConfig
from tests.assets.traces import ALL_REDUCE, BROADCAST, collectives_per_backward, inside, rank0_trace

DDP_ACCUMULATING = ["strategy=ddp", "devices=2", "data.micro_batch_size=2", "trainer.profiler=torch"]


@pytest.mark.distributed
def test_ddp_accumulation_all_reduces_once_per_step_and_keeps_the_losses(
    tmp_path: Path, reference_losses: list[float]
) -> None:
    run_dir = tmp_path / "ddp_accumulation"
    result = run_cli([*DDP_ACCUMULATING, *PARITY, "trainer.peak_tflops=2.0"], run_dir)
    summary = assert_ok(result, run_dir)
    assert_same_losses(reference_losses, run_dir)
    # Two profiled steps of two micro-batches: DDP's bucket all-reduces run in the last backward
    # of each step only (Lightning's no_sync on the first).
    counts = collectives_per_backward(run_dir, ALL_REDUCE)
    assert len(counts) == 4 and counts[0] != counts[1], counts
    assert sorted(counts)[:2] == [0, 0] and min(sorted(counts)[2:]) > 0, counts
    # No buffer broadcast before each forward: the built-in model's buffers are RoPE tables.
    # (Checkpoint saves broadcast their plans: only training steps are looked at.)
    events = rank0_trace(run_dir)
    steps = [
        e
        for e in events
        if e["name"].startswith("[pl][profile][Strategy]") and e["name"].endswith(".training_step")
    ]
    assert len(steps) == 4, [e["name"] for e in steps]
    assert not [b for b in events if b["name"] == BROADCAST and any(inside(b, s) for s in steps)]
    # TFLOP/s per rank from the model's FLOPs per token; MFU against the peak the config gave.
    rows = read_metrics(run_dir)
    for row in rows:
        assert row["tflops_per_s"] > 0
        assert row["mfu"] == pytest.approx(row["tflops_per_s"] / 2.0)
    assert summary["mfu"] == pytest.approx(summary["tflops_per_s"] / 2.0)
    # Not a terminal: one plain line per logged step, no terminal control codes.
    lines = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert [int(re.match(r"step +(\d+)/6", line).group(1)) for line in lines] == [1, 2, 3, 4, 5, 6]
    assert all("tok/s" in line and "eta" in line and "peak mem" in line for line in lines)
    assert "\x1b[" not in result.stdout


def test_llama_flop_formula_equals_torchs_flop_counter() -> None:
    """6N + 12 L d T is exactly what FlopCounterMode counts for the built-in model (forward,
    cross-entropy, backward), with untied and with tied embeddings."""
    from fsdp_cli.models.llama import Llama

    for tied in (False, True):
        cfg = LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, tie_embeddings=tied)
        counted = counted_flops_per_token(lambda cfg=cfg: Llama(cfg), seq_len=32, vocab_size=256)
        assert counted == pytest.approx(llama_flops_per_token(cfg, 32), rel=1e-9)


def test_flops_are_counted_for_a_plain_module_and_peaks_come_from_the_table() -> None:
    from tests.assets.custom_models import TinyLM

    flops = counted_flops_per_token(lambda: TinyLM(vocab_size=256, hidden=32), seq_len=16, vocab_size=256)
    params = sum(p.numel() for p in TinyLM(vocab_size=256, hidden=32).parameters())
    assert flops is not None and 0.5 * 6 * params < flops < 6 * params  # embeddings do no matmul
    assert counted_flops_per_token(lambda: TinyLM(), seq_len=16, vocab_size=256) == flops
    built = TinyLM()
    assert counted_flops_per_token(lambda: built, seq_len=16, vocab_size=256) is None  # already materialised
    assert device_peak_tflops("NVIDIA H100 80GB HBM3", "bf16-mixed") == 989.5
    assert device_peak_tflops("NVIDIA H100 PCIe", "bf16-mixed") == 756.5
    assert device_peak_tflops("NVIDIA A100-SXM4-80GB", "32-true") == 19.5
    assert device_peak_tflops("cpu", "32-true") is None
    no_peak = Throughput(flops_per_token=1e9, world_size=2, peak_tflops=None).fields(4000.0)
    assert no_peak == {"tflops_per_s": pytest.approx(2.0), "mfu": None}


def test_progress_line_and_eta() -> None:
    row = {"step": 12, "loss": 2.5, "lr": 3e-4, "step_time_s": 0.1, "tokens_per_s": 12345.0, "mfu": 0.42}
    line = plain_line(row, 30, eta_s=75.0, memory_bytes=3 * 2**20)
    assert line.split()[:4] == ["step", "12/30", "loss", "2.5000"]
    assert (
        "12,345 tok/s" in line and "mfu 42.0%" in line and "peak mem 3 MiB" in line and "eta 0:01:15" in line
    )
    assert format_eta(None) == "-:--:--" and format_eta(3725) == "1:02:05"


def test_progress_is_a_live_rich_line_on_a_terminal(capsys: Any) -> None:
    """On a terminal the display is rich's live progress (redrawn in place), not printed lines."""

    class Rows:
        rows: list[dict[str, Any]] = []

    class FakeTrainer:  # just what the display reads
        is_global_zero = True
        global_step = 0
        estimated_stepping_batches = 10  # the run's planned steps (max_steps, or where epochs end it)
        strategy = type("S", (), {"root_device": torch.device("cpu")})()

    display = ProgressDisplay(Rows(), max_steps=10, interactive=True)  # type: ignore[arg-type]
    display.on_train_start(FakeTrainer(), None)  # type: ignore[arg-type]
    Rows.rows.append({"step": 1, "loss": 3.0, "lr": 1e-3, "step_time_s": 0.1, "tokens_per_s": 100.0})
    display.on_train_batch_end(FakeTrainer(), None)  # type: ignore[arg-type]
    assert display._live is not None and display._live.tasks[0].completed == 1
    display.close()
    assert "step      1/10" not in capsys.readouterr().out


def test_ddp_broadcasts_buffers_only_for_models_that_may_need_it() -> None:
    """The built-in Llama's buffers are derived (RoPE tables): no broadcast before every forward;
    any other model keeps DDP's default (BatchNorm statistics stay in step); the key overrides."""
    from fsdp_cli.builders.strategy import build_ddp
    from fsdp_cli.compat.torch_internals import ddp_buffer_sync

    builtin = composed("strategy=ddp", "devices=2", "accelerator=cpu")
    custom = composed(
        "strategy=ddp",
        "devices=2",
        "accelerator=cpu",
        "model=custom",
        "model._target_=tests.assets.custom_models.TinyLM",
    )
    forced = composed("strategy=ddp", "devices=2", "accelerator=cpu", "strategy.broadcast_buffers=true")
    kwargs = {
        name: build_ddp(run_of(cfg))._ddp_kwargs[next(iter(ddp_buffer_sync(True)))]
        for name, cfg in (("builtin", builtin), ("custom", custom), ("forced", forced))
    }
    assert kwargs == {"builtin": False, "custom": True, "forced": True}
