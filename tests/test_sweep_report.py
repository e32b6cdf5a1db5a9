"""The pieces of a sweep without processes: the report read from job folders (table, CSV, JSON,
PNG, with and without matplotlib), the values jobs return to a sweeper, the exit status, and the
pre-launch check hook shared by single runs and sweeps."""

from __future__ import annotations

import csv
import io
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_module
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf, open_dict
from rich.console import Console

from fsdp_cli import resolve
from fsdp_cli.config.store import register_schemas
from fsdp_cli.errors import ConfigError
from fsdp_cli.rundir import table as table_module
from fsdp_cli.rundir.table import print_summary
from fsdp_cli.sweep import job as sweep_job
from fsdp_cli.sweep import plot as sweep_plot
from fsdp_cli.sweep import report as sweep
from fsdp_cli.sweep import summary as summary_module
from fsdp_cli.sweep.jobs import COLUMNS, NO_SUMMARY, collect
from fsdp_cli.sweep.summary import print_table, report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make_job(
    sweep_dir: Path, n: int, overrides: list[str], summary: dict[str, Any] | None, losses: list[float]
) -> Path:
    job = sweep_dir / str(n)
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    if summary is not None:
        (job / "summary.json").write_text(json.dumps(summary))
    with open(job / "metrics.jsonl", "w") as f:
        for step, loss in enumerate(losses, 1):
            f.write(json.dumps({"step": step, "loss": loss}) + "\n")
    return job


@pytest.fixture
def sweep_dir(tmp_path: Path) -> Path:
    d = tmp_path / "sweep"
    ok = {"status": "ok", "dp": 2, "tp": 1, "strategy": "fsdp2", "precision": "32-true", "steps": 3}
    ok |= {"final_loss": 4.5, "tokens_per_s": 2000.0, "step_time_s": 0.1, "peak_memory_bytes": [2**20, 2**21]}
    make_job(d, 0, ["devices=2", "tp=1"], ok, [5.0, 4.8, 4.5])
    make_job(d, 1, ["devices=2", "tp=3"], {"status": "skipped", "reason": "tp=3: must divide", "tp": 3}, [])
    failed = {"status": "failed", "error": "RuntimeError: boom", "dp": 1, "tp": 2, "steps": 0}
    make_job(d, 2, ["devices=2", "tp=2"], failed, [5.0, 4.9])
    make_job(d, 10, ["devices=2", "tp=4"], None, [])  # killed before writing a summary
    return d


def test_jobs_are_read_from_their_folders_in_job_order(sweep_dir: Path) -> None:
    jobs = collect(sweep_dir)
    assert [(j.job, j.status, j.label) for j in jobs] == [
        ("0", "ok", "tp=1"),
        ("1", "skipped", "tp=3"),
        ("2", "failed", "tp=2"),
        ("10", "failed", "tp=4"),  # 10 after 2: numeric order
    ]
    assert jobs[0].peak_memory_mib_per_rank == [1.0, 2.0] and jobs[0].losses == [(1, 5.0), (2, 4.8), (3, 4.5)]
    assert (jobs[2].steps, jobs[2].reason) == (2, "RuntimeError: boom"), "how far a failed job got"
    assert jobs[3].reason == NO_SUMMARY


def test_an_earlier_sweep_in_the_same_folder_is_left_out(sweep_dir: Path) -> None:
    old = (sweep_dir / "0" / ".hydra" / "overrides.yaml").stat().st_mtime - 3600
    for job in ("0", "1"):
        os.utime(sweep_dir / job / ".hydra" / "overrides.yaml", (old, old))
    assert [j.job for j in collect(sweep_dir, since=old + 1800)] == ["2", "10"]


