"""Shared helpers: run ``fsdp-train`` as a user would, and read what a run leaves behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
ASSETS = Path(__file__).resolve().parent / "assets"
# `tests.assets.*` models are named by dotted path, as a user names theirs. Appended, not
# prepended: fsdp_cli itself must come from the installed package (whose configs ship inside it).
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))

# Small and quick, but every layout below still has something to shard and split.
FAST = ["trainer.max_steps=6", "data.global_batch_size=8", "data.seq_len=32"]


def entry_point(name: str) -> list[str]:
    """The installed console script (as a user runs it), or its module when run from a checkout."""
    script = Path(sys.executable).parent / name
    if script.is_file():
        return [str(script)]
    module = {
        "fsdp-train": "fsdp_cli.cli.main",
        "fsdp-ckpt": "fsdp_cli.checkpoint.cli",
        "fsdp-plan": "fsdp_cli.cli.plan",
    }[name]
    return [sys.executable, "-m", module]


def run_cli(
    args: list[str],
    run_dir: Path | None = None,
    *,
    env: dict[str, str] | None = None,
    timeout: float = 300,
    cwd: Path | None = None,
    prog: str = "fsdp-train",
) -> subprocess.CompletedProcess[str]:
    """``fsdp-train ARGS hydra.run.dir=RUN_DIR`` in a subprocess, exactly as a user types it."""
    cmd = [*entry_point(prog), *args]
    if run_dir is not None:
        cmd.append(f"hydra.run.dir={run_dir}")
    full_env = {**os.environ, **(env or {})}
    full_env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd or REPO)


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def read_summary(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "summary.json").read_text())


def losses(run_dir: Path) -> list[float]:
    return [row["loss"] for row in read_metrics(run_dir)]


def assert_ok(result: subprocess.CompletedProcess[str], run_dir: Path) -> dict[str, Any]:
    """The run exited 0 and its summary says ok; returns the summary."""
    tail = result.stdout[-3000:] + "\n" + result.stderr[-3000:]
    assert result.returncode == 0, f"exit {result.returncode}\n{tail}"
    summary = read_summary(run_dir)
    assert summary["status"] == "ok", summary
    return summary


def composed(*overrides: str) -> Any:
    """The typed config ``fsdp-train OVERRIDES`` would run (before layout resolution)."""
    from hydra import compose, initialize_config_module

    from fsdp_cli.config.convert import to_train_config
    from fsdp_cli.config.store import register_schemas

    register_schemas()
    with initialize_config_module(config_module="fsdp_cli.configs", version_base="1.3"):
        cfg = compose(config_name="train", overrides=list(overrides))
    return to_train_config(cfg)


# The fp32 settings every loss-parity comparison uses; the single-process run is the reference.
# Each run also leaves checkpoints at steps 3 and 6, which the checkpoint tests resume from.
PARITY = [*FAST, "precision=32-true", "accelerator=cpu", "seed=11", "checkpoint.every_n_steps=3"]
SINGLE_PROCESS = ["strategy=ddp", "devices=1"]
# Runs shared across test modules (started at most once per session, on first use).
LAYOUTS = {
    "single": SINGLE_PROCESS,
    "ddp": ["strategy=ddp", "devices=2"],
    "fsdp2": ["strategy=fsdp2", "devices=2"],
    "fsdp2_tp2": ["strategy=fsdp2", "devices=2", "tp=2"],
    "fsdp": ["strategy=fsdp", "devices=2", "checkpoint=full"],
}


@pytest.fixture(scope="session")
def layout_run(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``layout_run(name)`` -> the run directory of ``LAYOUTS[name]`` with ``PARITY`` settings."""
    root = tmp_path_factory.mktemp("layouts")
    done: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in done:
            run_dir = root / name
            assert_ok(run_cli([*LAYOUTS[name], *PARITY], run_dir), run_dir)
            done[name] = run_dir
        return done[name]

    return get


@pytest.fixture(scope="session")
def reference_losses(layout_run: Any) -> list[float]:
    """Per-step losses of the single-process fp32 run that every layout must reproduce."""
    return losses(layout_run("single"))


def assert_same_losses(reference: list[float], run_dir: Path, tol: float = 1e-5) -> None:
    other = losses(run_dir)
    assert len(other) == len(reference) >= 5
    diffs = [abs(a - b) for a, b in zip(reference, other)]
    assert max(diffs) < tol, diffs


def gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001
        return 0


requires_gpu = pytest.mark.skipif(gpu_count() == 0, reason="needs a CUDA GPU; none on this machine")
