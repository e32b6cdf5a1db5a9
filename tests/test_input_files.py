"""The files a run reads, checked before any rank starts (headers only), and what it writes, never
half-written nor another run's: model folders, tokenizer and data files, checkpoint manifests,
where output goes; the token cache, metrics.jsonl and the pruner after a crash or beside another
run. Each refusal is one line and exit status 2, in this process (the fast tier)."""

from __future__ import annotations

import json
import os
import shutil
import struct
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import cli_in_process, composed
from test_hf import save_gpt2, save_word_tokenizer, write_documents

from fsdp_cli.checkpoint.atomic import file_records
from fsdp_cli.checkpoint.callback import CheckpointCallback
from fsdp_cli.config.schema import CheckpointConfig
from fsdp_cli.errors import RunFailure

CPU = {"CUDA_VISIBLE_DEVICES": ""}
SMALL = ["trainer.max_steps=1", "data.global_batch_size=2", "data.seq_len=16"]


def refusal(args: list[str], run_dir: Path) -> str:
    """The one line ``fsdp-train ARGS`` stops with (exit 2, no traceback, no rank started)."""
    result = cli_in_process([*SMALL, *args], run_dir, env=CPU)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and "Traceback" not in result.stdout + result.stderr, result.stderr
    assert not (run_dir / "config.yaml").exists(), "no rank started"
    return lines[0].removeprefix("fsdp-train: error: ")


# --------------------------------------------------------------------------- model folders


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_gpt2(tmp_path_factory.mktemp("hf") / "gpt2")


def _copy(gpt2: Path, tmp_path: Path, name: str) -> Path:
    return Path(shutil.copytree(gpt2, tmp_path / name))


def _truncated(folder: Path) -> str:
    file = folder / "model.safetensors"
    os.truncate(file, file.stat().st_size - 100)
    return "model.safetensors holds {size} bytes, its safetensors header describes {whole} (truncated or damaged)"


def _garbage(folder: Path) -> str:
    (folder / "model.safetensors").write_bytes(b"PK\x03\x04" + bytes(range(256)) * 20)
    return "model.safetensors is not a safetensors file, or a truncated one"


def _index_not_json(folder: Path) -> str:
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors.index.json").write_text("{'weight_map': }")
    return "model.safetensors.index.json is not JSON (Expecting property name enclosed in double quotes"


def _index_without_map(folder: Path) -> str:
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors.index.json").write_text('{"metadata": {"total_size": 1}}')
    return "model.safetensors.index.json has no weight_map (tensor name -> file name)"


def _index_outside(folder: Path) -> str:
    (folder / "model.safetensors").rename(folder.parent / "elsewhere.safetensors")
    (folder / "model.safetensors.index.json").write_text('{"weight_map": {"w": "../elsewhere.safetensors"}}')
    return "model.safetensors.index.json names '../elsewhere.safetensors', outside the model folder"


def _model_type(kind: str, **extra: Any) -> Any:
    def edit(folder: Path) -> str:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "model_type": kind, **extra}))
        return f"config.json's model_type '{kind}'"

    return edit


FOLDERS = {
    "truncated safetensors": (_truncated, ""),
    "garbage safetensors": (_garbage, "hint: write the folder again with save_pretrained"),
    "index not JSON": (_index_not_json, ""),
    "index without weight_map": (_index_without_map, ""),
    "index naming a file outside": (_index_outside, "hint: an index names its files by plain names"),
    "unknown model_type": (_model_type("gpt9"), "is not a model type transformers 5."),
    "vision model": (
        _model_type("vit"),
        "is not a causal language model (transformers has no AutoModelForCausalLM for it); model=hf trains "
        "causal LMs only; hint: train it as model=custom model._target_=YOUR_MODULE",
    ),
    "vision-language model": (
        _model_type("llava", text_config={"model_type": "llama"}),
        "hint: its text_config is a 'llama' causal LM: save that part alone",
    ),
}


