"""A LightningModule whose DataLoaders read through worker processes trains under every start
method the launcher offers as under plain Lightning: the same losses and weights, its workers
children of the rank (never a second copy of the rank's start-up), the rank's processes started
with the platform's default method unless the user names one (``multiprocessing_context``),
``persistent_workers`` kept across epochs. And a rank whose first step never ends (a loader that
never delivers) is ended by the watchdog's first-step limit, with its stack."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path
from typing import Any

import pytest
from conftest import assert_ok, bare_trainer, read_metrics, read_summary, run_cli
from harness import processes_naming

from fsdp_cli.rundir.heartbeat import read_heartbeats

pytestmark = pytest.mark.distributed

MODULE = ["model=custom", "model._target_=tests.assets.loader_workers.WorkerFedRegressor"]
TWO_CPU = ["strategy=ddp", "devices=2", "accelerator=cpu", "precision=32-true"]
EPOCHS, PER_RANK_BATCH = 2, 4
# Under the default launcher: Python's default context (restarted each epoch), and the user's
# own spawn and forkserver contexts (kept across epochs).
EVERY_CONTEXT = (
    "{default:{num_workers:2},spawned:{num_workers:1,context:spawn,persistent:true},"
    "served:{num_workers:1,context:forkserver,persistent:true}}"
)
START_METHODS = {
    "default": [f"+model.loaders={EVERY_CONTEXT}"],
    "fork": ["launcher.start_method=fork"],
    "subprocess": ["launcher.start_method=subprocess"],
}


def _relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def plain_lightning(record_dir: Path) -> dict[str, Any]:
    """The reference: one process, a plain Trainer, both ranks' batch at once, no workers."""
    from tests.assets.loader_workers import WorkerFedRegressor

    record_dir.mkdir()
    trainer = bare_trainer(record_dir, max_steps=-1, max_epochs=EPOCHS, devices=1)
    module = WorkerFedRegressor(str(record_dir), {"default": {}}, batch_size=2 * PER_RANK_BATCH)
    trainer.fit(module)
    return json.loads((record_dir / "rank0.json").read_text())


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return plain_lightning(tmp_path_factory.mktemp("plain") / "record")


@pytest.mark.parametrize("start_method", list(START_METHODS))
def test_loader_workers_train_as_under_plain_lightning(
    tmp_path: Path, reference: dict[str, Any], start_method: str
) -> None:
    run_dir, records = tmp_path / "run", tmp_path / "records"
    records.mkdir()
    args = [*MODULE, f"+model.record_dir={records}", *TWO_CPU, *START_METHODS[start_method]]
    args += [f"trainer.max_epochs={EPOCHS}", "trainer.max_steps=-1", "launcher.first_step_timeout_s=120"]
    result = run_cli(args, run_dir, timeout=240)
    summary = assert_ok(result, run_dir)
    assert result.stderr.count("defines train_dataloader()") == 1, "the rank's start-up ran once"
    ranks = [json.loads((records / f"rank{r}.json").read_text()) for r in (0, 1)]

    # 32 samples, 8 a step across the ranks: 4 steps an epoch; every loader gave the same batches.
    assert summary["steps"] == len(reference["losses"]) == 8
    assert [r["mismatches"] for r in ranks] == [0, 0]
    losses = [row["loss"] for row in read_metrics(run_dir) if "loss" in row]
    assert len(losses) == 8 and max(map(_relative, losses, reference["losses"])) < 1e-5, (losses, reference)
    assert max(map(_relative, ranks[0]["weight"], reference["weight"])) < 1e-5

    # The ranks are the processes that beat; each worker is a child of one of them.
    rank_pids = {r["pid"] for r in ranks}
    assert {beat.pid for beat in read_heartbeats(run_dir).values()} == rank_pids
    workers = [json.loads(p.read_text()) for p in records.glob("worker_*.json")]
    assert workers and {w["parent"] for w in workers} == rank_pids
    per_loader = {name: sum(w["loader"] == name for w in workers) for name in {w["loader"] for w in workers}}
    if start_method == "default":
        # 2 workers a rank, started again each epoch; 1 a rank kept across epochs.
        assert per_loader == {"default": 2 * 2 * EPOCHS, "spawned": 2, "served": 2}, per_loader
    else:
        assert per_loader == {"default": 2 * 2 * EPOCHS}, per_loader
    # What a rank starts without naming a method starts as in `python train.py`.
    platform_default = multiprocessing.get_all_start_methods()[0]
    assert [r["start_method"] for r in ranks] == [platform_default] * 2


def test_a_rank_stuck_before_its_first_step_is_ended_by_the_watchdog(tmp_path: Path) -> None:
    """Rank 1's loader never delivers its first batch (its worker sleeps in the dataset): no rank
    finishes a step. launcher.first_step_timeout_s ends the job, names the limit and the rank,
    with the rank's stack (waiting on its loader) in its log, and nothing is left running."""
    run_dir, records = tmp_path / "stuck", tmp_path / "records"
    records.mkdir()
    args = [*MODULE, f"+model.record_dir={records}", "+model.stall_rank=1", *TWO_CPU, "trainer.max_steps=3"]
    result = run_cli([*args, "launcher.first_step_timeout_s=4"], run_dir, timeout=240)
    assert result.returncode == 1, result.stderr[-3000:]
    error = read_summary(run_dir)["error"]
    assert error.startswith(
        "hang: no rank made progress for 4 s before the first step ended (the first batches, a loader's"
        " workers, compilation); launcher.first_step_timeout_s=4; last step 0; stuck: "
    ), error
    assert "rank 1 waiting for the data loader" in error, error
    assert "dataloader.py" in (run_dir / "logs" / "rank1.log").read_text(), "its stack, in its loader"
    assert processes_naming(str(run_dir)) == []
