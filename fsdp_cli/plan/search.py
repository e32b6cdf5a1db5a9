"""Candidate layouts for the same devices: which fit, and how much memory each needs per rank."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fsdp_cli.config.resolved import ResolvedRun
from fsdp_cli.config.schema import DDPConfig, FSDP2Config, FSDPConfig, ShardingStrategy, TrainConfig
from fsdp_cli.config.validate import checked_run, validate
from fsdp_cli.errors import ConfigError
from fsdp_cli.parallel.options import ActivationCheckpointing
from fsdp_cli.plan.memory import MemoryPlan, plan_memory
from fsdp_cli.plan.model import ModelSpec


@dataclass
class Candidate:
    overrides: str
    plan: MemoryPlan

    @property
    def row(self) -> dict[str, object]:
        peak = self.plan.peak
        return {
            "overrides": self.overrides,
            "total_bytes": peak.total,
            "activations_bytes": peak.activations,
            "fits": self.plan.fits,
        }


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(run: ResolvedRun) -> list[tuple[str, TrainConfig]]:
    """FSDP2 over every tp (within a node) x HSDP replication x activation checkpointing x
    reshard-after-forward, plus FSDP1 FULL_SHARD and DDP, for the run's devices and nodes (each a
    config of its own layout, resolved as its own run by :func:`search`)."""
    cfg, world = run.cfg, run.layout.world_size
    base = cfg.strategy if isinstance(cfg.strategy, FSDP2Config) else FSDP2Config()
    out: list[tuple[str, TrainConfig]] = []
    for tp in _divisors(int(cfg.devices)):
        dp = world // tp
        for replicate in _divisors(dp):
            for ac in (
                ActivationCheckpointing.none,
                ActivationCheckpointing.selective,
                ActivationCheckpointing.full,
            ):
                for reshard in (True, False):
                    strategy = dataclasses.replace(
                        base,
                        replicate_size=replicate,
                        activation_checkpointing=ac,
                        reshard_after_forward=reshard,
                    )
                    text = (
                        f"strategy=fsdp2 tp={tp} strategy.replicate_size={replicate} "
                        f"strategy.activation_checkpointing={ac.value} strategy.reshard_after_forward={str(reshard).lower()}"
                    )
                    out.append((text, dataclasses.replace(cfg, strategy=strategy, tp=tp, dp=dp)))
    out.append(
        (
            "strategy=fsdp",
            dataclasses.replace(
                cfg, strategy=FSDPConfig(sharding_strategy=ShardingStrategy.FULL_SHARD), tp=1, dp=world
            ),
        )
    )
    out.append(("strategy=ddp", dataclasses.replace(cfg, strategy=DDPConfig(), tp=1, dp=world)))
    return out


def search(run: ResolvedRun, spec: ModelSpec, device_memory: int | None) -> list[Candidate]:
    """Every valid candidate's plan: the fitting ones first, least memory first among them
    after preferring no recomputation and fewer tensor-parallel ranks (less communication)."""
    found = []
    for text, candidate in candidates(run):
        try:
            candidate_run = checked_run(candidate)  # another layout: a run of its own
            validate(candidate_run)
        except ConfigError:
            continue
        found.append(Candidate(text, plan_memory(candidate_run, spec, device_memory)))
    cost = {"none": 0, "selective": 1, "full": 2}
    return sorted(
        found,
        key=lambda c: (
            c.plan.fits is False,
            cost[c.plan.activation_checkpointing],
            c.plan.layout["tp"],
            c.plan.peak.total,
        ),
    )
