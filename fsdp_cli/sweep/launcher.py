"""The default ``hydra/launcher`` of ``fsdp-train``: Hydra's basic launcher (jobs one after the
other, in this process), plus a pre-pass that composes and checks every job of a batch before the
first one starts.

The Hydra plugin itself is the thin subclass in ``hydra_plugins/fsdp_cli_sweep`` (Hydra only
instantiates launchers whose module is under ``hydra_plugins``); the work is done here.

A job whose combination cannot run is not dropped: it keeps its job number, its folder and its
``.hydra/`` files, and Hydra's ``run_job`` runs :func:`fsdp_cli.sweep.job.skip_job` in place
of the task function, which writes a ``summary.json`` saying ``skipped`` and why. Its return
value is the worst objective, so the basic sweeper goes on and Optuna keeps a value for the trial.

Imported by every Hydra application's plugin scan: nothing beyond Hydra and OmegaConf at import.
"""

from __future__ import annotations

import copy
import functools
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, configure_log, env_override, filter_overrides, run_job, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

log = logging.getLogger(__name__)

LAUNCHER_NAME = "fsdp_cli"
"""``hydra/launcher=fsdp_cli``: the option train.yaml selects."""

Check = Callable[[DictConfig], "str | None"]


def register_launcher_config(target: str) -> None:
    """Make ``hydra/launcher=fsdp_cli`` an option whose ``_target_`` is the plugin class."""
    ConfigStore.instance().store(
        group="hydra/launcher", name=LAUNCHER_NAME, node={"_target_": target}, provider="fsdp_cli"
    )


class SweepLauncherBase(Launcher):
    def __init__(self) -> None:
        super().__init__()
        self.config: DictConfig | None = None
        self.task_function: TaskFunction | None = None
        self.hydra_context: HydraContext | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config = config
        self.hydra_context = hydra_context
        self.task_function = task_function

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from fsdp_cli.sweep.job import check_job, skip_job

        assert self.config is not None and self.hydra_context is not None and self.task_function is not None
        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        Path(str(self.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
        jobs = [self._compose(overrides, initial_job_idx + i) for i, overrides in enumerate(job_overrides)]
        verdicts = [_check(job_cfg, check_job) for job_cfg in jobs]
        _log_plan(job_overrides, initial_job_idx, verdicts)
        runs = []
        for job_cfg, reason in zip(jobs, verdicts):
            task = self.task_function if reason is None else functools.partial(skip_job, reason)
            runs.append(
                run_job(
                    hydra_context=self.hydra_context,
                    task_function=task,
                    config=job_cfg,
                    job_dir_key="hydra.sweep.dir",
                    job_subdir_key="hydra.sweep.subdir",
                )
            )
            configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        return runs

    def _compose(self, overrides: Sequence[str], idx: int) -> DictConfig:
        """The job's config as Hydra's basic launcher composes it (a malformed override still
        stops the sweep here, before any job ran)."""
        assert self.config is not None and self.hydra_context is not None
        job_cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        with open_dict(job_cfg):
            job_cfg.hydra.job.id = idx
            job_cfg.hydra.job.num = idx
        return job_cfg


def _check(job_cfg: DictConfig, check: Check) -> str | None:
    """``check(task config)`` with Hydra's state as ``run_job`` will set it for this job:
    HydraConfig (so ``${hydra:...}`` resolves to the job's values), its output directory and
    ``hydra.job.env_set``."""
    hydra_config = HydraConfig.instance()
    saved = hydra_config.cfg
    try:
        out = os.path.join(
            str(OmegaConf.select(job_cfg, "hydra.sweep.dir")),
            str(OmegaConf.select(job_cfg, "hydra.sweep.subdir")),
        )
        with read_write(job_cfg.hydra.runtime), open_dict(job_cfg.hydra.runtime):
            job_cfg.hydra.runtime.output_dir = os.path.abspath(out)
        hydra_config.set_config(job_cfg)
        task_cfg = copy.deepcopy(job_cfg)
        with read_write(task_cfg), open_dict(task_cfg):
            del task_cfg["hydra"]
        with env_override(dict(job_cfg.hydra.job.env_set)):
            return check(task_cfg)
    except Exception as err:  # noqa: BLE001 - a bug, not a verdict: the job runs and its guard records what happens
        log.warning(
            f"could not check job {job_cfg.hydra.job.num} before launching: {type(err).__name__}: {err}"
        )
        return None
    finally:
        hydra_config.cfg = saved  # type: ignore[assignment]


def _log_plan(job_overrides: Sequence[Sequence[str]], first: int, verdicts: Sequence[Any]) -> None:
    skipped = sum(reason is not None for reason in verdicts)
    log.info(
        f"Launching {len(verdicts) - skipped} jobs locally ({skipped} of {len(verdicts)} skipped as invalid)"
    )
    for i, (overrides, reason) in enumerate(zip(job_overrides, verdicts)):
        line = f"\t#{first + i} : {' '.join(filter_overrides(overrides))}"
        log.info(line if reason is None else f"{line}  -> skipped: {reason}")
