"""A checkpoint from elsewhere never runs code: every entry point that reads one, fed a crafted one.

Each payload is a pickled object whose ``__reduce__`` makes a directory (the marker): loaded by
plain ``pickle`` or ``torch.load(weights_only=False)`` the marker appears. Each test asserts the
marker does not, and that the refusal is the one line naming the file and the class. In-process:
the rank's load runs in a strategy without a process group (DCP reads without one); the parent's
``resume`` check and ``fsdp-ckpt`` through their entry functions.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import cli_in_process
from torch import nn

from fsdp_cli.checkpoint.atomic import file_records
from fsdp_cli.checkpoint.format import MANIFEST_FILE, MANIFEST_KEY, META_FILE, UnsafeCheckpointError

STEP = "step_00000003"
REFUSED = "refused to load posix.mkdir"


class Payload:
    """Makes ``marker`` (a directory) when unpickled: the code a crafted checkpoint would run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.mkdir, (str(self.marker),))


def model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def save_sharded(folder: Path, *, value: Any = 1e-3, meta: Any = None, files: bool = True) -> Path:
    """A sharded checkpoint as fsdp-train writes one (DCP shards, meta.pt, manifest); ``value``
    is saved as the optimizer's learning rate (a byte entry), ``meta`` as meta.pt's extra entry."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model, optimizer = model_and_optimizer()
    optim = get_optimizer_state_dict(model, optimizer)
    optim["param_groups"][0]["lr"] = value
    state = {"state_dict": get_model_state_dict(model), "optimizer_states": {"0": optim}}
    dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    torch.save({"global_step": 3, "extra": meta}, folder / META_FILE)
    write_manifest(folder, files=files)
    return folder


def write_manifest(folder: Path, *, files: bool = True) -> None:
    """What whoever crafts a folder writes too: sizes and checksums of what is there."""
    manifest: dict[str, Any] = {"manifest_version": 2, "format": "sharded", "step": 3}
    if files:
        names = sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != MANIFEST_FILE)
        manifest["files"] = file_records(folder, names)
    (folder / MANIFEST_FILE).write_text(json.dumps(manifest))


def craft_metadata(folder: Path, marker: Path) -> None:
    """``.metadata`` rewritten to carry the payload (the manifest rewritten to match)."""
    with open(folder / ".metadata", "rb") as fh:
        metadata = pickle.load(fh)  # our own, just saved
    metadata.planner_data = {**metadata.planner_data, "x": Payload(marker)}
    with open(folder / ".metadata", "wb") as fh:
        pickle.dump(metadata, fh)
    write_manifest(folder)


def crafted(kind: str, root: Path, marker: Path, *, files: bool = True) -> Path:
    """A checkpoint under ``root/checkpoints`` carrying the payload in one of its pickles."""
    path = root / "checkpoints" / STEP
    if kind == "full":
        path = path.with_name(f"{STEP}.pt")
        path.parent.mkdir(parents=True)
        torch.save(
            {"state_dict": {}, "global_step": 3, MANIFEST_KEY: {"step": 3}, "x": Payload(marker)}, path
        )
        return path
    path.mkdir(parents=True)
    if kind == "metadata":
        craft_metadata(save_sharded(path, files=files), marker)
    elif kind == "byte_entry":
        save_sharded(path, value=Payload(marker), files=files)
    else:  # meta.pt
        save_sharded(path, meta=Payload(marker), files=files)
    return path


KINDS = {
    "metadata": ".metadata",
    "byte_entry": "__0_0.distcp",
    "meta_pt": META_FILE,
    "full": f"{STEP}.pt",
}
"""Where each payload lives: the file the one line must name."""


def assert_refused(line: str, path: Path, kind: str, marker: Path) -> None:
    file = path if kind == "full" else path / KINDS[kind]
    assert not marker.exists(), "the checkpoint's code ran"
    assert len(line.strip().splitlines()) == 1, line
    assert f"{file}: {REFUSED}" in line, (line, file)


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    return tmp_path / "marker"


def test_payloads_run_code_when_unpickled_plainly(tmp_path: Path, marker: Path) -> None:
    """The payloads are real: what torch itself does with them (its DCP reader's pickle.load,
    torch.load(weights_only=False)) runs them."""
    from torch.distributed.checkpoint import FileSystemReader

    FileSystemReader(str(crafted("metadata", tmp_path / "a", marker))).read_metadata()
    assert marker.exists()
    os.rmdir(marker)
    torch.load(crafted("full", tmp_path / "b", marker), weights_only=False)
    assert marker.exists()


# --------------------------------------------------------------------------- in the ranks


@pytest.mark.parametrize("kind", list(KINDS))
def test_resume_in_the_ranks_refuses_a_crafted_checkpoint(tmp_path: Path, marker: Path, kind: str) -> None:
    """What each rank runs for ``trainer.fit(ckpt_path=...)`` (and a Lightning user's own
    ``ckpt_path`` through our strategies): the run fails with the one line as summary.json's error."""
    from fsdp_cli.strategies.ddp import DDPStrategy
    from fsdp_cli.worker.summary import outcome_of

    path = crafted(kind, tmp_path, marker)
    with pytest.raises(UnsafeCheckpointError) as refused:
        DDPStrategy().load_checkpoint(path)
    outcome = outcome_of(refused.value)
    assert outcome.status == "failed" and outcome.error == str(refused.value)
    assert_refused(outcome.error, path, kind, marker)


