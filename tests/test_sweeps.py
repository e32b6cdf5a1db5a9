"""Sweeps (``fsdp-train -m``): every job checked before the first starts, invalid ones skipped,
failed ones recorded, the sweep going on; the comparison table and files; Optuna and submitit."""

from __future__ import annotations

import csv
import json
import re
import signal
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    REPO,
    cli_in_process,
    complete_lines,
    read_metrics,
    read_summary,
    run_cli,
    start_cli,
    wait_for,
)
from harness import Result
from omegaconf import OmegaConf

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CPU = ["accelerator=cpu"]


def sweep_rows(sweep_dir: Path) -> list[dict[str, Any]]:
    return json.loads((sweep_dir / "sweep_summary.json").read_text())


def run(args: list[str], timeout: float = 300) -> Result:
    """``fsdp-train ARGS`` to its end, stdout and stderr as one stream (``.out``) in the order written."""
    return run_cli(args, timeout=timeout, merge_output=True)


def statuses(sweep_dir: Path, n: int) -> list[str]:
    return [read_summary(sweep_dir / str(i))["status"] for i in range(n)]


# --------------------------------------------------------------------------- real sweeps


@pytest.mark.distributed
def test_the_issue_sweep_skips_the_invalid_job_runs_the_rest_and_compares(tmp_path: Path) -> None:
    # Used to be: job 0 runs; job 1 (tp=3) exits 2; job 2 never runs; no table; exit 2.
    sweep = tmp_path / "sweep"
    r = run(["-m", *CPU, "devices=2", "tp=1,3,2", "trainer.max_steps=3", f"hydra.sweep.dir={sweep}"])
    assert r.returncode == 0, r
    assert statuses(sweep, 3) == ["ok", "skipped", "ok"]
    reason = read_summary(sweep / "1")["reason"]
    assert reason.startswith("tp=3: must divide the world size 2") and "hint:" in reason
    # Checked before the first job started: the verdict on job 1 comes before job 0's first step.
    verdict = r.out.index("#1 : accelerator=cpu devices=2 tp=3 trainer.max_steps=3  -> skipped: tp=3")
    assert verdict < r.out.index("step      1"), r
    assert "Launching 2 jobs locally (1 of 3 skipped as invalid)" in r.out
    # Each valid job ran exactly once; the skipped one started nothing but still has its folder.
    for job in ("0", "2"):
        assert [row["step"] for row in read_metrics(sweep / job)] == [1, 2, 3]
    assert (sweep / "1" / ".hydra" / "overrides.yaml").is_file()
    assert not (sweep / "1" / "metrics.jsonl").exists() and not (sweep / "1" / "config.yaml").exists()
    # The comparison: dp=2 and tp=2 are the same optimisation, so the same losses.
    dp2, tp2 = ([row["loss"] for row in read_metrics(sweep / job)] for job in ("0", "2"))
    assert max(abs(a - b) for a, b in zip(dp2, tp2)) < 1e-5, (dp2, tp2)
    _check_report(r.out, sweep)


