"""Real runs through ``fsdp-train``: 1-2 CPU processes on gloo, every output file, loss parity across layouts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    LAYOUTS,
    assert_ok,
    assert_same_losses,
    entry_point,
    losses,
    read_metrics,
    read_summary,
    run,
    run_cli,
)

pytestmark = pytest.mark.distributed

SUMMARY_FIELDS = (
    "status",
    "error",
    "strategy",
    "world_size",
    "dp",
    "tp",
    "precision",
    "steps",
    "final_loss",
    "tokens_per_s",
    "step_time_s",
    "peak_memory_bytes",
    "checkpoint",
)


@pytest.mark.parametrize("name", ["single", "ddp", "fsdp2", "fsdp2_tp2"])
def test_run_writes_config_metrics_and_summary(layout_run: Any, name: str) -> None:
    run_dir = layout_run(name)
    config = (run_dir / "config.yaml").read_text()
    assert "devices: auto" not in config and "dp: auto" not in config, "config.yaml is fully resolved"
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    for row in rows:
        assert row["loss"] > 0 and row["lr"] > 0 and row["step_time_s"] > 0 and row["tokens_per_s"] > 0
    summary = read_summary(run_dir)
    assert set(SUMMARY_FIELDS) <= set(summary)
    world = 1 if name == "single" else 2
    tp = 2 if name == "fsdp2_tp2" else 1
    expected = {
        "status": "ok",
        "error": None,
        "world_size": world,
        "dp": world // tp,
        "tp": tp,
        "precision": "32-true",
        "steps": 6,
        "final_loss": rows[-1]["loss"],
    }
    assert {k: summary[k] for k in expected} == expected
    assert summary["strategy"] == LAYOUTS[name][0].split("=")[1]
    assert len(summary["peak_memory_bytes"]) == world and min(summary["peak_memory_bytes"]) > 0
    assert summary["tokens_per_s"] > 0 and summary["step_time_s"] > 0
    assert Path(summary["checkpoint"]).exists()


@pytest.mark.parametrize(
    ("name", "started"),
    [("fsdp2", "forkserver"), ("fsdp2_tp2", "forkserver"), ("fsdp", "fork"), ("ddp", "subprocess")],
)
def test_ranks_are_forked_from_what_the_agent_imported_once(layout_run: Any, name: str, started: str) -> None:
    """``launcher.start_method=forkserver`` (the default): every rank starts with torch and
    Lightning already imported, forked by the agent's forkserver, and every rank still names the
    agent as the one that started it; ``fork`` (the fsdp run): imported too, forked by the agent
    itself; ``subprocess`` (the ddp run): each rank imports them itself, a child of the agent. Each
    run's losses match one process (below and in test_fsdp1)."""
    headers = [
        json.loads(path.read_text().splitlines()[0])
        for path in sorted((layout_run(name) / ".heartbeat").glob("rank[0-9]*"))
        if path.suffix != ".tmp"
    ]
    assert len(headers) == 2 and len({h["parent"] for h in headers}) == 1, headers
    assert [h["preloaded"] for h in headers] == [started != "subprocess"] * 2, headers
    by_agent = [h["forked_by"] == h["parent"] for h in headers]
    assert by_agent == [started != "forkserver"] * 2, headers
    assert len({h["forked_by"] for h in headers}) == 1, headers


@pytest.mark.parametrize("name", ["ddp", "fsdp2", "fsdp2_tp2"])
def test_losses_match_single_process(layout_run: Any, name: str) -> None:
    """Same seed, same global batch, fp32: the layout must not change what is learned."""
    reference = losses(layout_run("single"))
    assert_same_losses(reference, layout_run(name))
    assert reference[-1] < reference[0], "the model learns"


def test_default_run_is_fsdp2_over_two_cpu_processes(tmp_path: Path) -> None:
    run_dir = tmp_path / "default"
    result = run_cli([], run_dir, env={"CUDA_VISIBLE_DEVICES": ""})
    summary = assert_ok(result, run_dir)
    assert (summary["strategy"], summary["world_size"], summary["dp"], summary["steps"]) == (
        "fsdp2",
        2,
        2,
        30,
    )
    assert "fsdp-train ok" in result.stdout and "tokens/s" in result.stdout  # the summary table
    rows = read_metrics(run_dir)
    assert len(rows) == 30 and rows[-1]["loss"] < rows[0]["loss"] - 1.0


def test_inside_torchrun_each_process_trains_as_its_rank(tmp_path: Path) -> None:
    """Under an existing torchrun (or srun) job fsdp-train launches nothing: every process is a
    rank. The model is a plain nn.Module from a test file, trained under fsdp2 as a causal LM."""
    import sys

    run_dir = tmp_path / "torchrun"
    # As a user writes it: `torchrun --nproc-per-node 2 --no-python fsdp-train ...`
    script = entry_point("fsdp-train")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        *(["--no-python"] if len(script) == 1 else []),
        *script,
        "model=custom",
        "model._target_=tests.assets.custom_models.TinyLM",
        "+model.hidden=32",
        "data.vocab_size=256",
        "strategy=fsdp2",
        "accelerator=cpu",
        "trainer.max_steps=8",
        f"hydra.run.dir={run_dir}",
    ]
    result = run(cmd, timeout=300, run_dir=run_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = read_summary(run_dir)
    assert (summary["status"], summary["world_size"], summary["dp"]) == ("ok", 2, 2)
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 9)), "one job of two ranks, not two jobs"
    assert (run_dir / "logs" / "rank1.log").exists()
    assert (summary["strategy"], summary["model"]) == ("fsdp2", "tests.assets.custom_models.TinyLM")
    assert summary["parameters"] > 0 and rows[-1]["loss"] < rows[0]["loss"]
