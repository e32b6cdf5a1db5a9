"""Checkpoints: exact resume, resume at another layout, conversion, atomicity under SIGKILL, retention, SIGTERM."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import LAYOUTS, PARITY, assert_ok, entry_point, losses, read_metrics, read_summary, run_cli

from fsdp_cli.checkpoint.callback import CheckpointCallback
from fsdp_cli.checkpoint.cli import main as ckpt_main
from fsdp_cli.checkpoint.convert import load
from fsdp_cli.config.schema import CheckpointConfig, CheckpointFormat

STEP3, STEP6 = "step_00000003", "step_00000006"


def ckpt(run_dir: Path, name: str) -> Path:
    """A run's checkpoint by step name, whichever format it was saved in."""
    for candidate in (run_dir / "checkpoints" / name, run_dir / "checkpoints" / f"{name}.pt"):
        if candidate.exists():
            return candidate
    raise FileNotFoundError(f"{run_dir}/checkpoints/{name}")


def fsdp_ckpt(*args: str) -> int:
    """``fsdp-ckpt ARGS`` in-process (the entry point itself is exercised by the inspect test)."""
    try:
        ckpt_main(list(args))
    except SystemExit as stop:
        return int(stop.code or 0)
    return 0


def assert_same_state(a: Path, b: Path) -> None:
    """Same model weights and the same optimizer moments, exactly."""
    x, y = load(a), load(b)
    assert x.state_dict.keys() == y.state_dict.keys()
    for key in x.state_dict:
        assert torch.equal(x.state_dict[key], y.state_dict[key]), key
    sx, sy = x.optimizer_states[0]["state"], y.optimizer_states[0]["state"]
    assert sx.keys() == sy.keys()
    for key in sx:
        for moment in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(torch.as_tensor(sx[key][moment]), torch.as_tensor(sy[key][moment])), (
                key,
                moment,
            )


# --------------------------------------------------------------------------- resume


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["ddp", "fsdp", "fsdp2", "fsdp2_tp2"])
def test_resume_is_bitwise_exact(tmp_path: Path, layout_run: Any, name: str) -> None:
    """6 steps straight == 3 steps, save, resume, 3 more: identical per-step losses in fp32."""
    straight = layout_run(name)
    resumed = tmp_path / "resumed"
    result = run_cli([*LAYOUTS[name], *PARITY, f"resume={ckpt(straight, STEP3)}"], resumed)
    assert_ok(result, resumed)
    assert "resuming from" in result.stderr
    assert [r["step"] for r in read_metrics(resumed)] == [4, 5, 6]
    assert losses(resumed) == losses(straight)[3:], "bitwise, not approximately"
    assert_same_state(ckpt(resumed, STEP6), ckpt(straight, STEP6))


CROSS = {
    # name: (source layout, arguments of the resumed run)
    "fsdp2_dp2_to_single_ddp": ("fsdp2", ["strategy=ddp", "devices=1"]),
    "fsdp2_dp2_to_tp2": ("fsdp2", ["strategy=fsdp2", "devices=2", "tp=2"]),
    "fsdp1_full_to_fsdp2_sharded": ("fsdp", ["strategy=fsdp2", "devices=2", "checkpoint=sharded"]),
    "fsdp2_tp2_to_fsdp1_sharded": ("fsdp2_tp2", ["strategy=fsdp", "devices=2", "checkpoint=sharded"]),
    "ddp_sharded_to_fsdp2_full": ("ddp", ["strategy=fsdp2", "devices=2", "checkpoint=full"]),
}


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(CROSS))
def test_resume_at_another_layout_keeps_weights_and_optimizer(
    tmp_path: Path, layout_run: Any, name: str
) -> None:
    source, args = CROSS[name]
    origin = ckpt(layout_run(source), STEP6)
    run_dir = tmp_path / name
    # max_steps equal to the checkpoint's step: restore, train nothing, save again in the new layout.
    result = run_cli([*args, *PARITY, f"resume={origin}"], run_dir)
    assert_ok(result, run_dir)
    assert "changed since the checkpoint (compatible, proceeding)" in result.stderr
    assert_same_state(ckpt(run_dir, STEP6), origin)


def test_resume_refuses_another_model_shape(tmp_path: Path, layout_run: Any) -> None:
    origin = ckpt(layout_run("fsdp2"), STEP6)
    result = run_cli(["strategy=fsdp2", *PARITY, "model.dim=64", f"resume={origin}"], tmp_path / "bad")
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "different model (model.dim: 128 -> 64)" in lines[0], result.stderr