def test_a_folder_in_lightnings_own_layout_is_checked_before_lightning_reads_it(
    tmp_path: Path, marker: Path
) -> None:
    """Lightning's FSDP / ModelParallel loaders read their own sharded layout (``model``,
    ``optimizer_N``) with torch's plain reader: the folder is checked first, whatever the strategy."""
    from fsdp_cli.strategies.ddp import DDPStrategy

    path = tmp_path / "lightning.ckpt"
    state = {"model": {"weight": torch.ones(2)}, "optimizer_0": {"param_groups": [{"lr": Payload(marker)}]}}
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    torch.save({"global_step": 3}, path / META_FILE)
    with pytest.raises(UnsafeCheckpointError) as refused:
        DDPStrategy().load_checkpoint(path)
    assert_refused(str(refused.value), path, "byte_entry", marker)


def test_a_sharded_checkpoint_of_ours_still_loads_in_place(tmp_path: Path) -> None:
    """The restricted reader loads what fsdp-train writes: weights, optimizer moments and
    param_groups (byte entries), meta.pt."""
    from fsdp_cli.strategies.ddp import DDPStrategy

    path = save_sharded(tmp_path / STEP, value=0.25)
    model, optimizer = model_and_optimizer()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    optimizer.param_groups[0]["lr"] = 1.0
    strategy = DDPStrategy()
    strategy.model, strategy.optimizers = model, [optimizer]
    meta = strategy.load_checkpoint(path)
    assert meta["global_step"] == 3 and meta["optimizer_states"] == []
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    assert optimizer.param_groups[0]["lr"] == 0.25 and optimizer.state


# --------------------------------------------------------------------------- in the parent


