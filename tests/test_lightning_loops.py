"""Lightning habits of a module that brings its own data: a LightningDataModule (``data=datamodule``),
validation with Lightning's defaults (a sanity check, the whole loader, after every epoch) and
``trainer.accumulate_grad_batches``. The same module trains under a plain ``L.Trainer`` (one
process, in this one) and under fsdp-train (2 CPU ranks), and what it recorded is compared."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from conftest import assert_ok, cli_in_process, composed, read_metrics, run_cli, run_of

from fsdp_cli.builders.trainer import module_validation, token_validation
from fsdp_cli.config.schema import TrainerConfig
from fsdp_cli.errors import ConfigError

ASSETS = "tests.assets.lightning_loops"
MODULE = ["model=custom", f"model._target_={ASSETS}.RecordingRegressor"]
DATAMODULE = ["data=datamodule", f"data._target_={ASSETS}.RegressionData"]
CPU = {"CUDA_VISIBLE_DEVICES": ""}
EPOCHS, ACCUMULATE, PER_RANK_BATCH = 3, 2, 4


def _relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _close(ours: list[float], theirs: list[float]) -> None:
    assert len(ours) == len(theirs) and ours, (ours, theirs)
    assert max(_relative(a, b) for a, b in zip(ours, theirs)) < 1e-5, (ours, theirs)


def _plain_lightning(record_dir: Path) -> dict[str, Any]:
    """The reference: one process, Lightning's defaults, the whole batch of both ranks at once."""
    import lightning as L

    from tests.assets.lightning_loops import RecordingRegressor, RegressionData

    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=EPOCHS,
        accumulate_grad_batches=ACCUMULATE,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=record_dir,
    )
    trainer.fit(RecordingRegressor(str(record_dir)), datamodule=RegressionData(batch_size=2 * PER_RANK_BATCH))
    return json.loads((record_dir / "rank0.json").read_text())


@pytest.mark.distributed
def test_a_datamodule_fed_module_validates_and_accumulates_as_under_lightning(tmp_path: Path) -> None:
    plain = _plain_lightning(tmp_path / "plain")
    run_dir, records = tmp_path / "run", tmp_path / "ours"
    args = [
        *MODULE,
        f"+model.record_dir={records}",
        *DATAMODULE,
        f"+data.batch_size={PER_RANK_BATCH}",
        "strategy=ddp",
        "devices=2",
        "accelerator=cpu",
        "precision=32-true",
        f"trainer.max_epochs={EPOCHS}",
        "trainer.max_steps=-1",
        f"trainer.accumulate_grad_batches={ACCUMULATE}",
    ]
    summary = assert_ok(run_cli(args, run_dir), run_dir)
    ours = [json.loads((records / f"rank{r}.json").read_text()) for r in (0, 1)]

    # 32 samples, 8 per micro-batch across the ranks, 2 micro-batches a step: 2 steps an epoch.
    assert plain["global_step"] == ours[0]["global_step"] == summary["steps"] == 6
    steps = [sum(plain["losses"][i : i + ACCUMULATE]) / ACCUMULATE for i in range(0, 12, ACCUMULATE)]
    _close([row["loss"] for row in read_metrics(run_dir) if "loss" in row], steps)
    _close(ours[0]["weight"], plain["weight"])

    # Validation: a sanity check of 2 batches, then the whole loader (24 / 8) after every epoch.
    assert plain["val_runs"] == [["sanity", 2], ["val", 3], ["val", 3], ["val", 3]]
    assert ours[0]["val_runs"] == ours[1]["val_runs"] == plain["val_runs"]
    _close(ours[0]["val_loss"], plain["val_loss"])
    val_rows = [row for row in read_metrics(run_dir) if "val_loss" in row]
    assert [row["step"] for row in val_rows] == [2, 4, 6]
    _close([row["val_loss"] for row in val_rows], plain["val_loss"])
    assert summary["val_loss"] == val_rows[-1]["val_loss"]

    # Gradients stay each rank's own on the first micro-batch and are synchronised once per step.
    assert ours[0]["synced"] == ours[1]["synced"] == [False, True] * 6
    assert plain["synced"] == [None] * 12

    # Lightning's hooks: prepare_data on local rank 0 only, setup("fit") on every rank.
    assert plain["datamodule_events"] == ["prepare_data", "setup:fit"]
    assert ours[0]["datamodule_events"] == ["prepare_data", "setup:fit"]
    assert ours[1]["datamodule_events"] == ["setup:fit"]
    assert summary["samples_per_s"] > 0 and summary["global_batch_size"] is None