def test_manifest_comparison_rules() -> None:
    from fsdp_cli.checkpoint.resume import compare
    from fsdp_cli.errors import ConfigError

    custom = {"model": {"_target_": "pkg.LM", "hidden": 256}, "dp": 2, "data": {"global_batch_size": 8}}
    with pytest.raises(ConfigError, match="model.hidden: 256 -> 512"):
        compare(custom, {**custom, "model": {"_target_": "pkg.LM", "hidden": 512}}, "ckpt")
    assert "dp: 2 -> 1" in compare(custom, {**custom, "dp": 1}, "ckpt")[0]
    micro = {"dp": 2, "data": {"global_batch_size": 8, "micro_batch_size": 2}}
    with pytest.raises(ConfigError, match="accumulation would change from 2 to 4"):
        compare(micro, {**micro, "dp": 1}, "ckpt")


def test_resume_auto_with_nothing_saved_starts_fresh(tmp_path: Path) -> None:
    from dataclasses import replace

    from conftest import composed

    from fsdp_cli.checkpoint.resume import resolve_resume

    cfg = replace(composed("resume=auto"), run_dir=str(tmp_path))
    resolved, notices = resolve_resume(cfg)
    assert resolved.resume is None and "no checkpoint" in notices[0]
    (tmp_path / "checkpoints" / "step_00000005.partial").mkdir(parents=True)  # an unfinished save
    assert resolve_resume(cfg)[0].resume is None


# --------------------------------------------------------------------------- formats and fsdp-ckpt