@pytest.mark.parametrize("case", list(FOLDERS))
def test_a_damaged_or_foreign_model_folder_is_one_line_before_launch(
    gpt2: Path, tmp_path: Path, case: str
) -> None:
    folder = _copy(gpt2, tmp_path, "model")
    whole = (folder / "model.safetensors").stat().st_size
    damage, also = FOLDERS[case]
    words = damage(folder).format(size=whole - 100, whole=whole)
    line = refusal(["model=hf", f"model.path={folder}"], tmp_path / "run")
    assert line.startswith(f"model.path={folder}: {words}"), line
    assert also in line, line


def test_model_folder_checks_read_headers_only(gpt2: Path, tmp_path: Path) -> None:
    """A 48 GB folder of sparse shards (valid headers, no data written) checks in well under a
    second: only the few kB of each header are read, never the weights."""
    from fsdp_cli.models.folder import check_model_type, check_weight_headers, read_model_folder, weight_files

    folder = tmp_path / "big"
    folder.mkdir()
    shutil.copy(gpt2 / "config.json", folder)
    weight_map = {}
    for shard in range(3):
        name = f"model-{shard + 1:05d}-of-00003.safetensors"
        sizes = [4 << 30] * 4  # 4 tensors of 4 GiB each: 16 GiB per shard
        header, offset = {}, 0
        for t, size in enumerate(sizes):
            header[f"layer{shard}.w{t}"] = {
                "dtype": "F32",
                "shape": [size // 4],
                "data_offsets": [offset, offset + size],
            }
            weight_map[f"layer{shard}.w{t}"] = name
            offset += size
        text = json.dumps(header).encode()
        with open(folder / name, "wb") as fh:
            fh.write(struct.pack("<Q", len(text)) + text)
            fh.truncate(8 + len(text) + offset)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    start = time.perf_counter()
    model = read_model_folder(str(folder))
    check_model_type(model)
    check_weight_headers(weight_files(folder))
    seconds = time.perf_counter() - start
    assert sum(f.stat().st_size for f in folder.iterdir()) > 48 << 30
    assert seconds < 1.0, seconds


def test_transformers_tables_read_without_importing_it_match_its_own() -> None:
    """The model types read from transformers' sources are the ones it maps (a new transformers
    that moves them fails here, not silently in users' runs)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from fsdp_cli.compat.transformers_names import model_type_tables

    tables = model_type_tables()
    assert tables is not None
    assert tables.known == set(CONFIG_MAPPING_NAMES)
    assert tables.causal_lm == set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


# --------------------------------------------------------------------------- tokenizer and data files


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("corpus")
    tokenizer = root / "tokenizer"
    tokenizer.mkdir()
    save_word_tokenizer(tokenizer / "tokenizer.json")
    return SimpleNamespace(
        root=root, tokenizer=tokenizer, docs=write_documents(root / "docs.jsonl", 400, seed=1)
    )


def test_a_tokenizer_config_that_is_not_json_is_one_line(corpus: SimpleNamespace, tmp_path: Path) -> None:
    folder = Path(shutil.copytree(corpus.tokenizer, tmp_path / "tok"))
    (folder / "tokenizer_config.json").write_text('{"eos_token": "<|endoftext|>",')
    line = refusal(["data=jsonl", f"data.path={corpus.docs}", f"data.tokenizer={folder}"], tmp_path / "run")
    assert line.startswith(
        f"data.tokenizer={folder}/tokenizer_config.json: tokenizer_config.json is not JSON (Expecting"
    ), line
    assert line.endswith(
        "hint: fix or remove the file, or name the end-of-text token: data.eot_token='<|endoftext|>'"
    )


def test_a_line_that_is_not_utf8_is_one_line_and_leaves_no_partial_cache(tmp_path: Path) -> None:
    data = tmp_path / "latin1.jsonl"
    data.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    line = refusal(["data=jsonl", f"data.path={data}"], tmp_path / "run")
    assert line == (
        f"data.path={data}:2: not UTF-8 text (byte 0xe9 at byte 14 of the line); "
        "hint: convert the file to UTF-8 (e.g. iconv -f latin1 -t utf-8 FILE)"
    )
    assert list((tmp_path / ".fsdp_cli_tokens").iterdir()) == [], "no .partial token cache left behind"


def test_a_missing_field_on_line_301_leaves_no_partial_cache(tmp_path: Path) -> None:
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(300)) + '{"body": "x"}\n')
    line = refusal(["data=jsonl", f"data.path={data}"], tmp_path / "run")
    assert line.startswith(f"data.field=text: {data}:301 has no text under that key"), line
    assert list((tmp_path / ".fsdp_cli_tokens").iterdir()) == []


def test_a_cache_dir_that_is_a_file_is_one_line(corpus: SimpleNamespace, tmp_path: Path) -> None:
    (tmp_path / "cache").write_text("not a folder")
    line = refusal(
        ["data=jsonl", f"data.path={corpus.docs}", f"data.cache_dir={tmp_path / 'cache'}"], tmp_path / "run"
    )
    assert line.startswith(
        f"data.cache_dir={tmp_path / 'cache'}: nothing can be written there: is a file, not a folder; hint: "
    )


def test_tokenization_interrupted_midway_leaves_nothing_half_written(
    corpus: SimpleNamespace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C while the tokenizer runs (a KeyboardInterrupt from inside it, after some batches
    were written): no pid-named .partial, no token file, no description."""
    from fsdp_cli.data import jsonl

    real = jsonl._encoder
    calls = []

    def interrupted(spec: Any) -> Any:
        encode = real(spec)

        def encode_then_stop(texts: list[str]) -> Any:
            calls.append(len(texts))
            if len(calls) == 3:
                raise KeyboardInterrupt
            return encode(texts)

        return encode_then_stop

    monkeypatch.setattr(jsonl, "BATCH_BYTES", 2000)
    monkeypatch.setattr(jsonl, "_encoder", interrupted)
    cfg = composed(
        "data=jsonl",
        f"data.path={corpus.docs}",
        f"data.tokenizer={corpus.tokenizer}",
        f"data.cache_dir={tmp_path}",
    )
    with pytest.raises(KeyboardInterrupt):
        jsonl.prepare(cfg.data)
    assert len(calls) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "nothing half-written stays"
    monkeypatch.setattr(jsonl, "_encoder", real)
    jsonl.prepare(cfg.data)  # and the next try writes the cache whole, with its description
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".bin", ".json"]


