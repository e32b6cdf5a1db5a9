"""A LightningModule that brings its own DataLoaders is trained as it is, under every strategy:
its loaders (a DistributedSampler per data-parallel rank), optimizers, ``self.log`` metrics,
``configure_model``; checkpoints, exact ``resume=auto`` and ``fsdp-ckpt`` work for it."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from conftest import assert_ok, read_metrics, run_cli

from fsdp_cli.cli.ckpt import main as ckpt_main

BORING = "lightning.pytorch.demos.boring_classes.BoringModel"
ASSETS = "tests.assets.own_loaders"
TWO_CPU = ["devices=2", "accelerator=cpu", "precision=32-true"]
RUNS: dict[str, list[str]] = {
    # The issue's own command, as lightning_fairscale users type it.
    "boring_ddp_fully_sharded": [
        "strategy=ddp_fully_sharded",
        f"model._target_={BORING}",
        "trainer.max_steps=3",
    ],
    "boring_fsdp2": [
        "strategy=fsdp2",
        f"model._target_={ASSETS}.RecordingBoringModel",
        "trainer.max_steps=3",
        "logger=csv",
    ],
    "boring_ddp": ["strategy=ddp", f"model._target_={ASSETS}.RecordingBoringModel", "trainer.max_steps=3"],
    # Manual wrap() in configure_model, validation, its own val_loss: 2-step epochs, saved at step 2.
    "wrapped_fsdp": [
        "strategy=fsdp",
        f"model._target_={ASSETS}.WrappedLoaderLM",
        "trainer.max_steps=4",
        "checkpoint.every_n_steps=2",
        "trainer.val_check_interval=2",
    ],
    # Lightning's tensor-parallel example, as the issue ran it: tp=2 and 4 loader workers, under
    # the default launcher (ranks from the forkserver; the workers forked from each rank).
    "parallel_model_parallel": [
        "strategy=model_parallel",
        "tp=2",
        f"model._target_={ASSETS}.ParallelLoaderLM",
        "+model.num_workers=4",
        "trainer.max_steps=3",
    ],
}


@pytest.fixture(scope="module")
def own_run(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``own_run(name)`` -> (run dir, stderr) of ``RUNS[name]``, run once on first use."""
    root = tmp_path_factory.mktemp("own_loaders")
    done: dict[str, tuple[Path, str]] = {}

    def get(name: str) -> tuple[Path, str]:
        if name not in done:
            run_dir = root / name
            result = run_cli(["model=custom", *TWO_CPU, *RUNS[name]], run_dir)
            assert_ok(result, run_dir)
            done[name] = (run_dir, result.stderr)
        return done[name]

    return get


def train_rows(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in read_metrics(run_dir) if "loss" in r]


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(RUNS))
def test_module_trains_on_its_own_loaders(own_run: Any, name: str) -> None:
    run_dir, stderr = own_run(name)
    assert "defines train_dataloader(): training on its own loaders (data=synthetic is not used)" in stderr
    rows = train_rows(run_dir)
    steps = int(next(a for a in RUNS[name] if a.startswith("trainer.max_steps=")).split("=")[1])
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for row in rows:
        # What training_step returned, the time per step, and samples (not tokens) per second.
        assert row["loss"] > 0 and row["step_time_s"] > 0 and row["samples_per_s"] > 0
        assert "tokens_per_s" not in row
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["samples_per_s"] > 0 and summary["tokens_per_s"] is None
    assert summary["global_batch_size"] is None and summary["seq_len"] is None
    assert summary["parameters"] > 0 and Path(summary["checkpoint"]).exists()


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["boring_fsdp2", "boring_ddp"])
def test_each_data_parallel_rank_sees_different_samples(own_run: Any, name: str) -> None:
    """Lightning's DistributedSampler splits the module's dataset across data-parallel ranks."""
    run_dir, _ = own_run(name)
    seen = [json.loads((run_dir / f"seen_rank{r}.json").read_text()) for r in (0, 1)]
    assert len(seen[0]) == len(seen[1]) == 3  # BoringModel: batch size 1, 3 steps
    assert not set(seen[0]) & set(seen[1]), seen


@pytest.mark.distributed
def test_self_log_metrics_reach_the_logger(own_run: Any) -> None:
    run_dir, _ = own_run("boring_fsdp2")
    with open(run_dir / "csv" / "metrics.csv") as fh:
        logged = [row for row in csv.DictReader(fh) if row.get("train_mse")]
    assert logged and all(float(row["train_mse"]) > 0 for row in logged)


