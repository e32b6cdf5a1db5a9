"""Shared helpers: run ``fsdp-train`` as a user would, and read what a run leaves behind."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from harness import ENTRY_MODULES, REPO, Job, Result, entry_point

ASSETS = Path(__file__).resolve().parent / "assets"
# `tests.assets.*` models are named by dotted path, as a user names theirs. Appended, not
# prepended: fsdp_cli itself must come from the installed package (whose configs ship inside it).
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))

# Small and quick, but every layout below still has something to shard and split.
FAST = ["trainer.max_steps=6", "data.global_batch_size=8", "data.seq_len=32"]


# Jobs start with this process's SIGINT disposition. Started in the background by a shell without
# job control (`cmd &` in a script), it is "ignore", which every job would inherit, and the Ctrl-C
# tests would send a SIGINT nothing acts on. A terminal's Ctrl-C reaches programs that handle it.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


_JOBS: list[Job] = []
"""Jobs started by the running test: all of them killed when it ends, whatever happens."""


def start(
    cmd: list[str],
    *,
    run_dir: Path | None = None,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    merge_output: bool = False,
) -> Job:
    """Start any command as a job of the running test (see :mod:`harness`)."""
    job = Job(cmd, run_dir=run_dir, env=env, cwd=cwd, merge_output=merge_output)
    _JOBS.append(job)
    return job


def run(cmd: list[str], *, timeout: float, **kwargs: Any) -> Result:
    """Run any command to its end; on a timeout everything it started is killed."""
    return start(cmd, **kwargs).result(timeout)


def start_cli(
    args: list[str],
    run_dir: Path | None = None,
    *,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    prog: str = "fsdp-train",
    merge_output: bool = False,
) -> Job:
    """``fsdp-train ARGS hydra.run.dir=RUN_DIR`` (or another of our commands), as a user types it."""
    cmd = [*entry_point(prog), *args]
    if run_dir is not None:
        cmd.append(f"hydra.run.dir={run_dir}")
    return start(cmd, run_dir=run_dir, env=env, cwd=cwd, merge_output=merge_output)


def run_cli(args: list[str], run_dir: Path | None = None, *, timeout: float = 300, **kwargs: Any) -> Result:
    """``fsdp-train ARGS hydra.run.dir=RUN_DIR`` to its end (see :func:`start_cli`)."""
    return start_cli(args, run_dir, **kwargs).result(timeout)


def cli_in_process(
    args: list[str],
    run_dir: Path | None = None,
    *,
    prog: str = "fsdp-train",
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> Result:
    """``PROG ARGS`` through its console script's function, in this process: for what starts no
    rank (config errors, ``--cfg``, ``--help``, fsdp-plan, fsdp-recipe), as the fast tier starts no
    process. Its exit status and output are what the command would give; what it changes in this
    process (sys.argv and sys.path, the environment and working directory, Hydra's globals and
    patches, the logging handlers Hydra installs) is put back."""
    import contextlib
    import importlib
    import io
    import logging

    from hydra._internal import hydra as hydra_internal
    from hydra._internal import utils as hydra_utils
    from hydra.core.global_hydra import GlobalHydra

    argv = [prog, *args, *([f"hydra.run.dir={run_dir}"] if run_dir is not None else [])]
    entry = importlib.import_module(ENTRY_MODULES[prog]).main
    out, err = io.StringIO(), io.StringIO()
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    code = 0
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", argv)
        patch.setattr(sys, "path", sys.path[:])
        patch.setattr(hydra_utils, "run_and_report", hydra_utils.run_and_report)
        patch.setattr(hydra_internal.Hydra, "get_mode", hydra_internal.Hydra.get_mode)
        patch.setattr(hydra_internal.Hydra, "get_sanitized_cfg", hydra_internal.Hydra.get_sanitized_cfg)
        patch.delenv("HYDRA_FULL_ERROR", raising=False)
        for key, value in (env or {}).items():
            patch.setenv(key, value)
        patch.chdir(cwd or REPO)
        GlobalHydra.instance().clear()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                entry()
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
        finally:
            GlobalHydra.instance().clear()
            for handler in root.handlers:
                if handler not in handlers:
                    handler.close()
            root.handlers[:], root.level = handlers, level
    return Result(argv, code, out.getvalue(), err.getvalue())


@pytest.fixture(autouse=True)
def _processes_of_the_test(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A test not marked distributed starts no process (whichever way it tries); every job a test
    started is killed, with everything it started, when the test ends."""
    if request.node.get_closest_marker("distributed") is None:
        _refuse_processes(request.node.nodeid, monkeypatch)
    yield
    end_jobs()


def end_jobs() -> None:
    """Kill every job the running test started, with everything each started (what happens when
    a test ends, whatever happened in it)."""
    jobs, _JOBS[:] = _JOBS[:], []
    for job in jobs:
        job.close()