# --------------------------------------------------------------------------- checkpoints and run files


def fake_sharded(directory: Path, step: int, run_id: str | None, **manifest: Any) -> Path:
    """A sharded checkpoint (one small tensor, written by DCP without a process group) with a
    manifest that verifies."""
    import torch
    import torch.distributed.checkpoint as dcp

    path = directory / f"step_{step:08d}"
    path.mkdir(parents=True)
    dcp.save({"w": torch.zeros(step + 1)}, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)
    records = file_records(path, [".metadata", "__0_0.distcp"])
    body = {"step": step, "format": "sharded", "files": records, "run_id": run_id, **manifest}
    (path / "manifest.json").write_text(json.dumps({k: v for k, v in body.items() if v is not None}))
    return path


def _age(path: Path, seconds: float) -> None:
    os.utime(path, (time.time() - seconds, time.time() - seconds))


def test_two_runs_sharing_a_checkpoint_folder_prune_only_their_own(tmp_path: Path) -> None:
    """Run A and run B save into one folder; B's retention removes B's old saves and B's own
    leftover, and leaves every save of A's, the one A is still writing included."""
    folder = tmp_path / "checkpoints"
    a = [fake_sharded(folder, step, "run-a") for step in (2, 4)]
    b = [fake_sharded(folder, step, "run-b") for step in (1, 3, 5)]
    legacy = fake_sharded(folder, 0, None)  # a save from before run ids: nobody's to remove
    a_writing = folder / "step_00000006.partial"  # A's save in progress: no manifest yet
    a_writing.mkdir()
    (a_writing / "__0_0.distcp").write_bytes(b"half")
    b_leftover = folder / "step_00000007.partial"  # B's save interrupted after its manifest
    shutil.copytree(b[0], b_leftover)
    (b_leftover / "manifest.json").write_text(json.dumps({"step": 7, "run_id": "run-b"}))
    for path in (*a, *b, legacy, a_writing, b_leftover):
        _age(path, 100)
    _age(b[-1], 10)
    pruner = CheckpointCallback(CheckpointConfig(keep_last=2), folder, max_steps=10, run_id="run-b")
    assert [p.name for p in pruner.prune()] == [b[0].name]
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [legacy.name, *(p.name for p in a), a_writing.name, b[1].name, b[2].name]
    )
    # A prunes too, later: B's saves stay; A's own beyond keep_last=1 go.
    assert [
        p.name for p in CheckpointCallback(CheckpointConfig(keep_last=1), folder, 10, run_id="run-a").prune()
    ] == [a[0].name]
    assert (folder / b[1].name).is_dir() and (folder / b[2].name).is_dir() and a_writing.is_dir()