@pytest.mark.parametrize("files", [True, False], ids=["manifest_lists_files", "manifest_without_files"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_resume_auto_refuses_a_crafted_checkpoint_before_launch(
    tmp_path: Path, marker: Path, kind: str, files: bool
) -> None:
    """``fsdp-train resume=auto``: the scan of checkpoint.dir (which reads DCP metadata where a
    manifest does not list its files) and the check of the one it picks; exit 2, no rank started."""
    if kind == "full" and not files:
        pytest.skip("a full file has no manifest of its own")
    path = crafted(kind, tmp_path, marker, files=files)
    result = cli_in_process(["resume=auto", f"checkpoint.dir={path.parent}"], tmp_path / "run")
    assert result.returncode == 2, result
    assert_refused(result.stderr, path, kind, marker)
    assert "resume=" in result.stderr


def test_resume_path_refuses_a_crafted_checkpoint_before_launch(tmp_path: Path, marker: Path) -> None:
    path = crafted("metadata", tmp_path, marker)
    result = cli_in_process([f"resume={path}"], tmp_path / "run")
    assert result.returncode == 2, result
    assert_refused(result.stderr, path, "metadata", marker)


# --------------------------------------------------------------------------- fsdp-ckpt


@pytest.mark.parametrize(
    "command", ["inspect", "verify", "verify --deep", "convert full", "convert safetensors"]
)
@pytest.mark.parametrize("kind", list(KINDS))
def test_fsdp_ckpt_refuses_a_crafted_checkpoint(
    tmp_path: Path, marker: Path, kind: str, command: str
) -> None:
    path = crafted(kind, tmp_path, marker)
    verb, *rest = command.split()
    out = tmp_path / "out"
    args = [verb, str(path), *([str(out), "--to", rest[0]] if verb == "convert" else rest)]
    result = cli_in_process(args, prog="fsdp-ckpt")
    assert result.returncode == 2, result
    assert_refused(result.stderr.removeprefix("fsdp-ckpt: error: "), path, kind, marker)
    assert not out.exists() and not out.with_name("out.partial").exists()


def test_shard_files_named_outside_the_folder_are_refused(tmp_path: Path) -> None:
    """A ``.metadata`` whose shard paths leave the folder (``../x``) is refused before any is read."""
    path = save_sharded(tmp_path / "ckpt" / STEP)
    (tmp_path / "secret.distcp").write_bytes((path / "__0_0.distcp").read_bytes())  # would be read
    with open(path / ".metadata", "rb") as fh:
        metadata = pickle.load(fh)
    for info in metadata.storage_data.values():
        info.relative_path = "../../secret.distcp"
    with open(path / ".metadata", "wb") as fh:
        pickle.dump(metadata, fh)
    result = cli_in_process(["inspect", str(path)], prog="fsdp-ckpt")
    assert result.returncode == 2, result
    assert result.stderr.strip() == (
        f"fsdp-ckpt: error: {path}/.metadata: names a shard file outside the checkpoint folder "
        "('../../secret.distcp'); refused"
    )


# --------------------------------------------------------------------------- fsdp-ckpt's arguments and outputs


def one_line_error(result: Any) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("fsdp-ckpt: error: "), result
    assert "Traceback" not in result.stderr and "usage:" not in result.stderr
    return lines[0]


@pytest.mark.parametrize(
    ("files", "words"),
    [
        ({"__0_0.distcp": "big"}, 'the record of \'__0_0.distcp\' is "big", not {"size"'),
        ({"__0_0.distcp": {"size": 10}}, "the record of '__0_0.distcp' is {\"size\": 10}, not"),
        ({"__0_0.distcp": {"size": -1, "crc32": "00000000"}}, "the record of '__0_0.distcp'"),
        (["__0_0.distcp"], "'files' is a list, not a mapping"),
        (
            {"../outside.bin": {"size": 5, "crc32": "00000000"}},
            "outside the checkpoint folder ('../outside.bin')",
        ),
        (
            {"/etc/hostname": {"size": 5, "crc32": "00000000"}},
            "outside the checkpoint folder ('/etc/hostname')",
        ),
    ],
    ids=["record_not_a_mapping", "no_crc32", "negative_size", "files_a_list", "dotdot", "absolute"],
)
def test_verify_a_malformed_manifest_is_one_line_exit_2(tmp_path: Path, files: Any, words: str) -> None:
    path = save_sharded(tmp_path / "ckpt" / STEP)
    (tmp_path / "ckpt" / "outside.bin").write_text("12345")  # what ../outside.bin would stat and read
    (path / MANIFEST_FILE).write_text(json.dumps({"manifest_version": 2, "step": 3, "files": files}))
    line = one_line_error(cli_in_process(["verify", "--deep", str(path)], prog="fsdp-ckpt"))
    assert line.startswith(f"fsdp-ckpt: error: {path}/{MANIFEST_FILE}: ") and words in line, line


def test_verify_says_a_safetensors_export_is_fine(tmp_path: Path) -> None:
    source, out = save_sharded(tmp_path / STEP), tmp_path / "model.safetensors"
    assert (
        cli_in_process(["convert", str(source), str(out), "--to", "safetensors"], prog="fsdp-ckpt").returncode
        == 0
    )
    for deep in ([], ["--deep"]):
        result = cli_in_process(["verify", *deep, str(out)], prog="fsdp-ckpt")
        assert result.returncode == 0 and f"{out}: ok (safetensors, step 3, 1 file(s)" in result.stdout, (
            result
        )
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(out.read_bytes()[:-4])
    result = cli_in_process(["verify", str(truncated)], prog="fsdp-ckpt")
    assert (
        result.returncode == 1
        and "damaged: " in result.stderr
        and "not a complete safetensors" in result.stderr
    )


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["convert", "a", "b", "--to", "onnx"], "argument --to: invalid choice: 'onnx'"),
        ([], "the following arguments are required: command; see fsdp-ckpt --help"),
        (["inspect"], "the following arguments are required: path; see fsdp-ckpt inspect --help"),
        (["verify", "x", "--deeep"], "unrecognized arguments: --deeep"),
    ],
)
def test_argument_mistakes_are_one_line(args: list[str], words: str) -> None:
    assert words in one_line_error(cli_in_process(args, prog="fsdp-ckpt"))