def _check_report(out: str, sweep: Path) -> None:
    assert "sweep: 3 jobs (2 ok, 1 skipped, 0 failed)" in out
    assert re.search(r"^\s*1  tp=3\s+skipped\s", out, re.M), out  # the skipped job's row, with its reason
    assert "tp=3: must divide the world size 2" in out.split("sweep: 3 jobs")[1]
    rows = sweep_rows(sweep)
    assert [(row["job"], row["status"], row["dp"], row["tp"]) for row in rows] == [
        ("0", "ok", 2, 1),
        ("1", "skipped", None, 3),
        ("2", "ok", 1, 2),
    ]
    ok = rows[0]
    assert ok["overrides"] == ["accelerator=cpu", "devices=2", "tp=1", "trainer.max_steps=3"]
    assert (ok["strategy"], ok["precision"], ok["steps"]) == ("fsdp2", "32-true", 3)
    assert ok["final_loss"] == read_metrics(sweep / "0")[-1]["loss"]
    assert ok["tokens_per_s"] > 0 and ok["step_time_s"] > 0
    assert len(ok["peak_memory_mib_per_rank"]) == 2 and min(ok["peak_memory_mib_per_rank"]) > 0
    assert rows[1]["reason"].startswith("tp=3") and rows[1]["final_loss"] is None
    with open(sweep / "sweep_summary.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert [row["status"] for row in table] == ["ok", "skipped", "ok"]
    assert table[0]["overrides"] == "accelerator=cpu devices=2 tp=1 trainer.max_steps=3"
    assert len(table[0]["peak_memory_mib_per_rank"].split(";")) == 2
    assert (sweep / "sweep_summary.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.distributed
def test_a_preempted_job_stops_the_sweep(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    args = [
        "-m",
        *CPU,
        "devices=1",
        "data.seq_len=32",
        "trainer.max_steps=100000,3",
        f"hydra.sweep.dir={sweep}",
    ]
    proc = start_cli(args, merge_output=True)
    wait_for(lambda: len(complete_lines(sweep / "0" / "metrics.jsonl")) >= 2, proc, timeout=240)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143, out
    assert read_summary(sweep / "0")["status"] == "preempted"
    assert not (sweep / "1").exists(), "the sweep stopped with the preempted job"


@pytest.mark.distributed
def test_optuna_with_a_failed_and_invalid_trials_maximises_tokens_per_s(tmp_path: Path) -> None:
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    sweep = tmp_path / "sweep"
    models = "tests.assets.failing_model.FailsAtSecondStep,tests.assets.custom_models.TinyLM"
    args = [
        "-m",
        "hydra/sweeper=optuna",
        "hydra/sweeper/sampler=grid",
        "hydra.sweeper.direction=maximize",
        "sweep.objective=tokens_per_s",
        *CPU,
        "devices=1",
        "model=custom",
        f"model._target_=choice({models})",
        "data.vocab_size=256",
        "trainer.max_steps=3",
        "tp=choice(1,2)",
        f"hydra.sweep.dir={sweep}",
    ]
    r = run(args)
    assert r.returncode == 1, r  # a trial failed; nothing stopped the study
    rows = {(row["overrides"][0].split(".")[-1], row["tp"]): row for row in sweep_rows(sweep)}
    assert {key: row["status"] for key, row in rows.items()} == {
        ("FailsAtSecondStep", 1): "failed",
        ("FailsAtSecondStep", 2): "skipped",
        ("TinyLM", 1): "ok",
        ("TinyLM", 2): "skipped",
    }
    failed = rows["FailsAtSecondStep", 1]
    assert (failed["reason"], failed["steps"]) == ("RuntimeError: simulated failure in the second step", 1)
    assert "Error executing job" not in r.out  # Hydra never saw an exception
    ok = rows["TinyLM", 1]
    results = OmegaConf.load(sweep / "optimization_results.yaml")
    # What the job returned to Optuna is its tokens/s, exactly as its summary.json has it.
    assert results.best_value == read_summary(Path(ok["job_dir"]))["tokens_per_s"] == ok["tokens_per_s"]
    assert results.best_params == {"model._target_": "tests.assets.custom_models.TinyLM", "tp": 1}
    assert "sweep: 4 jobs (1 ok, 2 skipped, 1 failed)" in r.out


@pytest.mark.distributed
def test_optuna_minimises_the_validation_loss_of_jobs_that_validate(tmp_path: Path) -> None:
    """The default objective (``auto``) of jobs that validate is their last validation loss: what
    Optuna records, what the table's ``val loss`` column and the CSV/JSON rows show."""
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    sweep = tmp_path / "sweep"
    for name, count in (("train", 40), ("val", 8)):
        text = "".join(
            json.dumps({"text": f"the quick brown fox {i} jumps over the lazy dog"}) + "\n"
            for i in range(count)
        )
        (tmp_path / f"{name}.jsonl").write_text(text)
    args = [
        "-m",
        "hydra/sweeper=optuna",
        "hydra/sweeper/sampler=grid",
        *CPU,
        "devices=1",
        "model=custom",
        "model._target_=tests.assets.custom_models.TinyLM",
        "data=jsonl",
        f"data.path={tmp_path / 'train.jsonl'}",
        f"data.val_path={tmp_path / 'val.jsonl'}",
        "data.seq_len=32",
        "data.vocab_size=256",
        "trainer.val_check_interval=2",
        "trainer.max_steps=4",
        "optim.lr=choice(0.0001,0.01)",
        f"hydra.sweep.dir={sweep}",
    ]
    r = run(args)
    assert r.returncode == 0, r
    rows = sweep_rows(sweep)
    val = {row["overrides"][0]: row["val_loss"] for row in rows}
    assert all(v is not None for v in val.values()) and len(set(val.values())) == 2, val
    for row in rows:
        assert row["val_loss"] == read_summary(Path(row["job_dir"]))["val_loss"] != row["final_loss"]
    results = OmegaConf.load(sweep / "optimization_results.yaml")
    assert results.best_value == min(val.values())
    assert re.search(r"final loss\s+val loss", r.out), r.out
    with open(sweep / "sweep_summary.csv", newline="") as f:
        assert "val_loss" in next(csv.reader(f))


@pytest.mark.distributed
def test_submitit_local_runs_each_job_in_a_process_of_its_own(tmp_path: Path) -> None:
    """Hydra's submitit launcher (no pre-pass: each job checks itself) really running a sweep."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    sweep = tmp_path / "sweep"
    args = ["-m", "hydra/launcher=submitit_local", *CPU, "devices=2", "tp=1,3", "trainer.max_steps=3"]
    # From a directory of the user's, as sweeps are run: submitit starts its jobs with ``python -m``,
    # which puts the working directory first on the path, and in a source checkout that is the
    # package without its configs (shipped from configs/ in an install): see docs/sweeps.md.
    r = run_cli([*args, f"hydra.sweep.dir={sweep}"], cwd=tmp_path, merge_output=True, timeout=300)
    logs = "".join(
        f"\n--- {p}\n{p.read_text()[-3000:]}" for p in sorted(sweep.glob(".submitit/*/*.[eo][ru][rt]"))
    )
    assert r.returncode == 0, f"{r}{logs}"  # submitit names the job's log files; show them
    assert statuses(sweep, 2) == ["ok", "skipped"]
    assert [row["step"] for row in read_metrics(sweep / "0")] == [1, 2, 3]
    assert read_summary(sweep / "1")["reason"].startswith("tp=3: must divide the world size 2")
    # Each job ran in a process submitit started, not in the sweep's own.
    assert sorted(p.name for p in (sweep / ".submitit").iterdir()), "submitit's job folders"
    assert [row["status"] for row in sweep_rows(sweep)] == ["ok", "skipped"]


# --------------------------------------------------------------------------- no ranks started


def test_under_hydras_basic_launcher_each_job_checks_itself(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    r = cli_in_process(
        ["-m", "hydra/launcher=basic", *CPU, "devices=2", "tp=3,5", f"hydra.sweep.dir={sweep}"]
    )
    assert r.returncode == 2, r  # every job skipped as invalid: nothing failed, and nothing ran
    assert "skipped as invalid" not in r.out  # no pre-pass: the guard in each job decided
    assert statuses(sweep, 2) == ["skipped", "skipped"]
    assert read_summary(sweep / "1")["reason"].startswith("tp=5: must divide the world size 2")
    assert "sweep: 2 jobs (0 ok, 2 skipped, 0 failed)" in r.out


def test_optuna_study_of_only_invalid_trials_completes(tmp_path: Path) -> None:
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    sweep = tmp_path / "sweep"
    args = ["-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=2", *CPU, "devices=2", "tp=choice(3)"]
    r = cli_in_process([*args, f"hydra.sweep.dir={sweep}"])
    assert r.returncode == 2, r  # the study completes, but no trial ran
    assert r.stderr.endswith(
        "fsdp-train: error: no job of the sweep ran: all 2 were skipped; hint: the reason of each is in the table\n"
    )
    assert "Best value: inf" in r.out  # minimising: an invalid trial is worth +inf, never NaN or None
    assert [row["status"] for row in sweep_rows(sweep)] == ["skipped", "skipped"]


def test_optuna_direction_opposite_to_the_objective_gets_a_note(tmp_path: Path) -> None:
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    args = ["-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=1", "hydra.sweeper.direction=maximize"]
    r = cli_in_process([*args, *CPU, "tp=choice(3)", f"hydra.sweep.dir={tmp_path / 'sweep'}"])
    assert "note: hydra.sweeper.direction=maximize with sweep.objective=auto" in r.out, r


def test_submitit_slurm_launcher_composes() -> None:
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    args = ["hydra/launcher=submitit_slurm", "hydra.launcher.partition=gpu", "hydra.launcher.gpus_per_node=8"]
    r = cli_in_process([*args, "--cfg", "hydra", "--package", "hydra.launcher"])
    assert r.returncode == 0, r
    launcher = OmegaConf.create(r.out.split("\n", 1)[1])  # after the "# @package" line
    assert launcher._target_ == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    assert (launcher.partition, launcher.gpus_per_node, launcher.tasks_per_node) == ("gpu", 8, 1)


def test_the_validating_launcher_is_the_default_and_discovered() -> None:
    r = cli_in_process(["--cfg", "hydra", "--package", "hydra.launcher"])
    assert "_target_: hydra_plugins.fsdp_cli_sweep.launcher.SweepLauncher" in r.out, r
    plugins = cli_in_process(["--info", "plugins"]).out
    launchers = plugins.split("Launcher:")[1].split("Sweeper:")[0]
    assert launchers.count("SweepLauncher") == 1, launchers


def test_hydra_plugins_stays_a_namespace_package() -> None:
    # An __init__.py there would hide every other installed Hydra plugin (optuna, submitit, ...).
    assert not (REPO / "hydra_plugins" / "__init__.py").exists()
    pyproject = (REPO / "pyproject.toml").read_text()
    assert '"hydra_plugins.fsdp_cli_sweep",' in pyproject and '"hydra_plugins",' not in pyproject


def test_a_malformed_sweep_value_stops_before_any_job(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    r = cli_in_process(["-m", *CPU, "tp=1,abc", f"hydra.sweep.dir={sweep}"])
    assert r.returncode == 2, r
    assert r.out.strip().splitlines()[-1].startswith("fsdp-train: error: tp=abc"), r
    assert not (sweep / "0").exists()


def test_multirun_with_cfg_is_one_line() -> None:
    r = cli_in_process(["-m", "tp=1,2", "--cfg", "job"])
    assert r.returncode == 2, r
    assert r.out.strip().splitlines() == [
        "fsdp-train: error: --cfg and --multirun cannot be combined (one mode at a time); "
        "hint: to see one job of a sweep, drop -m and give one value per key: fsdp-train tp=2 --cfg job"
    ]
