"""Checkpoints: exact resume, resume at another layout, conversion, atomicity under SIGKILL, retention, SIGTERM."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import (
    LAYOUTS,
    PARITY,
    assert_ok,
    assert_same_losses,
    complete_lines,
    losses,
    read_metrics,
    read_pid,
    read_summary,
    run_cli,
    start_cli,
    wait_for,
)
from harness import Job, gone, processes_naming

from fsdp_cli.checkpoint.callback import CheckpointCallback
from fsdp_cli.checkpoint.convert import load
from fsdp_cli.checkpoint.run import newest_verified
from fsdp_cli.cli.ckpt import main as ckpt_main
from fsdp_cli.config.schema import CheckpointConfig
from fsdp_cli.rundir.heartbeat import read_heartbeats

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
@pytest.mark.parametrize("name", ["ddp", "fsdp"])
def test_resume_is_bitwise_exact(tmp_path: Path, layout_run: Any, name: str) -> None:
    """6 steps straight == 3 steps, save, resume, 3 more: identical per-step losses in fp32.
    (FSDP2 and FSDP2 x TP resume as exactly after a SIGKILL mid-save:
    test_sigkill_during_a_save_leaves_the_previous_checkpoint, whose resumed runs compare the same
    losses and weights.)"""
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
def test_resume_at_another_layout_continues_like_the_straight_run(
    tmp_path: Path, layout_run: Any, name: str
) -> None:
    """Load step 3 of one layout into another, train steps 4-6 there: the same per-step losses as
    the straight run (to the cross-layout tolerance; a wrong restore of weights or Adam moments
    shows at once), and the state it saves at step 6, in its own layout and format, the straight
    run's step 6 (weights and Adam moments, to the same relative tolerance)."""
    source, args = CROSS[name]
    straight = layout_run(source)
    run_dir = tmp_path / name
    result = run_cli([*args, *PARITY, f"resume={ckpt(straight, STEP3)}"], run_dir)
    assert_ok(result, run_dir)
    assert "changed since the checkpoint (compatible, proceeding)" in result.stderr
    assert [r["step"] for r in read_metrics(run_dir)] == [4, 5, 6]
    assert_same_losses(losses(straight)[3:], run_dir, minimum=3)
    assert_close_state(ckpt(run_dir, STEP6), ckpt(straight, STEP6))


def assert_close_state(a: Path, b: Path, rtol: float = 1e-4) -> None:
    """Same weights and Adam moments up to the reduction order of another layout: each tensor's
    difference is below ``rtol`` of its norm."""
    x, y = load(a), load(b)
    sx, sy = x.optimizer_states[0]["state"], y.optimizer_states[0]["state"]
    assert x.state_dict.keys() == y.state_dict.keys() and sx.keys() == sy.keys()
    pairs = [(key, x.state_dict[key], y.state_dict[key]) for key in x.state_dict]
    pairs += [((k, m), sx[k][m], sy[k][m]) for k in sx for m in ("exp_avg", "exp_avg_sq", "step")]
    for key, u, v in pairs:
        u, v = torch.as_tensor(u, dtype=torch.float64), torch.as_tensor(v, dtype=torch.float64)
        assert u.shape == v.shape and torch.linalg.norm(u - v) <= rtol * torch.linalg.norm(v), key


@pytest.mark.distributed
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