def test_convert_refuses_a_partial_destination_it_did_not_make(tmp_path: Path) -> None:
    source, dst = save_sharded(tmp_path / STEP), tmp_path / "out.pt"
    partial = tmp_path / "out.pt.partial"
    partial.write_text("another conversion's")
    line = one_line_error(
        cli_in_process(["convert", str(source), str(dst), "--to", "full"], prog="fsdp-ckpt")
    )
    assert f"{partial}: exists (left by an interrupted conversion, or one still running)" in line
    assert "remove it and run again" in line
    assert partial.read_text() == "another conversion's" and not dst.exists()


def test_a_failed_conversion_leaves_nothing(tmp_path: Path) -> None:
    """(--to hf from a folder without config.json fails after DST.partial was made.)"""
    source, dst = save_sharded(tmp_path / STEP), tmp_path / "exported"
    args = ["convert", str(source), str(dst), "--to", "hf", "--hf-config", str(tmp_path)]
    assert "no config.json" in one_line_error(cli_in_process(args, prog="fsdp-ckpt"))
    assert not dst.exists() and not (tmp_path / "exported.partial").exists()


@pytest.mark.parametrize("to", ["full", "sharded"])
def test_convert_never_replaces_a_destination_that_appeared_meanwhile(tmp_path: Path, to: str) -> None:
    from fsdp_cli.checkpoint import phases

    source, dst = save_sharded(tmp_path / STEP), tmp_path / "out"

    def someone_else(phase: str, step: Any) -> None:
        if phase == "convert":  # written and flushed, not yet renamed: what a rename would replace
            dst.write_text("theirs") if to == "full" else dst.mkdir()

    stop = phases.observe(someone_else)
    try:
        line = one_line_error(
            cli_in_process(["convert", str(source), str(dst), "--to", to], prog="fsdp-ckpt")
        )
    finally:
        stop()
    assert f"{dst}: created by something else while converting; left as it is, nothing written" in line
    assert (dst.read_text() == "theirs") if to == "full" else not any(dst.iterdir())
    assert not (tmp_path / "out.partial").exists()
