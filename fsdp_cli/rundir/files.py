"""Every file and folder a run writes, by name, in one place; how a file is replaced without a
moment of half-written content, and whether a folder can be written at all (checked before launch)."""

from __future__ import annotations

import os
from pathlib import Path

from fsdp_cli.errors import ConfigError

CONFIG_FILE = "config.yaml"
"""The fully resolved config every rank reads."""
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
DATA_STATISTICS_FILE = "data_statistics.json"
"""``data=chat``: examples, sequences, supervised fraction, truncated and dropped examples."""
CHECKPOINT_DIR = "checkpoints"
"""Default home of checkpoints (``checkpoint.dir`` moves it)."""
LOG_DIR = "logs"
"""Console output of ranks other than 0, and the launcher's failure report."""
LAUNCHER_LOG = "launcher.log"
PROFILER_DIR = "profiler"
"""``trainer.profiler`` output: traces (``*.pt.trace.json``) and hook timings."""

HEARTBEAT_DIR = ".heartbeat"
"""One liveness file per rank (pid, last step, phase), read by the launcher's hang watchdog."""
FAILURE_FILE = "failure.json"
"""Which rank failed first and how (or which ranks hung), written by the launcher side and merged
into ``summary.json`` by the parent."""


def log_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / LOG_DIR


def rank_log(run_dir: str | Path, rank: int) -> Path:
    return log_dir(run_dir) / f"rank{rank}.log"


def profiler_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / PROFILER_DIR


def heartbeat_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / HEARTBEAT_DIR


def write_atomically(path: Path, text: str) -> None:
    """``path`` holds ``text`` or what it held before, never part of either: written to a temporary
    name of this process (``<name>.<pid>.partial``), flushed to disk, renamed over ``path``, the
    folder flushed too. The temporary file is removed if anything fails, an interrupt included."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.partial")
    try:
        with open(tmp, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def folder_problem(path: Path) -> str | None:
    """Why a folder at ``path`` could not be created or written (a file there or above it, no
    write permission where it would be created); None when it can. Creates nothing."""
    target = probe = Path(os.path.abspath(path))
    while not probe.exists() and probe.parent != probe:  # (exists() is False under a file too)
        probe = probe.parent  # the folder it would be created in
    where = "" if probe == target else f"{probe} "
    if not probe.is_dir():
        return f"{where}is a file" + (", not a folder" if probe == target else "")
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{where}is not writable"
    return None


def check_writable_folder(key: str, path: Path, hint: str) -> None:
    """A :class:`ConfigError` on ``key`` when nothing can be written at ``path`` (see
    :func:`folder_problem`): found before launch, not at the run's first save."""
    problem = folder_problem(path)
    if problem is not None:
        raise ConfigError(key, str(path), f"nothing can be written there: {problem}", hint=hint)


HYDRA_FILES = frozenset({".hydra", "train.log"})
"""What Hydra writes in a run directory before fsdp-train's own code runs."""


def remove_if_unused(run_dir: Path, top: Path) -> bool:
    """Remove a run directory that holds nothing but Hydra's files (a config error, a
    ``--dry-run``: no run happened there), and the folders above it that this leaves empty, up
    to ``top`` (the working directory: Hydra's ``outputs/DATE/TIME``). A folder with anything
    else in it (a run resumed there, a user's file) is left as it is. True when removed."""
    import shutil

    run_dir = Path(run_dir).resolve()
    try:
        if not run_dir.is_dir() or not {p.name for p in run_dir.iterdir()} <= HYDRA_FILES:
            return False
        shutil.rmtree(run_dir)
    except OSError:
        return False
    top = Path(top).resolve()
    for parent in run_dir.parents:
        if parent == top or top not in parent.parents:
            break
        try:
            parent.rmdir()  # only when empty
        except OSError:
            break
    return True
