"""The composition table (fsdp_cli/config/composition.py): every pair of features has a cell, each
cell's test or check exists, each refused pair is one line before launch, docs/compatibility.md is
the table's; and (distributed) the composed runs the table names, each equal to one process."""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Any

import pytest
from conftest import assert_ok, cli_in_process, grad_norms, losses, relative_gap, run_cli
from harness import REPO
from test_chat_data import hf_chat_files

from fsdp_cli.config import composition
from fsdp_cli.config.composition import BY_ID, CELLS, Moot, Refused, Trained, Untested

CPU = {"CUDA_VISIBLE_DEVICES": ""}
UNTESTED_AT_MOST = 0
"""Pairs neither refused nor compared with one process yet: this number may only fall."""
BF16_TOLERANCE = 0.02
"""Relative, per step, between a bf16-mixed layout and one bf16-mixed process (as test_pipeline's)."""


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A tiny Hugging Face model folder with a chat tokenizer, and conversations."""
    return hf_chat_files(tmp_path_factory.mktemp("composition"))


# --------------------------------------------------------------------------- the table


def test_every_pair_of_features_has_one_cell() -> None:
    asked = {composition.pair(a.id, b.id) for a, b in composition.pairs()}
    assert composition.counts()["missing"] == 0, [sorted(p) for p in asked if p not in CELLS]
    assert set(CELLS) == asked, [sorted(p) for p in set(CELLS) - asked]


def test_every_named_test_exists() -> None:
    for key, found in CELLS.items():
        if isinstance(found, Trained):
            file, _, name = found.test.partition("::")
            source = (REPO / file).read_text()
            assert re.search(rf"^def {re.escape(name)}\(", source, re.M), (sorted(key), found.test)


def test_every_named_check_exists() -> None:
    for key, found in CELLS.items():
        if isinstance(found, Refused):
            module, _, name = found.check.rpartition(".")
            found_module = importlib.import_module(f"fsdp_cli.{module}")
            assert callable(getattr(found_module, name)), (sorted(key), found.check)


def test_the_untested_pairs_only_fall() -> None:
    untested = [sorted(k) for k, c in CELLS.items() if isinstance(c, Untested)]
    assert len(untested) <= UNTESTED_AT_MOST, untested


def test_docs_compatibility_is_the_tables() -> None:
    shown = (REPO / "docs" / "compatibility.md").read_text()
    assert shown == composition.render(), f"docs/compatibility.md is stale: run `{composition.COMMAND}`"


def _blocked() -> list[tuple[str, str]]:
    return sorted(
        tuple(sorted(k, key=lambda i: [f.id for f in composition.FEATURES].index(i)))  # type: ignore[misc]
        for k, c in CELLS.items()
        if isinstance(c, (Refused, Moot))
    )


@pytest.mark.parametrize(("a", "b"), _blocked(), ids=lambda v: v)
def test_a_refused_pair_is_one_line_naming_both_keys_before_launch(
    a: str, b: str, files: dict[str, str], tmp_path: Path
) -> None:
    """Each refused (or moot) pair, asked for with both features' own overrides, stops before any
    process starts with one line; a refused pair's line names both keys."""
    overrides = ["accelerator=cpu", "devices=2"]
    for feature in (BY_ID[a], BY_ID[b]):
        overrides += [o.format(**files) for o in feature.example if o.format(**files) not in overrides]
    if "devices=4" in overrides:
        overrides.remove("devices=2")
    if "strategy=model_parallel" in overrides and not any(o.startswith("model=") for o in overrides):
        overrides += list(BY_ID["lightning"].example)  # (its one model kind: a LightningModule)
    result = cli_in_process(overrides, tmp_path / "run", env=CPU)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, (overrides, result.stderr)
    if isinstance(CELLS[composition.pair(a, b)], Refused):
        for key in (BY_ID[a].key, BY_ID[b].key):
            assert key.split(".")[-1] in lines[0], (key, lines[0])


def test_a_pair_the_table_refuses_is_refused_by_the_table(files: dict[str, str], tmp_path: Path) -> None:
    """tp x peft=qlora is the table's own refusal: its words are the cell's."""
    found = CELLS[composition.pair("tp", "qlora")]
    assert isinstance(found, Refused) and found.check == composition.CHECK
    result = cli_in_process(["accelerator=cpu", "devices=2", "tp=2", "peft=qlora"], tmp_path / "run", env=CPU)
    assert result.returncode == 2 and found.reason in result.stderr, result.stderr


# --------------------------------------------------------------------------- the composed runs


COMMON = ["data.seq_len=48", "data.global_batch_size=8", "trainer.max_steps=4", "accelerator=cpu", "seed=5"]
SAVE = ["checkpoint=full", "checkpoint.every_n_steps=2"]


def _chat(files: dict[str, str], *, packing: bool) -> list[str]:
    return [
        "data=chat",
        f"data.path={files['chats']}",
        f"data.tokenizer={files['tokenizer']}",
        f"data.packing={packing}",
    ]