def _refuse_processes(nodeid: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import _posixsubprocess

    def refuse(*args: Any, **kwargs: Any) -> Any:
        pytest.fail(f"{nodeid} starts a process but is not marked distributed", pytrace=False)

    monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse)
    monkeypatch.setattr(_posixsubprocess, "fork_exec", refuse)
    for name in ("fork", "forkpty", "system", "posix_spawn", "posix_spawnp"):
        monkeypatch.setattr(os, name, refuse)


# The suite runs in pytest-xdist workers (pyproject's addopts: `-n auto --dist loadfile`), each
# taking a whole file at a time, in the order collected. A run's start is mostly one process
# importing torch and Lightning, single-threaded, so with one worker per core both cores stay busy.
# The files that take longest go first, so that the last ones to finish are short: measured
# worker time on 2 cores, 2 workers (s, 2026-12-06): checkpoints 329, pipeline 322, lora 282,
# docs 198, composition 174, precision 151, faults 143, callbacks 132, lightning_conformance 130,
# fsdp1 112, own_loaders 110, loader_workers 107, fsdp2 95, rehearsal 87, sweeps 75, clusters 74.
LONGEST_FIRST = (
    "test_checkpoints.py",
    "test_pipeline.py",
    "test_lora.py",
    "test_docs.py",
    "test_composition.py",
    "test_expert_parallel.py",
    "test_precision.py",
    "test_faults.py",
    "test_callbacks_loggers_epochs.py",
    "test_lightning_conformance.py",
    "test_context_parallel.py",
    "test_fsdp1.py",
    "test_own_loaders.py",
    "test_loader_workers.py",
    "test_fsdp2.py",
    "test_rehearsal.py",
    "test_sweeps.py",
    "test_clusters.py",
)
MAX_WORKERS = 4
"""``-n auto`` starts one worker per core, at most this many: each worker's runs start 2-4 rank
processes of their own (a few GiB of memory)."""


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(cores or 1, MAX_WORKERS))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files in :data:`LONGEST_FIRST` order first, the others after in their own order. Tests
    that use the shared runs start ranks (or reuse runs another test started)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
    shared = {"layout_run", "reference_losses"}
    unmarked = [
        item.nodeid
        for item in items
        if shared & set(getattr(item, "fixturenames", ())) and not item.get_closest_marker("distributed")
    ]
    if unmarked:
        raise pytest.UsageError(
            "tests using the shared runs must be marked distributed: " + ", ".join(unmarked)
        )


def wait_for(predicate: Callable[[], Any], proc: Job, timeout: float = 120) -> Any:
    """Poll ``predicate`` until it returns something truthy (returned); fail if ``proc`` ends first."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if proc.poll() is not None:
            raise AssertionError(f"run ended early ({proc.returncode}): {''.join(proc.output())[-3000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s")
        time.sleep(0.1)


def complete_lines(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of a file being written: only complete, parseable lines count."""
    try:
        text = path.read_text()
    except OSError:
        return []
    rows = []
    for line in text.split("\n")[:-1]:  # the last piece is unfinished (or empty)
        try:
            rows.append(json.loads(line))
        except ValueError:
            break
    return rows


def read_pid(path: Path) -> int | None:
    """A pid marker file, once it is completely written (else None)."""
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return None


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def read_summary(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "summary.json").read_text())


def losses(run_dir: Path) -> list[float]:
    return [row["loss"] for row in read_metrics(run_dir)]


def grad_norms(run_dir: Path) -> list[float]:
    """Each logged step's gradient norm (logged where gradient clipping is on: a run that only
    wants the norms sets ``trainer.gradient_clip_val`` high)."""
    return [row["grad_norm"] for row in read_metrics(run_dir)]


