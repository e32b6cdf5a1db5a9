"""data=chat through fsdp-train (three tiny runs, shared by the tests here): packed chat data on a
Hugging Face model, the loss equal on one process with micro-batches, on dp=2 without, and
through a pipeline (pp=2, 1F1B); a resume mid-epoch at another layout, and masked validation."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from conftest import assert_ok, read_metrics, run_cli
from test_chat_data import CHATML, chats, save_chat_tokenizer, save_hf_llama, write_chats

CHAT = [
    "data=chat",
    "data.packing=true",
    "data.seq_len=48",
    "data.global_batch_size=4",
    "trainer.max_steps=4",
    "trainer.val_check_interval=2",
    "trainer.limit_val_batches=null",
    "checkpoint.every_n_steps=2",
    "precision=32-true",
    "accelerator=cpu",
    "seed=5",
]


@pytest.fixture(scope="module")
def chat_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``straight``: one process, micro-batches of 2 (accumulating 2); ``resumed``: its step-2
    checkpoint continued on FSDP1 with dp=2, micro-batches of 1; ``piped``: FSDP2 at pp=2."""
    root = tmp_path_factory.mktemp("chat-runs")
    model = save_hf_llama(root / "model")
    for file in save_chat_tokenizer(root / "tokenizer", CHATML).iterdir():
        shutil.copy(file, model / file.name)
    train = write_chats(root / "train.jsonl", chats(40, seed=1))
    val = write_chats(root / "val.jsonl", chats(10, seed=2))
    data = [
        "model=hf",
        f"model.path={model}",
        f"data.path={train}",
        f"data.val_path={val}",
        f"data.cache_dir={root / 'cache'}",
    ]
    straight = root / "straight"
    first = run_cli([*CHAT, *data, "strategy=ddp", "devices=1", "data.micro_batch_size=2"], straight)
    assert_ok(first, straight)
    resumed = root / "resumed"
    checkpoint = straight / "checkpoints" / "step_00000002"
    second = run_cli(
        [*CHAT, *data, "strategy=fsdp", "devices=2", "data.micro_batch_size=1", f"resume={checkpoint}"],
        resumed,
    )
    assert_ok(second, resumed)
    piped = root / "piped"
    third = run_cli([*CHAT, *data, "strategy=fsdp2", "devices=2", "pp=2", "data.micro_batch_size=2"], piped)
    assert_ok(third, piped)
    return {"straight": straight, "resumed": resumed, "piped": piped, "stderr": first.stderr}


def rows(run_dir: Path, key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in read_metrics(run_dir) if key in r}


@pytest.mark.distributed
def test_packed_chat_losses_match_across_layouts_micro_batching_and_resume(chat_runs: dict[str, Any]) -> None:
    straight, resumed = rows(chat_runs["straight"], "loss"), rows(chat_runs["resumed"], "loss")
    assert sorted(straight) == [1, 2, 3, 4] and sorted(resumed) == [3, 4]
    for step in (3, 4):
        assert abs(straight[step] - resumed[step]) < 1e-5, (step, straight, resumed)
    assert (
        rows(chat_runs["straight"], "supervised_tokens")[3]
        == rows(chat_runs["resumed"], "supervised_tokens")[3]
    )


@pytest.mark.distributed
def test_chat_validation_is_the_same_masked_mean_on_both_layouts(chat_runs: dict[str, Any]) -> None:
    straight, resumed = rows(chat_runs["straight"], "val_loss"), rows(chat_runs["resumed"], "val_loss")
    assert abs(straight[4] - resumed[4]) < 1e-5, (straight, resumed)
    assert (
        "fsdp-train: data.path: 40 examples ->" in chat_runs["stderr"]
        and "supervised tokens" in chat_runs["stderr"]
    )
    written = json.loads((chat_runs["straight"] / "data_statistics.json").read_text())
    assert written["data.val_path"]["examples"] == 10


@pytest.mark.distributed
def test_packed_chat_through_a_pipeline_equals_one_process(chat_runs: dict[str, Any]) -> None:
    """pp=2 (1F1B, two micro-batches of one sequence, two batches accumulated per step): the
    labels, the packed positions and the token weights travel with the micro-batches; the loss is
    the mean over the global batch's supervised tokens, validation the masked mean, as at pp=1."""
    for key in ("loss", "val_loss"):
        straight, piped = rows(chat_runs["straight"], key), rows(chat_runs["piped"], key)
        assert sorted(piped) == sorted(straight) and piped, (key, piped, straight)
        for step in straight:
            assert abs(straight[step] - piped[step]) <= 1e-5 * abs(straight[step]), (key, straight, piped)