@pytest.mark.distributed
def test_manual_wrap_and_validation_of_a_module_with_its_own_loaders(own_run: Any) -> None:
    run_dir, _ = own_run("wrapped_fsdp")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert sorted(summary["setup"]["fsdp_units"]) == ["<root>", "blocks.0", "blocks.1"]
    val = [r for r in read_metrics(run_dir) if "val_loss" in r]
    assert [r["step"] for r in val] == [2, 4] and summary["val_loss"] == val[-1]["val_loss"]


@pytest.mark.distributed
def test_resume_auto_continues_bitwise(own_run: Any, tmp_path: Path) -> None:
    """4 steps straight == resume=auto from the step-2 checkpoint (an epoch boundary: the module's
    DistributedSampler reshuffles per epoch, so every batch after it is the same)."""
    straight, _ = own_run("wrapped_fsdp")
    resumed = tmp_path / "resumed"
    shutil.copytree(straight / "checkpoints" / "step_00000002", resumed / "checkpoints" / "step_00000002")
    result = run_cli(["model=custom", *TWO_CPU, *RUNS["wrapped_fsdp"], "resume=auto"], resumed)
    assert_ok(result, resumed)
    assert "resuming from" in result.stderr
    assert [(r["step"], r["loss"]) for r in train_rows(resumed)] == [
        (r["step"], r["loss"]) for r in train_rows(straight)[2:]
    ]


@pytest.mark.distributed
def test_fsdp_ckpt_reads_and_converts_a_user_module_checkpoint(
    own_run: Any, tmp_path: Path, capsys: Any
) -> None:
    from safetensors.torch import load_file

    run_dir, _ = own_run("boring_ddp_fully_sharded")
    checkpoint = run_dir / "checkpoints" / "step_00000003"
    ckpt_main(["inspect", str(checkpoint), "--json"])
    info = json.loads(capsys.readouterr().out)
    assert (info["step"], info["parameter_count"], info["config"]["model"]["_target_"]) == (3, 66, BORING)
    ckpt_main(["convert", str(checkpoint), str(tmp_path / "w.safetensors"), "--to", "safetensors"])
    assert sorted(load_file(str(tmp_path / "w.safetensors"))) == ["layer.bias", "layer.weight"]


# --------------------------------------------------------------------------- no processes


def test_data_settings_given_for_such_a_module_are_refused(capsys: Any) -> None:
    """The data group of the defaults is ignored with a notice; one the user chose is refused,
    since it would do nothing."""
    from dataclasses import replace

    from conftest import composed, run_of
    from lightning.pytorch.demos.boring_classes import BoringModel

    from fsdp_cli.builders.data import build_datamodule
    from fsdp_cli.errors import ConfigError

    cfg = replace(composed("model=custom", f"model._target_={BORING}"), dp=2)
    assert build_datamodule(run_of(cfg), BoringModel()) is None
    assert "BoringModel defines train_dataloader()" in capsys.readouterr().err
    with pytest.raises(
        ConfigError, match=r"^data=text: BoringModel defines train_dataloader\(\).*hint: drop"
    ):
        build_datamodule(
            run_of(replace(cfg, data=composed("data=text").data, explicit_data=True)), BoringModel()
        )


def test_only_command_line_data_overrides_count_as_chosen() -> None:
    from fsdp_cli.resolve import chooses_data

    assert chooses_data(["data=text", "strategy=ddp"])
    assert chooses_data(["+data.foo=1"]) and chooses_data(["data.seq_len=8"])
    assert not chooses_data(["model=custom", "model._target_=a.B", "dataset=x"])


def test_vocabulary_questions_wait_for_a_module_that_uses_the_data_group() -> None:
    """model=custom without a vocabulary passes the parent (a module with its own loaders needs
    none); a module trained on the data group is asked in the rank."""
    from dataclasses import replace

    from conftest import composed

    from fsdp_cli.config.validate import checked_run, data_checks_deferred, validate, validate_data
    from fsdp_cli.errors import ConfigError
    from fsdp_cli.launch.layout import resolve_layout

    cfg = resolve_layout(composed("model=custom", f"model._target_={BORING}"), {"CUDA_VISIBLE_DEVICES": ""})
    assert cfg.data.vocab_size is None and data_checks_deferred(cfg)
    validate(checked_run(cfg))
    with pytest.raises(ConfigError, match="data.vocab_size=null"):
        validate_data(checked_run(cfg))
    with pytest.raises(ConfigError, match="data.vocab_size=null"):
        validate(checked_run(replace(cfg, explicit_data=True)))