def test_report_writes_the_table_and_the_files(sweep_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report(sweep_dir)
    out = capsys.readouterr().out
    assert "sweep: 4 jobs (1 ok, 1 skipped, 2 failed)" in out and "tp=3: must divide" in out
    with open(sweep_dir / "sweep_summary.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == list(COLUMNS)
    assert (rows[0]["overrides"], rows[0]["peak_memory_mib_per_rank"]) == ("devices=2 tp=1", "1;2")
    assert [r["status"] for r in rows] == ["ok", "skipped", "failed", "failed"]
    data = json.loads((sweep_dir / "sweep_summary.json").read_text())
    assert data[0]["overrides"] == ["devices=2", "tp=1"] and data[0]["peak_memory_mib_per_rank"] == [1.0, 2.0]
    assert data[1]["final_loss"] is None and data[1]["reason"] == "tp=3: must divide"
    assert (sweep_dir / "sweep_summary.png").read_bytes()[:8] == PNG_MAGIC


def test_without_matplotlib_the_png_is_skipped_with_one_line(
    sweep_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("matplotlib.backends.backend_agg", "matplotlib.figure"):
        monkeypatch.setitem(sys.modules, name, None)  # `import` of it raises ImportError
    written = report(sweep_dir)
    assert written and not (sweep_dir / "sweep_summary.png").exists()
    assert (sweep_dir / "sweep_summary.csv").is_file()
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "fsdp-train: note: sweep_summary.png not written: matplotlib is not installed "
        '(pip install "matplotlib>=3.7" (or pip install ".[plot]" in a checkout of fsdp_cli))'
    ]
    assert sweep_plot.write_png(collect(sweep_dir), sweep_dir / "x.png") is None


def test_the_exit_status_is_1_only_when_a_job_failed(sweep_dir: Path) -> None:
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep_dir)}}})

    def sweep_ends() -> int:
        callback = sweep.SweepReport()
        callback.on_multirun_start(config)
        callback._started = None  # the fixture's jobs were written before this "sweep" started
        callback.on_multirun_end(config)
        return sweep.exit_status()

    assert sweep_ends() == 1
    for job in ("2", "10"):  # the failed ones become skipped: nothing failed any more
        (sweep_dir / job / "summary.json").write_text(json.dumps({"status": "skipped", "reason": "x"}))
    assert sweep_ends() == 0


def test_a_sweep_in_which_no_job_ran_exits_2_and_says_so(
    sweep_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for job in ("0", "2", "10"):
        (sweep_dir / job / "summary.json").write_text(json.dumps({"status": "skipped", "reason": "x"}))
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep_dir)}}})
    callback = sweep.SweepReport()
    callback.on_multirun_start(config)
    callback._started = None  # the fixture's jobs were written before this "sweep" started
    callback.on_multirun_end(config)
    assert sweep.exit_status() == 2
    out, err = capsys.readouterr()
    assert "sweep: 4 jobs (0 ok, 4 skipped, 0 failed)" in out and "no job ran: every job was skipped" in out
    assert (
        err
        == "fsdp-train: error: no job of the sweep ran: all 4 were skipped; hint: the reason of each is in the table\n"
    )


def test_the_value_returned_to_the_sweeper(monkeypatch: pytest.MonkeyPatch) -> None:
    ok = {"status": "ok", "final_loss": 4.5, "tokens_per_s": 2000.0}
    assert sweep_job.objective_value(ok, "final_loss") == 4.5
    assert sweep_job.objective_value(ok, "tokens_per_s") == 2000.0
    # Anything without a finite value is the worst one for the direction: never NaN or None.
    assert sweep_job.objective_value({**ok, "status": "failed"}, "final_loss") == math.inf
    assert sweep_job.objective_value({**ok, "final_loss": math.nan}, "final_loss") == math.inf
    assert sweep_job.objective_value(None, "final_loss") == math.inf
    maximize = OmegaConf.create({"sweeper": {"direction": "maximize"}})
    monkeypatch.setattr(HydraConfig, "get", staticmethod(lambda: maximize))
    assert sweep_job.objective_value(None, "tokens_per_s") == -math.inf
    assert [sweep_job.direction_name(d) for d in ("minimize", "MAXIMIZE", "Direction.maximize", None)] == [
        "minimize",
        "maximize",
        "maximize",
        "minimize",
    ]


@pytest.fixture(autouse=True)
def no_hydra_job_left() -> Any:
    yield
    HydraConfig.instance().cfg = None  # type: ignore[assignment]