def test_manifest_describes_the_checkpoint(layout_run: Any) -> None:
    run_dir = layout_run("fsdp2_tp2")
    result = subprocess.run(
        [*entry_point("fsdp-ckpt"), "inspect", str(ckpt(run_dir, STEP6)), "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    info = json.loads(result.stdout)
    summary = read_summary(run_dir)
    assert (info["format"], info["step"], info["world_size"]) == ("sharded", 6, 2)
    assert info["mesh"] == {"data_parallel_replicate": 1, "data_parallel_shard": 1, "tensor_parallel": 2}
    assert info["parameter_count"] == summary["parameters"]
    assert info["dtypes"] == ["float32"] and info["optimizer_state"] is True
    assert set(info["versions"]) == {"torch", "lightning", "fsdp_cli"}
    assert info["config"]["tp"] == 2 and info["config"]["strategy"]["name"] == "fsdp2"
    table = subprocess.run(
        [*entry_point("fsdp-ckpt"), "inspect", str(ckpt(run_dir, STEP6))],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "tensor_parallel=2" in table.stdout and "trained with:" in table.stdout


def test_full_checkpoints_load_with_weights_only(layout_run: Any) -> None:
    data = torch.load(ckpt(layout_run("fsdp"), STEP6), map_location="cpu", weights_only=True)
    assert {"state_dict", "optimizer_states", "fsdp_cli_manifest"} <= set(data)


def test_sharded_checkpoints_are_plain_dcp(layout_run: Any, tmp_path: Path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(ckpt(layout_run("fsdp2"), STEP6), tmp_path / "plain.pt")
    plain = torch.load(tmp_path / "plain.pt", weights_only=True)
    assert "model.tok_embeddings.weight" in plain["state_dict"]


def test_convert_every_direction_keeps_the_weights(layout_run: Any, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    sharded, full = ckpt(layout_run("fsdp2"), STEP6), ckpt(layout_run("fsdp"), STEP6)
    out = tmp_path / "converted"

    for src, dst, to in (
        (sharded, out / "a.pt", "full"),
        (full, out / "b", "sharded"),
        (out / "a.pt", out / "c", "sharded"),
        (out / "b", out / "d.pt", "full"),
    ):
        assert fsdp_ckpt("convert", str(src), str(dst), "--to", to) == 0
    assert_same_state(out / "a.pt", sharded)
    assert_same_state(out / "b", full)
    assert_same_state(out / "c", sharded)
    assert_same_state(out / "d.pt", full)
    for src in (sharded, full):
        dst = out / f"{src.name}.safetensors"
        assert fsdp_ckpt("convert", str(src), str(dst), "--to", "safetensors") == 0
        weights = load_file(str(dst))
        model = load(src).state_dict
        assert weights.keys() == {k.removeprefix("model.") for k in model}
        assert all(torch.equal(weights[k.removeprefix("model.")], v) for k, v in model.items())
    assert fsdp_ckpt("convert", str(full), str(out / "a.pt"), "--to", "full") == 2, "never overwrites"


def test_fsdp_ckpt_errors_are_one_line(
    layout_run: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = ckpt(layout_run("fsdp2"), STEP6)
    broken = tmp_path / "broken"
    shutil.copytree(source, broken)
    (broken / "__1_0.distcp").unlink()
    partial = tmp_path / "step_00000009.partial"
    shutil.copytree(source, partial)
    not_ckpt = tmp_path / "notes.txt"
    not_ckpt.write_text("hello")
    for path, words in (
        (broken, "missing shard file(s) __1_0.distcp"),
        (partial, "incomplete save"),
        (tmp_path, "not a sharded checkpoint"),
        (tmp_path / "nope", "no such file"),
        (not_ckpt, "not an fsdp-train checkpoint"),
    ):
        assert fsdp_ckpt("inspect", str(path)) == 2, path
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("fsdp-ckpt: error: ") and words in lines[0], (
            words,
            lines,
        )


def test_retention_keeps_the_newest_complete_checkpoints(tmp_path: Path) -> None:
    directory = tmp_path / "checkpoints"
    directory.mkdir()
    for step in (2, 4, 6):
        (directory / f"step_{step:08d}").mkdir()
        (directory / f"step_{step:08d}" / ".metadata").write_text("x")
        time.sleep(0.01)
    (directory / "step_00000008.partial").mkdir()  # a save still running (or killed): never counts
    callback = CheckpointCallback(CheckpointConfig(keep_last=1), directory, max_steps=10)
    callback.prune()
    assert sorted(p.name for p in directory.iterdir()) == ["step_00000006", "step_00000008.partial"]
    # keep_last can never delete the only complete checkpoint.
    callback.config = CheckpointConfig(keep_last=1, format=CheckpointFormat.sharded)
    callback.prune()
    assert (directory / "step_00000006").is_dir()


# --------------------------------------------------------------------------- failures


def _start(args: list[str], run_dir: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*entry_point("fsdp-train"), *args, f"hydra.run.dir={run_dir}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **env},
        cwd=Path(__file__).resolve().parents[1],
    )


def _wait_for(predicate: Any, proc: subprocess.Popen[str], timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"run ended early ({proc.returncode}): {proc.stderr.read()[-3000:]}")
        if time.time() > deadline:
            proc.kill()
            raise AssertionError("timed out")
        time.sleep(0.1)


@pytest.mark.distributed
def test_sigkill_during_a_save_leaves_the_previous_checkpoint(tmp_path: Path, layout_run: Any) -> None:
    run_dir = tmp_path / "killed"
    marker = tmp_path / "in_save"
    args = ["strategy=fsdp2", "devices=2", *PARITY, "checkpoint.every_n_steps=2"]
    env = {
        "FSDP_CLI_TEST_PAUSE_IN_SAVE": "60",
        "FSDP_CLI_TEST_PAUSE_IN_SAVE_MARKER": str(marker),
        "FSDP_CLI_TEST_PAUSE_AT_STEP": "4",
    }
    proc = _start(args, run_dir, env)
    _wait_for(lambda: len(list(tmp_path.glob("in_save.rank*"))) == 2, proc)
    victim = int((tmp_path / "in_save.rank1").read_text())
    os.kill(victim, signal.SIGKILL)  # rank 1 dies with its shard written but the save not yet renamed
    proc.communicate(timeout=120)
    assert proc.returncode != 0
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert names == ["step_00000002", "step_00000004.partial"], names

    result = run_cli([*args, "resume=auto"], run_dir)
    assert_ok(result, run_dir)
    assert "resuming from" in result.stderr and "step_00000002 (step 2)" in result.stderr
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert losses(run_dir) == losses(layout_run("fsdp2")), "the resumed run continues exactly"
    # keep_last=2 after the resumed saves at 4 and 6; the stale partial save is gone.
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000004", "step_00000006"]


@pytest.mark.distributed
def test_sigterm_saves_then_exits_preempted_and_resume_continues(tmp_path: Path) -> None:
    run_dir = tmp_path / "preempted"
    args = ["strategy=fsdp2", "devices=2", "accelerator=cpu", "data.seq_len=32", "trainer.max_steps=100000"]
    proc = _start(args, run_dir, {})
    metrics = run_dir / "metrics.jsonl"
    _wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 2, proc)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)
    assert proc.returncode == 143
    summary = read_summary(run_dir)
    assert summary["status"] == "preempted"
    saved = Path(summary["checkpoint"])
    step = int(saved.name.split("_")[1])
    assert saved.exists() and step == summary["steps"] >= 2

    result = run_cli([*args[:-1], f"trainer.max_steps={step + 2}", "resume=auto"], run_dir)
    assert_ok(result, run_dir)
    assert f"step {step}" in result.stderr
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, step + 3))
