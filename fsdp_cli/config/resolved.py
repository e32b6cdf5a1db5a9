"""A resolved run: the typed config and everything derived from it, computed once and frozen.

The parent builds it once, right after the layout is resolved (:mod:`fsdp_cli.resolve`), and
writes its config to ``config.yaml``; each rank reads that back and builds the same
:class:`ResolvedRun` with :meth:`ResolvedRun.of`. Every layer below (validation, the plan, the
rehearsal, the launcher, the worker, the builders) takes this object, never the raw config, and
reads the world size, the shard groups, the dtypes in effect and the checkpoint format only from
it (so they cannot disagree).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdp_cli.checkpoint_format import CheckpointFormat
from fsdp_cli.config.model_kinds import ModelKind, kind_of
from fsdp_cli.config.schema import TrainConfig
from fsdp_cli.config.strategies import StrategyEntry, entry_of, policy_dtypes
from fsdp_cli.parallel.dims import ParallelDims
from fsdp_cli.precision import ResolvedPrecision, resolve_precision


@dataclass(frozen=True)
class Layout:
    """Where the ranks are and how the mesh splits them (all concrete numbers)."""

    accelerator: str
    """``cpu`` or ``gpu``."""
    devices: int
    """Processes per node."""
    num_nodes: int
    dp: int
    tp: int
    replicate: int
    """Data-parallel groups that hold the same parameters (HSDP replicas, DDP ranks)."""
    shard: int
    """Ranks one parameter is sharded over (1: not sharded)."""
    pp: int = 1
    """Pipeline stages' ranks: the model is cut into pp x ``pipeline.stages_per_rank`` stages."""
    cp: int = 1
    """Ranks that split each sequence (context parallel); parameters are sharded over shard x cp."""
    ep: int = 1
    """Ranks each MoE layer's experts are split over (expert parallel), out of the shard ranks."""

    @property
    def world_size(self) -> int:
        return self.devices * self.num_nodes

    @property
    def on_gpu(self) -> bool:
        return self.accelerator == "gpu"

    def columns(self) -> dict[str, int]:
        """The layout as a run's summary reports it."""
        columns = {"world_size": self.world_size, "dp": self.dp, "tp": self.tp}
        if self.cp > 1:
            columns["cp"] = self.cp
        if self.ep > 1:
            columns["ep"] = self.ep
        return {**columns, "pp": self.pp} if self.pp > 1 else columns


@dataclass(frozen=True)
class ResolvedRun:
    cfg: TrainConfig
    """The typed config with every ``auto`` made concrete (what ``config.yaml`` holds)."""
    entry: StrategyEntry
    layout: Layout
    precision: ResolvedPrecision
    checkpoint_format: CheckpointFormat

    @classmethod
    def of(cls, cfg: TrainConfig) -> ResolvedRun:
        """The run of a config whose layout is resolved (``devices``, ``dp``, ``precision``
        concrete) and whose ranges and precision name are checked
        (:func:`fsdp_cli.config.validate.checked_run`)."""
        entry = entry_of(cfg)
        devices, dp = int(cfg.devices), int(cfg.dp)
        world = devices * cfg.num_nodes
        # (the data-parallel sharding is decided within one pipeline stage's share of the ranks)
        split = cfg.strategy.sharding(dp, devices, world // cfg.pp)
        layout = Layout(
            accelerator=cfg.accelerator.value,
            devices=devices,
            num_nodes=cfg.num_nodes,
            dp=dp,
            tp=cfg.tp,
            replicate=split.replicate,
            shard=split.shard,
            pp=cfg.pp,
            cp=cfg.cp,
            ep=cfg.ep,
        )
        precision = resolve_precision(cfg.precision.name, policy_dtypes(cfg.strategy.explicit_policy()))
        return cls(
            cfg=cfg,
            entry=entry,
            layout=layout,
            precision=precision,
            checkpoint_format=cfg.strategy.checkpoint_format(cfg.checkpoint.format),
        )

    @property
    def dims(self) -> ParallelDims:
        """The mesh sizes the parent decided (replicate x shard x tp), for the strategy to take as
        they are: a fresh object per call, since each strategy builds its own mesh on it. (pp x
        replicate x shard x tp.)"""
        layout = self.layout
        return ParallelDims(
            dp_replicate=layout.replicate,
            dp_shard=layout.shard,
            tp=layout.tp,
            pp=layout.pp,
            cp=layout.cp,
            ep=layout.ep,
        )

    def with_config(self, cfg: TrainConfig) -> ResolvedRun:
        """This run with a later edit of its config that derives nothing anew (the resume path
        and run id; a model without its weights for a rehearsal)."""
        return dataclasses.replace(self, cfg=cfg)

    @property
    def model_kind(self) -> ModelKind:
        """The registry entry that answers every question about the model (:data:`MODULE` for
        ``model=custom`` until its target is imported)."""
        return kind_of(self.cfg.model)

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.run_dir)

    @property
    def model_label(self) -> str:
        """How reports name the model: the class path of a custom one, ``hf:PATH``, or the option."""
        return model_label(self.cfg)

    def summary_columns(self) -> dict[str, Any]:
        """What every ``summary.json`` of this run says about it (a RunSummary's layout fields)."""
        return {
            "strategy": self.entry.name,
            "accelerator": self.layout.accelerator,
            **self.layout.columns(),
            "pp": self.cfg.pp,
            "precision": self.precision.name,
            "model": self.model_label,
            "run_dir": str(self.cfg.run_dir),
        }


def model_label(cfg: TrainConfig) -> str:
    return kind_of(cfg.model).label(cfg.model)