def composed_job(tmp_path: Path, *overrides: str) -> Any:
    """The job config Hydra would hand the task function, with HydraConfig set to that job's."""
    register_schemas()
    with initialize_config_module(config_module="fsdp_cli.configs", version_base="1.3"):
        cfg = compose(config_name="train", overrides=list(overrides), return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(tmp_path / "job")
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


def fits_in_memory(run: Any) -> None:
    cfg = run.cfg  # (a pre-launch check takes the resolved run)
    if cfg.model.dim > 64:
        raise ConfigError("model.dim", cfg.model.dim, "does not fit in memory", hint="use a smaller model")


def test_a_pre_launch_check_stops_a_single_run_and_skips_a_sweep_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(resolve, "PRE_LAUNCH_CHECKS", (fits_in_memory,))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    cfg = composed_job(tmp_path, "accelerator=cpu")
    # The single-run path (fsdp-train prints this line and exits 2) ...
    with pytest.raises(ConfigError, match="model.dim=128: does not fit in memory"):
        resolve.resolve_config(cfg, tmp_path, os.environ, notify=print)
    # ... and a sweep's check of the same job give the same verdict.
    assert sweep_job.check_job(cfg) == "model.dim=128: does not fit in memory; hint: use a smaller model"
    assert (
        sweep_job.check_job(composed_job(tmp_path, "accelerator=cpu", "model.dim=64", "model.n_heads=2"))
        is None
    )
    # A skipped job records why, and what its layout would have been.
    assert sweep_job.skip_job("model.dim=128: does not fit in memory", cfg) == math.inf
    summary = json.loads((tmp_path / "job" / "summary.json").read_text())
    assert (summary["status"], summary["reason"], summary["dp"], summary["world_size"]) == (
        "skipped",
        "model.dim=128: does not fit in memory",
        2,
        2,
    )


# --------------------------------------------------------------------------- tables at 80 columns

LONG_REASON = "tp=3: must divide the world size 2; hint: choose tp from 1, 2 (or set devices=3)"


def _rendered(print_it: Any, width: int) -> str:
    console = Console(file=io.StringIO(), width=width, color_system=None)
    print_it(console)
    return console.file.getvalue()


def _whole(word: str, out: str) -> bool:
    return re.search(rf"(?<!\S){re.escape(word)}(?!\S)", out) is not None


@pytest.mark.parametrize("width", [80, 100, 140])
def test_the_sweep_table_fits_the_terminal_and_cuts_nothing(sweep_dir: Path, width: int) -> None:
    """Every value whole (a number, an override, each word of a reason), every column's header,
    nothing wider than the terminal, a skipped job one row that starts its reason."""
    make_job(sweep_dir, 3, ["model.n_layers=2", "precision=bf16-mixed"], None, [])
    (sweep_dir / "1" / "summary.json").write_text(json.dumps({"status": "skipped", "reason": LONG_REASON}))
    ok = json.loads((sweep_dir / "0" / "summary.json").read_text())
    ok |= {"tokens_per_s": 123456.7, "final_loss": 3.812345, "peak_memory_bytes": [1234 * 2**20]}
    (sweep_dir / "0" / "summary.json").write_text(json.dumps(ok))
    jobs = collect(sweep_dir)
    out = _rendered(lambda console: print_table(jobs, sweep_dir, console), width)
    best = max(j.tokens_per_s for j in jobs if j.tokens_per_s)
    for job in jobs:
        for cell in summary_module._cells(job, best):
            assert all(_whole(word, out) for word in cell.split()), (cell, out)
    assert all(_whole(word, out) for header in summary_module.HEADERS for word in header.split()), out
    assert all(len(line.rstrip()) <= width for line in out.splitlines()[1:]), out
    skipped = next(line for line in out.splitlines() if _whole("skipped", line))
    assert re.match(rf"\s*(job )?1\s+{jobs[1].label.split()[0]}\s", skipped) and "tp=3: must" in skipped, out
    assert "3.8123" in out and "123,457" in out and "1,234 MiB" in out


SUMMARY = {
    "status": "ok",
    "strategy": "fsdp2",
    "dp": 2,
    "tp": 1,
    "world_size": 2,
    "precision": "bf16-mixed",
    "model": "llama",
    "parameters": 124_439_808,
    "steps": 30,
    "final_loss": 3.812345,
    "tokens_per_s": 123456.7,
    "step_time_s": 0.1234,
    "peak_memory_bytes": [2**31, 2**30],
    "checkpoint": "/work/runs/outputs/2026-11-27/14-05-33-llama_124m_fsdp2/checkpoints/step=000030.ckpt",
    "error": "RuntimeError: a long error that must wrap between words and never be cut in the middle",
}


@pytest.mark.parametrize("width", [80, 100, 140])
def test_the_run_summary_fits_the_terminal_and_the_checkpoint_path_is_whole(width: int) -> None:
    run_dir = Path("/work/runs/outputs/2026-11-27/14-05-33")
    out = _rendered(lambda console: print_summary(SUMMARY, run_dir, console), width)
    for name, value in table_module._rows(SUMMARY, run_dir):
        assert all(_whole(word, out) for word in str(value).split()), (name, value, out)
    assert all(len(line) <= width for line in out.splitlines() if SUMMARY["checkpoint"] not in line), out
    assert _whole(SUMMARY["checkpoint"], out), (
        "the path, whole, to copy (below the table where it is too wide)"
    )


def test_an_optuna_sweep_logs_without_colour_codes_where_stderr_is_not_a_terminal(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Optuna's handler colours with colorlog whatever its stream: during a sweep whose stderr is
    a file or a pipe (here: captured), its lines come out plain; the setting ends with the sweep."""
    optuna_logging = pytest.importorskip("optuna.logging")
    import logging

    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    record = logging.LogRecord("optuna", logging.INFO, __file__, 1, "Trial 0 finished", None, None)
    formatter = optuna_logging.create_default_formatter()
    assert "\x1b[" in formatter.format(record), "colorlog colours it otherwise"
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}})
    callback = sweep.SweepReport()
    callback.on_multirun_start(config)
    assert "\x1b[" not in formatter.format(record) and "Trial 0 finished" in formatter.format(record)
    callback.on_multirun_end(config)
    assert "NO_COLOR" not in os.environ


def test_a_sweep_over_pp_and_schedules_shows_pp_and_why_a_layout_was_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pp is a layout column like dp and tp: in summary.json (a skipped job's too), the CSV and
    the table (shown once a job of the sweep pipelines); pp=3 on 4 processes is skipped with the
    layout's own one line."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    cfg = composed_job(tmp_path, "accelerator=cpu", "devices=4", "pp=3", "pipeline.schedule=GPipe")
    reason = sweep_job.check_job(cfg)
    assert reason is not None and reason.startswith("pp=3: must divide the world size 4"), reason
    sweep_job.skip_job(reason, cfg)
    skipped = json.loads((tmp_path / "job" / "summary.json").read_text())
    assert (skipped["status"], skipped["pp"]) == ("skipped", 3)
    d = tmp_path / "sweep"
    ok = {
        "status": "ok",
        "tp": 1,
        "strategy": "fsdp2",
        "precision": "32-true",
        "steps": 3,
        "tokens_per_s": 9.0,
    }
    make_job(d, 0, ["pp=1", "pipeline.schedule=1F1B"], {**ok, "pp": 1, "dp": 4}, [5.0, 4.5])
    make_job(d, 1, ["pp=2", "pipeline.schedule=GPipe"], {**ok, "pp": 2, "dp": 2}, [5.0, 4.5])
    make_job(d, 2, ["pp=3", "pipeline.schedule=GPipe"], skipped, [])
    jobs = collect(d)
    assert [(j.pp, j.dp, j.status) for j in jobs] == [(1, 4, "ok"), (2, 2, "ok"), (3, None, "skipped")]
    assert [row["pp"] for row in (j.row() for j in jobs)] == [1, 2, 3] and "pp" in COLUMNS
    out = _rendered(lambda console: print_table(jobs, d, console), 140)
    header = next(line for line in out.splitlines() if " overrides " in f" {line} ")
    assert re.search(r"\bpp\s+dp\s+tp\b", header), out
    assert all(_whole(word, out) for word in reason.split()), out  # the reason, wrapped between words
    plain = _rendered(lambda console: print_table(jobs[:1], d, console), 140)
    assert not re.search(r"\bpp\s+dp\b", plain), "no pp column for a sweep that does not pipeline"