def _runs(files: dict[str, str]) -> dict[str, tuple[list[str], list[str]]]:
    """name -> (the composed run's overrides, its one-process reference's)."""
    hf_lora = [
        "model=hf",
        f"model.path={files['hf']}",
        *_chat(files, packing=True),
        "peft=lora",
        "peft.r=4",
        "precision=32-true",
        # Each step's gradient norm logged, nothing clipped: AdamW's losses hide a gradient
        # scaled by a constant, the norms do not.
        "trainer.gradient_clip_val=1000000",
    ]
    # Tied embeddings (most small models tie them): the embedding on the first stage, the head on
    # the last, one weight (its gradient summed between the two stages every step).
    tiny = [
        "model=tiny",
        "model.vocab_size=64",
        "precision=bf16-mixed",
        "model.tie_embeddings=true",
    ]
    fp32 = ["model=tiny", "model.vocab_size=64", "precision=32-true"]
    module = [
        "model=custom",
        "model._target_=tests.assets.custom_models.TinyLM",
        "data.vocab_size=64",
        *_chat(files, packing=False),
        "peft=lora",
        "peft.r=4",
        "precision=bf16-mixed",
    ]
    ac_offload = ["strategy.activation_checkpointing=full", "strategy.cpu_offload=true"]
    return {
        "hf": (
            [*hf_lora, "devices=4", "strategy.replicate_size=2", "cp=2", *ac_offload, *SAVE],
            [*hf_lora, "strategy=ddp", "devices=1"],
        ),
        "pipeline": (
            [
                *tiny,
                *_chat(files, packing=True),
                "pp=2",
                "devices=2",
                "strategy.float8=true",
                "strategy.compile=true",
                *ac_offload,
                *SAVE,
            ],
            [
                *tiny,
                *_chat(files, packing=True),
                "devices=1",
                "strategy.float8=true",
            ],
        ),
        "tensor": (
            [*fp32, *_chat(files, packing=True), "tp=2", "devices=2", "strategy.cpu_offload=true", *SAVE],
            [*fp32, *_chat(files, packing=True), "strategy=ddp", "devices=1"],
        ),
        "module": (
            [*module, "devices=2", *ac_offload, "strategy.float8=true", "strategy.compile=true", *SAVE],
            [*module, "devices=1", "strategy.float8=true"],
        ),
    }


@pytest.fixture(scope="module")
def composed_runs(files: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Each composed run and its one-process reference; ``hf_resumed``: the hf run's step-2 full
    file resumed at plain FSDP2 on 2 ranks (no HSDP or offload)."""
    root = tmp_path_factory.mktemp("composed")
    out: dict[str, Any] = {}
    cache = [f"data.cache_dir={root / 'cache'}"]
    for name, (composed, reference) in _runs(files).items():
        for label, args in ((name, composed), (f"{name}_one", reference)):
            run_dir = root / label
            assert_ok(run_cli([*COMMON, *cache, *args], run_dir, env=CPU), run_dir)
            out[label] = run_dir
    hf, _ = _runs(files)["hf"]
    plain = [
        a
        for a in hf
        if a
        not in (
            "devices=4",
            "strategy.replicate_size=2",
            "cp=2",
            "strategy.cpu_offload=true",
        )
    ]
    resumed = root / "hf_resumed"
    checkpoint = out["hf"] / "checkpoints" / "step_00000002.pt"
    assert_ok(
        run_cli([*COMMON, *cache, *plain, "devices=2", f"resume={checkpoint}"], resumed, env=CPU), resumed
    )
    out["hf_resumed"] = resumed
    return out


@pytest.mark.distributed
def test_a_composed_hf_run_on_hsdp_equals_one_process(composed_runs: dict[str, Any]) -> None:
    """model=hf, HSDP (2 replicas) x context parallel (cp=2) on 4 ranks, LoRA, packed chat data
    (documents' positions and masks across the cp slices), activation checkpointing, CPU offload
    and a full save, in fp32: the losses and gradient norms of one process (LoRA on packed chat)."""
    assert relative_gap(losses(composed_runs["hf"]), losses(composed_runs["hf_one"])) < 1e-5
    assert relative_gap(grad_norms(composed_runs["hf"]), grad_norms(composed_runs["hf_one"])) < 1e-5


@pytest.mark.distributed
def test_the_composed_hf_run_resumes_at_another_layout(composed_runs: dict[str, Any]) -> None:
    """The step-2 save of the hf run (HSDP x cp=2) continued at plain FSDP2, cp=1, on 2 ranks:
    checkpoints do not depend on the layout."""
    one = losses(composed_runs["hf_one"])
    assert relative_gap(losses(composed_runs["hf_resumed"]), one[2:]) < 1e-5
    assert (
        relative_gap(grad_norms(composed_runs["hf_resumed"]), grad_norms(composed_runs["hf_one"])[2:]) < 1e-5
    )


@pytest.mark.distributed
def test_a_composed_pipeline_run_in_bf16_and_float8_equals_one_process(composed_runs: dict[str, Any]) -> None:
    """pp=2 of the built-in model with tied embeddings on packed chat data in bf16-mixed with
    float8, compile, activation checkpointing, CPU offload and a full save: one eager bf16 float8
    process's losses, within bf16's tolerance. (Not its gradient norms: this run's second step
    moves them by 2.5-8% between equivalent one-process runs, compiled or eager, with float8 or
    without; the fp32 tied runs of test_pipeline.py compare them, to 1e-5.)"""
    assert (
        relative_gap(losses(composed_runs["pipeline"]), losses(composed_runs["pipeline_one"]))
        < BF16_TOLERANCE
    )


@pytest.mark.distributed
def test_a_composed_tensor_parallel_run_on_packed_chat_equals_one_process(
    composed_runs: dict[str, Any],
) -> None:
    """tp=2 of the built-in model on packed chat data (each rank's heads take the documents'
    mask) with CPU offload and a full save, in fp32: one process's losses."""
    assert relative_gap(losses(composed_runs["tensor"]), losses(composed_runs["tensor_one"])) < 1e-5


@pytest.mark.distributed
def test_a_composed_plain_module_run_equals_one_process(composed_runs: dict[str, Any]) -> None:
    """A plain nn.Module with LoRA on chat data, bf16-mixed, float8, compile, activation
    checkpointing, CPU offload and a full save, on 2 ranks: one eager process's losses within
    bf16's tolerance."""
    assert relative_gap(losses(composed_runs["module"]), losses(composed_runs["module_one"])) < BF16_TOLERANCE