# --------------------------------------------------------------------------- no processes


def test_validation_defaults_follow_the_path(capsys: Any) -> None:
    """A module's own validation loader gets Lightning's defaults (nothing passed: sanity check,
    whole loader, every epoch) unless a key is set; fsdp-train's data validates only with an
    interval, 4 batches, no sanity check, and says when a validation key does nothing."""
    nothing = TrainerConfig()
    assert module_validation(nothing, accumulation=2) == {}
    every_5 = TrainerConfig(val_check_interval=5)
    assert module_validation(every_5, 2) == {"val_check_interval": 10, "check_val_every_n_epoch": None}
    assert token_validation(every_5, 2) == {
        "val_check_interval": 10,
        "check_val_every_n_epoch": None,
        "limit_val_batches": 4,
        "num_sanity_val_steps": 0,
    }
    chosen = TrainerConfig(limit_val_batches=0, num_sanity_val_steps=-1)
    assert module_validation(chosen, 1) == {"limit_val_batches": 0, "num_sanity_val_steps": -1}
    assert capsys.readouterr().err == ""
    assert token_validation(chosen, 1) == {"limit_val_batches": 0, "num_sanity_val_steps": 0}
    note = capsys.readouterr().err
    assert note.startswith(
        "fsdp-train: note: trainer.limit_val_batches and trainer.num_sanity_val_steps have no effect"
    )


def test_a_module_with_neither_loaders_nor_a_datamodule_is_told_what_it_needs(tmp_path: Path) -> None:
    """In the rank too, for a module a factory builds (the parent checks classes)."""
    from fsdp_cli.builders.data import build_datamodule
    from tests.assets.lightning_loops import RecordingRegressor

    cfg = replace(composed(*MODULE), dp=2)
    with pytest.raises(ConfigError) as info:
        build_datamodule(run_of(cfg), RecordingRegressor(str(tmp_path)))
    line = info.value.one_line()
    assert "RecordingRegressor defines no train_dataloader() and no LightningDataModule" in line, line
    assert "data=datamodule data._target_=" in line and "\n" not in line, line


def test_a_datamodule_config_round_trips_through_the_run_directory(tmp_path: Path) -> None:
    from fsdp_cli.config.convert import load_train_config, to_yaml

    cfg = composed(*MODULE, *DATAMODULE, "+data.batch_size=4", "+data.val_size=8")
    assert (cfg.data.target, cfg.data.kwargs) == (
        f"{ASSETS}.RegressionData",
        {"batch_size": 4, "val_size": 8},
    )
    (tmp_path / "config.yaml").write_text(to_yaml(cfg))
    assert load_train_config(tmp_path / "config.yaml") == cfg


REFUSALS = [
    # fsdp-train's data accumulates by its batch sizes.
    (["trainer.accumulate_grad_batches=4"], "trainer.accumulate_grad_batches=4", ["data.micro_batch_size"]),
    # A LightningModule with neither loaders nor a DataModule (checked on its class).
    (
        MODULE,
        f"model._target_={ASSETS}.RecordingRegressor",
        ["RecordingRegressor defines no train_dataloader()", "data=datamodule data._target_="],
    ),
    ([*MODULE, "data=datamodule"], "data._target_", ["needs the LightningDataModule class"]),
    ([*MODULE, "data=datamodule", "data._target_=no_such_pkg.Data"], "data._target_", ["cannot be imported"]),
    (
        [*MODULE, "data=datamodule", f"data._target_={ASSETS}.RecordingRegressor"],
        "data._target_",
        ["RecordingRegressor is not a LightningDataModule"],
    ),
    (
        [*MODULE, *DATAMODULE, "+data.batch_sise=4"],
        "data.batch_sise=4",
        ["takes no argument 'batch_sise'", "did you mean data.batch_size?"],
    ),
    ([*DATAMODULE], "data=datamodule", ["allowed: model=custom"]),
]


@pytest.mark.parametrize(("overrides", "key", "words"), REFUSALS, ids=[" ".join(c[0]) for c in REFUSALS])
def test_mistakes_are_one_line_before_launch(
    tmp_path: Path, overrides: list[str], key: str, words: list[str]
) -> None:
    result = cli_in_process([*overrides, "accelerator=cpu"], tmp_path / "run", env=CPU)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith(f"fsdp-train: error: {key}"), lines[0]
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert not (tmp_path / "run" / "config.yaml").exists()