def relative_gap(a: list[float], b: list[float]) -> float:
    """The largest per-step relative difference of ``a`` from ``b`` (the same number of steps, at least 2)."""
    assert len(a) == len(b) >= 2, (a, b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def assert_ok(result: Result, run_dir: Path) -> dict[str, Any]:
    """The run exited 0 and its summary says ok; returns the summary."""
    tail = result.stdout[-3000:] + "\n" + result.stderr[-3000:]
    assert result.returncode == 0, f"exit {result.returncode}\n{tail}"
    summary = read_summary(run_dir)
    assert summary["status"] == "ok", summary
    return summary


def composed(*overrides: str) -> Any:
    """The typed config ``fsdp-train OVERRIDES`` would run (before layout resolution)."""
    from hydra import compose, initialize_config_module

    from fsdp_cli.config.convert import to_train_config
    from fsdp_cli.config.store import register_schemas

    register_schemas()
    with initialize_config_module(config_module="fsdp_cli.configs", version_base="1.3"):
        cfg = compose(config_name="train", overrides=list(overrides))
    return to_train_config(cfg)


def run_of(cfg: Any, gpus: int = 0) -> Any:
    """The resolved run (:class:`~fsdp_cli.config.resolved.ResolvedRun`) of a composed config, its
    layout resolved for a machine with ``gpus`` GPUs (none: CPU processes)."""
    from fsdp_cli.config.resolved import ResolvedRun
    from fsdp_cli.launch.layout import resolve_layout

    return ResolvedRun.of(resolve_layout(cfg, {}, gpus=gpus))


# The fp32 settings every loss-parity comparison uses; the single-process run is the reference.
# Each run also leaves checkpoints at steps 3 and 6, which the checkpoint tests resume from.
PARITY = [*FAST, "precision=32-true", "accelerator=cpu", "seed=11", "checkpoint.every_n_steps=3"]
SINGLE_PROCESS = ["strategy=ddp", "devices=1"]
# Runs shared across test modules (started at most once per session, on first use).
LAYOUTS = {
    "single": SINGLE_PROCESS,
    # The one shared run whose ranks torch starts as new processes (every other is forked).
    "ddp": ["strategy=ddp", "devices=2", "launcher.start_method=subprocess"],
    "fsdp2": ["strategy=fsdp2", "devices=2"],
    # fsdp-train's own loader read through worker processes of the ranks (started by Python's
    # default method, not the forkserver the ranks came from), against the single run's losses.
    "fsdp2_tp2": ["strategy=fsdp2", "devices=2", "tp=2", "data.num_workers=2"],
    # The one shared run whose ranks are forked from the agent itself (the others: from its forkserver).
    "fsdp": ["strategy=fsdp", "devices=2", "checkpoint=full", "launcher.start_method=fork"],
}


@pytest.fixture(scope="session")
def layout_run(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``layout_run(name)`` -> the run directory of ``LAYOUTS[name]`` with ``PARITY`` settings,
    run once for the whole session: by the first pytest worker that needs it, while any other
    that needs it waits (a run that failed is tried again by the next)."""
    base = tmp_path_factory.getbasetemp()
    # Under pytest-xdist each worker has a base of its own, in one directory for the session.
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "layouts"
    root.mkdir(exist_ok=True)

    def get(name: str) -> Path:
        run_dir, done = root / name, root / f"{name}.done"
        with open(root / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not done.exists():
                shutil.rmtree(run_dir, ignore_errors=True)
                assert_ok(run_cli([*LAYOUTS[name], *PARITY], run_dir), run_dir)
                done.touch()
        return run_dir

    return get


@pytest.fixture(scope="session")
def reference_losses(layout_run: Any) -> list[float]:
    """Per-step losses of the single-process fp32 run that every layout must reproduce."""
    return losses(layout_run("single"))


def assert_same_losses(reference: list[float], run_dir: Path, tol: float = 1e-5, minimum: int = 5) -> None:
    other = losses(run_dir)
    assert len(other) == len(reference) >= minimum
    diffs = [abs(a - b) for a, b in zip(reference, other)]
    assert max(diffs) < tol, diffs


def gpu_count(env: dict[str, str] | None = None) -> int:
    """The CUDA devices torch can use here. 0 means "no CUDA device", and only that: the GPU tests
    then skip. A torch that does not import, or GPUs that NVML lists but torch cannot use (a
    broken CUDA install, a driver too old for this torch), fail the session loudly instead."""
    import torch

    from fsdp_cli.launch.environment import visible_gpu_count

    count = torch.cuda.device_count()
    listed = visible_gpu_count(os.environ if env is None else env)
    if count == 0 and listed > 0:
        raise RuntimeError(
            f"the driver lists {listed} GPU(s) but torch {torch.__version__} (CUDA {torch.version.cuda}) "
            "can use none: a broken CUDA install (or a CPU build of torch); CUDA_VISIBLE_DEVICES= runs "
            "the tests without GPUs"
        )
    return count


requires_gpu = pytest.mark.skipif(gpu_count() == 0, reason="needs a CUDA GPU; none on this machine")


@pytest.fixture
def gloo_rank(tmp_path: Path) -> Any:
    """A process group of one in-process rank on gloo (what fully_shard's mesh and the strategies'
    collectives need in a fast-tier test), destroyed afterwards."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def bare_trainer(root: Path, *, max_steps: int = 3, **options: Any) -> Any:
    """A plain Lightning Trainer on one CPU process (3 steps unless told), nothing written but what
    a test asks for: the reference a test compares fsdp-train with."""
    import lightning as L

    return L.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(root),
        **options,
    )


def torchrun_rows(script: Path, nproc: int, *args: str, timeout: float = 300) -> list[dict[str, Any]]:
    """``torchrun --nproc-per-node NPROC SCRIPT ARGS`` on CPU ranks to its end (exit 0 asserted):
    the JSON lines rank 0 printed (the float64 check drivers of context and expert parallel)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", str(script), *args]
    result = run(cmd, timeout=timeout, cwd=REPO, env={"CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 0, result
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