def test_a_resumed_run_keeps_the_run_id_of_its_checkpoint(tmp_path: Path) -> None:
    """Resuming continues a run (its saves are this run's to prune); a fresh run gets an id of its own."""
    from conftest import run_of

    from fsdp_cli.builders.strategy import checkpointing
    from fsdp_cli.checkpoint.resume import resolve_resume

    fake_sharded(tmp_path / "ckpt", 4, "the-first-run")
    base = composed(f"checkpoint.dir={tmp_path / 'ckpt'}", f"run_dir={tmp_path}")
    resumed, _ = resolve_resume(composed(f"checkpoint.dir={tmp_path / 'ckpt'}", "resume=auto"))
    fresh, _ = resolve_resume(base)
    again, _ = resolve_resume(base)
    assert resumed.run_id == "the-first-run"
    assert fresh.run_id and again.run_id and fresh.run_id != again.run_id != "the-first-run"
    assert checkpointing(run_of(fresh))["checkpoint_manifest"]["run_id"] == fresh.run_id
    legacy = fake_sharded(tmp_path / "old", 2, None)  # saved before run ids
    continued, notices = resolve_resume(composed(f"resume={legacy}"))
    assert continued.run_id and continued.run_id != "the-first-run"
    assert notices[-1] == (
        f"note: {legacy} records no run id (saved before run ids): this run's saves get their own, "
        "and retention leaves the older saves in checkpoint.dir for you to remove"
    )


MANIFESTS = {
    "a record without its size": (
        {"files": {"__0_0.distcp": {"crc32": "0"}}},
        '{path}/manifest.json: the record of \'__0_0.distcp\' is {{"crc32": "0"}}, '
        'not {{"size": <bytes>, "crc32": "<8 hex digits>"}}',
    ),
    "a record outside the checkpoint": (
        {"files": {"../../secret": {"size": 1, "crc32": "0"}}},
        "{path}/manifest.json: names a file outside the checkpoint folder ('../../secret'); refused",
    ),
    "no step": (
        {"step": None},
        "manifest.json records no step (missing); not written by fsdp-train, or edited",
    ),
}


@pytest.mark.parametrize("case", list(MANIFESTS))
def test_a_malformed_manifest_is_one_line_on_resume(tmp_path: Path, case: str) -> None:
    fields, words = MANIFESTS[case]
    path = fake_sharded(tmp_path / "ckpt", 4, "r")
    manifest = {**json.loads((path / "manifest.json").read_text()), **fields}
    (path / "manifest.json").write_text(json.dumps({k: v for k, v in manifest.items() if v is not None}))
    line = refusal([f"resume={path}"], tmp_path / "run")
    assert line.startswith(f"resume={path}: {words.format(path=path)}; hint: fsdp-ckpt verify PATH"), line


def test_resume_auto_skips_a_malformed_newest_manifest(tmp_path: Path) -> None:
    from fsdp_cli.checkpoint.run import newest_verified

    older = fake_sharded(tmp_path, 2, "r")
    newest = fake_sharded(tmp_path, 4, "r")
    (newest / "manifest.json").write_text(json.dumps({"files": {"x": 5}, "step": 4}))
    found, notices = newest_verified(tmp_path)
    assert found == older
    assert notices == [
        f"note: resume=auto: skipping step_00000004: {newest}/manifest.json: the record of 'x' is 5, "
        'not {"size": <bytes>, "crc32": "<8 hex digits>"}; trying the next newest (step_00000002)'
    ]


