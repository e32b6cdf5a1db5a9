"""Shared helpers: run ``fsdp-train`` as a user would, and read what a run leaves behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
ASSETS = Path(__file__).resolve().parent / "assets"
SEAMS = Path(__file__).resolve().parent / "seams"
# `tests.assets.*` models are named by dotted path, as a user names theirs. Appended, not
# prepended: fsdp_cli itself must come from the installed package (whose configs ship inside it).
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))

# Small and quick, but every layout below still has something to shard and split.
FAST = ["trainer.max_steps=6", "data.global_batch_size=8", "data.seq_len=32"]


def entry_point(name: str) -> list[str]:
    """The installed console script (as a user runs it), or its module when run from a checkout."""
    script = Path(sys.executable).parent / name
    if script.is_file():
        return [str(script)]
    module = {
        "fsdp-train": "fsdp_cli.cli.main",
        "fsdp-ckpt": "fsdp_cli.cli.ckpt",
        "fsdp-plan": "fsdp_cli.cli.plan",
    }[name]
    return [sys.executable, "-m", module]


def run_cli(
    args: list[str],
    run_dir: Path | None = None,
    *,
    env: dict[str, str] | None = None,
    timeout: float = 300,
    cwd: Path | None = None,
    prog: str = "fsdp-train",
) -> subprocess.CompletedProcess[str]:
    """``fsdp-train ARGS hydra.run.dir=RUN_DIR`` in a subprocess, exactly as a user types it.

    On a timeout (or any interruption) everything it started is killed, ranks included."""
    proc = start_cli(args, run_dir, env=env, cwd=cwd, prog=prog)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        kill_job(proc, run_dir)
        raise
    _check_marked_distributed(run_dir)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


_STARTED: list[tuple[subprocess.Popen[str], Path | None]] = []


def start_cli(
    args: list[str],
    run_dir: Path | None = None,
    *,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    prog: str = "fsdp-train",
) -> subprocess.Popen[str]:
    """Start ``fsdp-train`` (or ``fsdp-ckpt``) in a session of its own; killed with everything it
    started when the test ends, whatever happens (see :func:`kill_job`)."""
    cmd = [*entry_point(prog), *args]
    if run_dir is not None:
        cmd.append(f"hydra.run.dir={run_dir}")
    full_env = {**os.environ, **(env or {})}
    full_env.pop("HYDRA_FULL_ERROR", None)
    if any(key.startswith("FSDP_CLI_TEST_") for key in env or {}):
        # The fault-injection seam (tests/seams/sitecustomize.py) acts on these variables.
        full_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SEAMS), full_env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=full_env,
        cwd=cwd or REPO,
        start_new_session=True,
    )
    _STARTED.append((proc, run_dir))
    return proc


def kill_job(proc: subprocess.Popen[str], run_dir: Path | None) -> None:
    """SIGKILL the command and everything it started: its process group (the CLI and torch's
    agent) while it runs, and every process whose command line names the run directory (torch
    starts ranks in sessions of their own; their data-loader workers are forks of them)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if run_dir is not None:
        for pid in processes_naming(str(run_dir)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    proc.wait()


def processes_naming(text: str) -> list[int]:
    """Live processes whose command line contains ``text`` (never a recycled pid of someone else's)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            continue
        if text in cmdline and state != "Z":
            found.append(int(entry.name))
    return found


@pytest.fixture(autouse=True)
def _kill_what_the_test_started(request: pytest.FixtureRequest) -> Any:
    global _CURRENT_TEST
    _CURRENT_TEST = request.node
    first = len(_STARTED)
    yield
    for proc, run_dir in _STARTED[first:]:
        kill_job(proc, run_dir)
    del _STARTED[first:]


_CURRENT_TEST: Any = None


def _check_marked_distributed(run_dir: Path | None) -> None:
    """A test that starts ranks (they leave heartbeat files) must be marked distributed."""
    if run_dir is None or _CURRENT_TEST is None or _CURRENT_TEST.get_closest_marker("distributed"):
        return
    if (run_dir / ".heartbeat").exists():
        pytest.fail(f"{_CURRENT_TEST.nodeid} started ranks but is not marked distributed")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that use the shared runs start ranks (or reuse runs another test started)."""
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


def wait_for(predicate: Callable[[], Any], proc: subprocess.Popen[str], timeout: float = 120) -> Any:
    """Poll ``predicate`` until it returns something truthy (returned); fail if ``proc`` ends first."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if proc.poll() is not None:
            raise AssertionError(f"run ended early ({proc.returncode}): {proc.stderr.read()[-3000:]}")
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


def assert_ok(result: subprocess.CompletedProcess[str], run_dir: Path) -> dict[str, Any]:
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
    "ddp": ["strategy=ddp", "devices=2"],
    "fsdp2": ["strategy=fsdp2", "devices=2"],
    "fsdp2_tp2": ["strategy=fsdp2", "devices=2", "tp=2"],
    "fsdp": ["strategy=fsdp", "devices=2", "checkpoint=full"],
}


@pytest.fixture(scope="session")
def layout_run(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``layout_run(name)`` -> the run directory of ``LAYOUTS[name]`` with ``PARITY`` settings."""
    root = tmp_path_factory.mktemp("layouts")
    done: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in done:
            run_dir = root / name
            assert_ok(run_cli([*LAYOUTS[name], *PARITY], run_dir), run_dir)
            done[name] = run_dir
        return done[name]

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


def gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001
        return 0


requires_gpu = pytest.mark.skipif(gpu_count() == 0, reason="needs a CUDA GPU; none on this machine")