@pytest.mark.distributed
def test_manifest_describes_the_checkpoint(layout_run: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """``fsdp-ckpt inspect --json`` as a user runs it (the one test starting the command itself),
    then its table, in-process."""
    run_dir = layout_run("fsdp2_tp2")
    result = run_cli(["inspect", str(ckpt(run_dir, STEP6)), "--json"], prog="fsdp-ckpt", timeout=120)
    assert result.returncode == 0, result
    info = json.loads(result.stdout)
    summary = read_summary(run_dir)
    assert (info["format"], info["step"], info["world_size"]) == ("sharded", 6, 2)
    assert info["mesh"] == {"data_parallel_replicate": 1, "data_parallel_shard": 1, "tensor_parallel": 2}
    assert info["parameter_count"] == summary["parameters"]
    assert info["dtypes"] == ["float32"] and info["optimizer_state"] is True
    assert set(info["versions"]) == {"torch", "lightning", "fsdp_cli"}
    assert info["config"]["tp"] == 2 and info["config"]["strategy"]["name"] == "fsdp2"
    capsys.readouterr()
    assert fsdp_ckpt("inspect", str(ckpt(run_dir, STEP6))) == 0
    table = capsys.readouterr().out
    assert "tensor_parallel=2" in table and "trained with:" in table, table


@pytest.mark.distributed
def test_full_checkpoints_load_with_weights_only(layout_run: Any) -> None:
    data = torch.load(ckpt(layout_run("fsdp"), STEP6), map_location="cpu", weights_only=True)
    assert {"state_dict", "optimizer_states", "fsdp_cli_manifest"} <= set(data)


@pytest.mark.distributed
def test_sharded_checkpoints_are_plain_dcp(layout_run: Any, tmp_path: Path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(ckpt(layout_run("fsdp2"), STEP6), tmp_path / "plain.pt")
    plain = torch.load(tmp_path / "plain.pt", weights_only=True)
    assert "model.tok_embeddings.weight" in plain["state_dict"]


def plain_state(path: Path, scratch: Path) -> tuple[dict[str, torch.Tensor], dict[Any, Any]]:
    """Model weights and optimizer state read without fsdp_cli: ``torch.load`` for a full file,
    torch's own DCP converter for a sharded folder."""
    if path.is_dir():
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        whole = scratch / f"{path.name}.plain.pt"
        dcp_to_torch_save(path, whole)
        data = torch.load(whole, map_location="cpu", weights_only=True)
        return data["state_dict"], data["optimizer_states"]["0"]["state"]
    data = torch.load(path, map_location="cpu", weights_only=True)
    # A full file numbers the parameters (torch's layout); its manifest lists the names they stand for.
    names = data["fsdp_cli_manifest"]["parameter_names"]
    return data["state_dict"], {names[i]: v for i, v in data["optimizer_states"][0]["state"].items()}


def assert_plainly_equal(a: Path, b: Path, scratch: Path) -> None:
    (wa, oa), (wb, ob) = plain_state(a, scratch), plain_state(b, scratch)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert oa.keys() == ob.keys()
    for key in oa:
        for moment in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(torch.as_tensor(oa[key][moment]), torch.as_tensor(ob[key][moment])), (
                key,
                moment,
            )


@pytest.mark.distributed
def test_convert_every_direction_keeps_the_weights(layout_run: Any, tmp_path: Path) -> None:
    """Checked by independent readers (torch.load, torch's DCP converter, safetensors), not by
    the reader fsdp-ckpt itself uses."""
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
        assert fsdp_ckpt("verify", "--deep", str(dst)) == 0
    assert_plainly_equal(out / "a.pt", sharded, tmp_path)
    assert_plainly_equal(out / "b", full, tmp_path)
    assert_plainly_equal(out / "c", sharded, tmp_path)
    assert_plainly_equal(out / "d.pt", full, tmp_path)
    for src in (sharded, full):
        dst = out / f"{src.name}.safetensors"
        assert fsdp_ckpt("convert", str(src), str(dst), "--to", "safetensors") == 0
        weights, (model, _) = load_file(str(dst)), plain_state(src, tmp_path)
        assert weights.keys() == {k.removeprefix("model.") for k in model}
        assert all(torch.equal(weights[k.removeprefix("model.")], v) for k, v in model.items())
    assert fsdp_ckpt("convert", str(full), str(out / "a.pt"), "--to", "full") == 2, "never overwrites"


@pytest.mark.distributed
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
        (tmp_path, "no checkpoint in this folder"),  # (inspect takes a folder of checkpoints, as verify does)
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

    def make(name: str, age: int) -> None:
        (directory / name).mkdir()
        (directory / name / ".metadata").write_text("x")
        if not name.endswith(".partial"):  # this run's saves (test_input_files: another run's)
            (directory / name / "manifest.json").write_text(json.dumps({"step": 1, "run_id": "this-run"}))
        os.utime(directory / name, (time.time() - age, time.time() - age))

    make("step_00000002", 50)
    make("step_00000001.partial", 60)  # an interrupted save of unknown owner: left alone
    make("step_00000004", 40)
    make("step_00000006", 30)
    make("step_00000008.partial", 0)  # a save still running: never counts, never deleted
    callback = CheckpointCallback(CheckpointConfig(keep_last=2), directory, max_steps=10, run_id="this-run")
    assert [p.name for p in callback.prune()] == ["step_00000002"]
    assert sorted(p.name for p in directory.iterdir()) == [
        "step_00000001.partial",
        "step_00000004",
        "step_00000006",
        "step_00000008.partial",
    ]
    # keep_last=0 is refused by validation; even so, the newest complete checkpoint is never deleted.
    callback.config = CheckpointConfig(keep_last=0)
    callback.prune()
    assert sorted(p.name for p in directory.iterdir()) == [
        "step_00000001.partial",
        "step_00000006",
        "step_00000008.partial",
    ]


def test_replacing_a_checkpoint_leaves_no_moment_without_one(tmp_path: Path) -> None:
    from fsdp_cli.checkpoint.atomic import OLD_SUFFIX, recover_interrupted_replace, replace_atomically

    final, partial = tmp_path / "step_00000003", tmp_path / "step_00000003.partial"
    for folder, text in ((final, "old"), (partial, "new")):
        folder.mkdir()
        (folder / "data").write_text(text)
    replace_atomically(partial, final)
    assert (final / "data").read_text() == "new" and not partial.exists()
    # The two-rename fallback (filesystems without renameat2) interrupted between its renames:
    os.replace(final, tmp_path / f"step_00000003{OLD_SUFFIX}")
    assert recover_interrupted_replace(tmp_path) == [
        "note: restored step_00000003, whose replacement was interrupted"
    ]
    assert (final / "data").read_text() == "new"


# --------------------------------------------------------------------------- kills at every phase of a save

# phase: (layout, extra arguments, step to pause at, ranks that pause there, what is killed: a
# rank by number, torch's agent or fsdp-train itself). Each run saves every 2 or 3 steps and is
# SIGKILLed while saving; what is left must be loadable and continue exactly. Resumed after the
# kill, the fsdp2 and fsdp2_tp2 runs are also the exact-resume tests of those layouts.
KILL_PHASES: dict[str, tuple[str, list[str], int, int, int | str]] = {
    # rank 1 dies with its shard written, .metadata not yet (rank 0 still writing its own)
    "while_shards_are_written": ("fsdp2", ["+FSDP_CLI_TEST_PAUSE_PHASE=shards"], 6, 2, 1),
    # every rank has written its shard and rank 0 the manifest; the rename has not happened
    "before_rename": ("fsdp2_tp2", ["checkpoint.every_n_steps=2"], 4, 2, 1),
    # async: the shards are being written in the background while training goes on
    "async_while_shards_are_written": (
        "fsdp2",
        ["checkpoint.every_n_steps=2", "checkpoint.async_save=true", "+FSDP_CLI_TEST_PAUSE_PHASE=shards"],
        4,
        2,
        1,
    ),
    # the new checkpoint is visible, older ones not pruned yet; torch's agent alone is killed (the
    # out-of-memory killer's pick): its ranks and fsdp-train end with it
    "after_rename_agent_killed": ("ddp", ["+FSDP_CLI_TEST_PAUSE_PHASE=after_rename"], 3, 2, "agent"),
    # a full (one-file) save, written by rank 0 but not renamed; fsdp-train alone is killed (a
    # scheduler's hard kill): its agent and ranks end with it
    "full_format_fsdp_train_killed": ("fsdp", [], 6, 1, "fsdp-train"),
}


def _phase_env(args: list[str], marker: Path, step: int) -> tuple[list[str], dict[str, str]]:
    """Pseudo-arguments ``+FSDP_CLI_TEST_PAUSE_PHASE=...`` become environment variables."""
    env = {
        "FSDP_CLI_TEST_PAUSE_IN_SAVE": "120",
        "FSDP_CLI_TEST_PAUSE_IN_SAVE_MARKER": str(marker),
        "FSDP_CLI_TEST_PAUSE_AT_STEP": str(step),
    }
    plain = []
    for arg in args:
        if arg.startswith("+FSDP_CLI_TEST_"):
            key, value = arg[1:].split("=", 1)
            env[key] = value
        else:
            plain.append(arg)
    return plain, env


def all_or_none(values: list[Any]) -> list[Any] | None:
    return values if all(values) else None


def _kill_and_wait(proc: Job, pid: int, run_dir: Path) -> int:
    os.kill(pid, signal.SIGKILL)
    proc.communicate(timeout=120)
    assert processes_naming(str(run_dir)) == []
    return proc.returncode


def _kill_launcher_and_wait(proc: Job, killed: str, run_dir: Path) -> int:
    """SIGKILL fsdp-train or torch's agent alone: every process of the run, the ranks (which lead
    sessions of their own, out of reach of the command's process group) included, ends with it
    (tests/test_cleanup.py: what the harness does when a test ends)."""
    beats = read_heartbeats(run_dir)
    agent, ranks = beats[0].parent, {beat.pid for beat in beats.values()}
    everything = proc.processes()
    assert {proc.pid, agent, *ranks} <= set(everything), everything
    os.kill(proc.pid if killed == "fsdp-train" else agent, signal.SIGKILL)
    print(f"SIGKILL of {killed}: its run gone after {gone(proc, everything):.1f} s")
    code = proc.wait(timeout=10)
    assert processes_naming(str(run_dir)) == []
    return code


@pytest.mark.distributed
@pytest.mark.parametrize("phase", list(KILL_PHASES))
def test_sigkill_during_a_save_leaves_the_previous_checkpoint(
    tmp_path: Path, layout_run: Any, phase: str
) -> None:
    layout, extra, step, paused, killed = KILL_PHASES[phase]
    straight = layout_run(layout)
    run_dir, marker = tmp_path / "killed", tmp_path / "in_save"
    args, env = _phase_env([*LAYOUTS[layout], *PARITY, *extra], marker, step)
    proc = start_cli(args, run_dir, env=env)
    markers = [marker.with_name(f"{marker.name}.rank{r}") for r in range(paused)]
    pids = wait_for(lambda: all_or_none([read_pid(m) for m in markers]), proc)
    if phase.startswith("async"):
        # Training went on while the save was being written: rows past the save's step exist.
        wait_for(lambda: len(complete_lines(run_dir / "metrics.jsonl")) == 6, proc)
        assert not (run_dir / "checkpoints" / f"step_{step:08d}").exists()
    if isinstance(killed, int):
        assert _kill_and_wait(proc, pids[killed], run_dir) != 0
    else:
        assert _kill_launcher_and_wait(proc, killed, run_dir) != 0, "fsdp-train reports the failure"
    left = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    previous, _ = newest_verified(run_dir / "checkpoints")
    assert previous is not None, left
    if phase in ("before_rename", "async_while_shards_are_written"):
        assert left == ["step_00000002", f"step_{step:08d}.partial"], left
        _resume_and_compare(args, run_dir, straight)
    else:
        # The checkpoint resume=auto would take is the straight run's, bit for bit, and resuming
        # from that one is exact (test_resume_is_bitwise_exact).
        assert previous.name.startswith(STEP3 if step == 6 else f"step_{step:08d}"), left
        assert_same_state(previous, ckpt(straight, STEP3))


def _resume_and_compare(args: list[str], run_dir: Path, straight: Path) -> None:
    """``resume=auto`` after the kill trains steps 3-6 exactly as the straight run did. Also runs
    validation and the csv logger (whose held-out batches must not change training)."""
    result = run_cli([*args, "resume=auto", "trainer.val_check_interval=2", "logger=csv"], run_dir)
    assert_ok(result, run_dir)
    assert "resuming from" in result.stderr and "step_00000002 (step 2)" in result.stderr
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert any("val_loss" in r for r in rows), "validation ran (its rows do not change training)"
    assert [r["loss"] for r in rows if "loss" in r] == losses(straight), "the resumed run continues exactly"
    assert_same_state(ckpt(run_dir, STEP6), ckpt(straight, STEP6))
    # keep_last=2 after the resumed saves at 4 and 6; the stale partial save is gone.
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000004", "step_00000006"]
    csv = (run_dir / "csv" / "metrics.csv").read_text().splitlines()
    assert "val_loss" in csv[0].split(","), csv[0]


@pytest.mark.distributed
def test_sigkill_while_replacing_a_checkpoint_of_the_same_step(tmp_path: Path, layout_run: Any) -> None:
    """A run resumed at step 3 with max_steps=3 saves step 3 again; killed between swapping the
    new folder in and deleting the old one, step 3 is still complete (and the straight run's)."""
    straight = layout_run("single")
    run_dir, marker = tmp_path / "replacing", tmp_path / "in_replace"
    shutil.copytree(ckpt(straight, STEP3), run_dir / "checkpoints" / STEP3)
    args = [*LAYOUTS["single"], *PARITY, "trainer.max_steps=3", "resume=auto"]
    args, env = _phase_env([*args, "+FSDP_CLI_TEST_PAUSE_PHASE=replace"], marker, 3)
    proc = start_cli(args, run_dir, env=env)
    pid = wait_for(lambda: read_pid(marker.with_name(f"{marker.name}.rank0")), proc)
    assert _kill_and_wait(proc, pid, run_dir) != 0
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [STEP3, f"{STEP3}.partial"]
    previous, _ = newest_verified(run_dir / "checkpoints")
    assert previous == run_dir / "checkpoints" / STEP3
    assert_same_state(previous, ckpt(straight, STEP3))


@pytest.mark.distributed
def test_sigkill_during_convert_then_resume_from_the_converted_checkpoint(
    tmp_path: Path, layout_run: Any
) -> None:
    """fsdp-ckpt convert killed before its rename leaves only DST.partial, which the next convert
    refuses to remove unasked; removed and run again, its output resumes the straight run exactly:
    from a folder other than the checkout, with save_last=false."""
    straight = layout_run("fsdp2")
    source, dst, marker = ckpt(straight, STEP3), tmp_path / "step3.pt", tmp_path / "in_convert"
    env = {
        "FSDP_CLI_TEST_PAUSE_IN_SAVE": "120",
        "FSDP_CLI_TEST_PAUSE_IN_SAVE_MARKER": str(marker),
        "FSDP_CLI_TEST_PAUSE_PHASE": "convert",
    }
    proc = start_cli(["convert", str(source), str(dst), "--to", "full"], env=env, prog="fsdp-ckpt")
    pid = wait_for(lambda: read_pid(marker.with_name(f"{marker.name}.rank0")), proc)
    os.kill(pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    partial = dst.with_name(dst.name + ".partial")
    assert not dst.exists() and partial.exists()
    assert fsdp_ckpt("verify", "--deep", str(source)) == 0
    assert fsdp_ckpt("convert", str(source), str(dst), "--to", "full") == 2, (
        "its DST.partial is not removed unasked"
    )
    partial.unlink()  # (the user's answer to the refusal's hint)
    assert fsdp_ckpt("convert", str(source), str(dst), "--to", "full") == 0
    run_dir, elsewhere = tmp_path / "from_converted", tmp_path / "elsewhere"
    elsewhere.mkdir()
    args = [*LAYOUTS["fsdp2"], *PARITY, f"resume={dst}", "checkpoint.save_last=false"]
    summary = assert_ok(run_cli(args, run_dir, cwd=elsewhere), run_dir)
    assert losses(run_dir) == losses(straight)[3:], "bitwise, as from the sharded original"
    assert summary["checkpoint"] is None and not (run_dir / "checkpoints").exists(), "save_last=false"
    assert not list(elsewhere.iterdir()), "nothing written to the working directory"


@pytest.mark.distributed
def test_a_stop_signal_to_one_rank_saves_on_every_rank_then_resume_continues(tmp_path: Path) -> None:
    """SIGUSR1 straight to rank 1, as SLURM's ``--signal=SIGUSR1@90`` (what Lightning's docs ask
    for) delivers it: one signalled rank is enough for every rank to save after the same step
    and stop as preempted. (SIGTERM to fsdp-train, forwarded to the ranks: tests/test_sweeps.py.)"""
    from fsdp_cli.rundir.heartbeat import read_heartbeats

    run_dir = tmp_path / "preempted"
    args = ["strategy=fsdp2", "devices=2", "accelerator=cpu", "data.seq_len=32", "trainer.max_steps=100000"]
    proc = start_cli(args, run_dir)
    wait_for(lambda: len(complete_lines(run_dir / "metrics.jsonl")) >= 2, proc)
    os.kill(read_heartbeats(run_dir)[1].pid, signal.SIGUSR1)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-2000:]
    summary = read_summary(run_dir)
    assert summary["status"] == "preempted", summary
    assert summary["error"] == "stopped by a stop signal to another rank after saving a checkpoint"
    assert "Thread 0x" not in (run_dir / "logs" / "rank1.log").read_text()  # not a stack dump
    saved = Path(summary["checkpoint"])
    step = int(saved.name.split("_")[1])
    assert saved.exists() and step == summary["steps"] >= 2

    result = run_cli([*args[:-1], f"trainer.max_steps={step + 2}", "resume=auto"], run_dir)
    assert_ok(result, run_dir)
    assert f"step {step}" in result.stderr
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, step + 3))