def test_metrics_with_a_torn_last_row_resume_with_a_note(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A crash mid-write leaves half a row: resume drops it (and the rows it will train again),
    says so, and writes the file whole."""
    from fsdp_cli.callbacks.metrics import MetricsCallback

    rows = [json.dumps({"step": s, "loss": 1.0 / s}) for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(rows) + '\n{"step": 4, "lo')
    metrics = MetricsCallback(tmp_path, log_every_n_steps=1, tokens_per_step=None, max_steps=9)
    metrics._keep_rows_up_to(2)
    assert (tmp_path / "metrics.jsonl").read_text() == rows[0] + "\n" + rows[1] + "\n"
    assert capsys.readouterr().err == (
        f"note: {tmp_path / 'metrics.jsonl'}: line 4 is a torn last row (the run stopped while writing it); "
        'dropped: \'{"step": 4, "lo\'\n'
    )


def test_metrics_rewrite_is_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A crash while resume rewrites metrics.jsonl (here: the rename fails) leaves the whole old
    file and no temporary one: the run's history is never lost."""
    from fsdp_cli.callbacks.metrics import MetricsCallback
    from fsdp_cli.rundir import files

    text = "".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3))
    (tmp_path / "metrics.jsonl").write_text(text)

    def crash(*args: Any) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(files.os, "replace", crash)
    metrics = MetricsCallback(tmp_path, log_every_n_steps=1, tokens_per_step=None, max_steps=9)
    with pytest.raises(OSError):
        metrics._keep_rows_up_to(1)
    assert (tmp_path / "metrics.jsonl").read_text() == text
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]


# --------------------------------------------------------------------------- where output goes


def test_a_run_dir_that_cannot_be_created_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    line = refusal([], tmp_path / "file" / "run")
    assert line == (
        f"hydra.run.dir={tmp_path / 'file' / 'run'}: nothing can be written there: Not a directory; "
        "hint: hydra.run.dir=DIR (a folder this user can create and write)"
    )


@pytest.mark.parametrize("resume", ["null", "auto"])
def test_a_checkpoint_dir_that_is_a_file_is_one_line_before_launch(tmp_path: Path, resume: str) -> None:
    (tmp_path / "ckpt").write_text("x")
    line = refusal([f"checkpoint.dir={tmp_path / 'ckpt'}", f"resume={resume}"], tmp_path / "run")
    assert line == (
        f"checkpoint.dir={tmp_path / 'ckpt'}: nothing can be written there: is a file, not a folder; "
        "hint: checkpoint.dir=DIR (a folder this user can create and write)"
    )


def test_a_save_whose_folder_cannot_be_made_fails_with_the_saves_one_line(tmp_path: Path) -> None:
    """At run time (the folder became a file after launch): the save's step, path and cause in one
    line, as every save failure is, not a raw OSError."""
    from fsdp_cli.checkpoint.sharded_save import SaveTarget, save_sharded

    (tmp_path / "gone").write_text("x")
    final = tmp_path / "gone" / "step_00000003"
    target = SaveTarget(final.with_name(final.name + ".partial"), final, 3, {}, {})
    with pytest.raises(RunFailure) as err:
        save_sharded({}, target)
    assert str(err.value) == (
        f"checkpoint save of step 3 to {final} failed: rank 0: Not a directory [errno 20] "
        f"({target.partial}); the previous checkpoint is intact; free space or set checkpoint.dir elsewhere"
    )


def test_a_save_whose_files_vanished_fails_with_the_saves_one_line(tmp_path: Path) -> None:
    """The shards written, then the ``.partial`` folder removed under the save (what another run's
    pruner used to do): one line naming the save, not a raw FileNotFoundError after training."""
    from fsdp_cli.checkpoint.sharded_save import SaveTarget, finish

    final = tmp_path / "step_00000005"
    target = SaveTarget(final.with_name(final.name + ".partial"), final, 5, {}, {})
    with pytest.raises(RunFailure) as err:
        finish(["__0_0.distcp"], target)
    assert str(err.value) == (
        f"checkpoint save of step 5 to {final} failed: rank 0: No such file or directory [errno 2] "
        f"({target.partial / '__0_0.distcp'}); the previous checkpoint is intact; free space or set "
        "checkpoint.dir elsewhere"
    )
