"""``logger=mlflow`` and ``logger=wandb``: Lightning's MLFlowLogger and WandbLogger, set up for a run.

Both receive what ``metrics.jsonl`` holds, step by step (the metrics callback sends each row's
numbers), and whatever the module logs with ``self.log``. They write on rank 0 only, as every
Lightning logger does. Their packages are optional extras (``pip install ".[mlflow]"``,
``".[wandb]"``); the parent refused the option before launch when one is missing.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import Logger, MLFlowLogger, WandbLogger

from fsdp_cli.config.schema import LoggerConfig, LoggerName

MLFLOW_DB = "mlflow.db"
"""The default MLflow store in the run directory (MLflow 3 refuses its old ``file:`` store by default)."""


def build_experiment_logger(config: LoggerConfig, run_dir: Path) -> Logger:
    run_name = config.run_name or Path(run_dir).resolve().name
    if config.name is LoggerName.mlflow:
        uri = mlflow_tracking_uri(config, run_dir)
        # Every rank builds the logger, and MLflow's client opens its store when it is made: a
        # new SQLite store is created and migrated by whichever rank gets there first, and two
        # at once collide ("duplicate column"). One at a time, the others find it ready.
        with _one_rank_at_a_time(uri):
            return MLFlowLogger(experiment_name=config.project, run_name=run_name, tracking_uri=uri)
    return FinishingWandbLogger(
        project=config.project,
        name=run_name,
        save_dir=str(run_dir),
        offline=wandb_offline(config),
    )


def mlflow_tracking_uri(config: LoggerConfig, run_dir: Path) -> str:
    """``logger.tracking_uri``, else ``$MLFLOW_TRACKING_URI`` (Lightning's default), else a SQLite
    store in the run directory."""
    return (
        config.tracking_uri
        or os.environ.get("MLFLOW_TRACKING_URI")
        or f"sqlite:///{Path(run_dir).resolve() / MLFLOW_DB}"
    )


@contextlib.contextmanager
def _one_rank_at_a_time(uri: str) -> Iterator[None]:
    """An exclusive lock beside a local SQLite store (nothing for other stores)."""
    if not uri.startswith("sqlite:///"):
        yield
        return
    lock = Path(uri.removeprefix("sqlite:///").split("?")[0] + ".lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def wandb_offline(config: LoggerConfig) -> bool:
    """``logger.offline``; null = offline unless an API key is in the environment."""
    return config.offline if config.offline is not None else not os.environ.get("WANDB_API_KEY")


class FinishingWandbLogger(WandbLogger):
    """Lightning's WandbLogger, which also finishes the W&B run when training ends.

    W&B finishes a run (flushes its history into the run files, ends its service process) from an
    ``atexit`` hook; fsdp-train's ranks leave through ``os._exit`` once everything of theirs is
    written, which skips it and would leave the run's file empty. So the run is finished here,
    after Lightning's own finalize, with the outcome as its exit code.
    """

    _finished = False

    def finalize(self, status: str) -> None:
        super().finalize(status)
        experiment: Any = self._experiment  # None on ranks other than 0, and before the first log
        if experiment is not None and not self._finished:
            experiment.finish(exit_code=0 if status == "success" else 1)
            self._finished = True
