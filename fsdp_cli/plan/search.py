"""Candidate layouts for the same devices: which fit, and how much memory each needs per rank."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fsdp_cli.config.resolved import ResolvedRun
from fsdp_cli.config.schema import DDPConfig, FSDPConfig, ShardingStrategy, TrainConfig
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


@dataclass
class Skipped:
    """A candidate the run cannot take, and the one-line reason."""

    overrides: str
    reason: str

    @property
    def row(self) -> dict[str, object]:
        return {"overrides": self.overrides, "skipped": self.reason}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(run: ResolvedRun) -> list[tuple[str, TrainConfig]]:
    """FSDP2 over every pipeline size x tp (within a node) x context-parallel size (for a model
    whose attention takes part, without pp) x HSDP replication x activation checkpointing x
    reshard-after-forward (x expert-parallel size for a mixture of experts, with tp = 1: ep beside
    cp, and inside each pipeline stage),
    plus FSDP1 FULL_SHARD and DDP, for the run's devices and nodes (each a config of its own
    layout, resolved as its own run by :func:`search`)."""
    cfg, world = run.cfg, run.layout.world_size
    kind = run.model_kind
    experts = None if kind.target_decides else kind.experts(cfg.model)
    out: list[tuple[str, TrainConfig]] = []
    for tp in _divisors(int(cfg.devices)):
        for cp in _divisors(world // tp) if kind.attention_heads else [1]:
            for pp in _divisors(world // (tp * cp)) if cp == 1 else [1]:
                dp = world // (tp * cp * pp)
                eps = [e for e in _divisors(dp) if experts.count % e == 0] if experts and tp == 1 else [1]
                out += _fsdp2_candidates(dataclasses.replace(cfg, ep=1), tp, cp, pp, dp, eps)
    out.append(
        (
            "strategy=fsdp",
            dataclasses.replace(
                cfg,
                strategy=FSDPConfig(sharding_strategy=ShardingStrategy.FULL_SHARD),
                tp=1,
                dp=world,
                pp=1,
                cp=1,
                ep=1,
            ),
        )
    )
    out.append(
        ("strategy=ddp", dataclasses.replace(cfg, strategy=DDPConfig(), tp=1, dp=world, pp=1, cp=1, ep=1))
    )
    return out


def _fsdp2_candidates(
    cfg: TrainConfig, tp: int, cp: int, pp: int, dp: int, eps: list[int]
) -> list[tuple[str, TrainConfig]]:
    """One layout's FSDP2 candidates: each HSDP replication x expert-parallel size (of ``eps``,
    those dividing the shard ranks) x activation checkpointing x reshard-after-forward."""
    base = cfg.strategy.search_base()
    out: list[tuple[str, TrainConfig]] = []
    pp_text, staged = _pipelined(cfg, pp, dp)
    cp_text = f"cp={cp} " if cp > 1 else ""
    layouts = [(r, e) for r in _divisors(dp) for e in eps if (dp // r) % e == 0]
    for replicate, ep in layouts:
        ep_text = f"ep={ep} " if ep > 1 else ""
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
                    f"strategy=fsdp2 {pp_text}{cp_text}{ep_text}tp={tp} strategy.replicate_size={replicate} "
                    f"strategy.activation_checkpointing={ac.value} strategy.reshard_after_forward={str(reshard).lower()}"
                )
                out.append((text, dataclasses.replace(staged, strategy=strategy, tp=tp, dp=dp, cp=cp, ep=ep)))
    return out


def _pipelined(cfg: TrainConfig, pp: int, dp: int) -> tuple[str, TrainConfig]:
    """``cfg`` at pipeline size ``pp`` (and the overrides that say so). Unless the config fixes
    the micro-batches, gradient accumulation becomes the pipeline's micro-batches: each forward
    takes the rank's whole batch (global / dp) in micro-batches of ``data.micro_batch_size``, so
    a pipeline micro-batch holds what an accumulation step held."""
    if pp == 1:
        return "", dataclasses.replace(cfg, pp=1)
    text = f"pp={pp} "
    data, pipeline = cfg.data, cfg.pipeline
    if pipeline.microbatches is None and data.micro_batch_size and data.global_batch_size % dp == 0:
        batch = data.global_batch_size // dp
        if batch % data.micro_batch_size == 0:
            microbatches = batch // data.micro_batch_size
            data = dataclasses.replace(data, micro_batch_size=batch)
            pipeline = dataclasses.replace(pipeline, microbatches=microbatches)
            text += f"data.micro_batch_size={batch} pipeline.microbatches={microbatches} "
    return text, dataclasses.replace(cfg, pp=pp, data=data, pipeline=pipeline)


def search(
    run: ResolvedRun, spec: ModelSpec, device_memory: int | None
) -> tuple[list[Candidate], list[Skipped]]:
    """Every valid candidate's plan: the fitting ones first, least memory first among them
    after preferring no recomputation, fewer tensor-parallel ranks (less communication), fewer
    context-parallel ranks (two all-to-alls per attention) and fewer pipeline stages (a smaller
    bubble); and the candidates the run cannot take, each with
    its reason (pipeline sizes not dividing the model's blocks among them)."""
    found, skipped = [], []
    for text, candidate in candidates(run):
        try:
            _check_blocks(candidate.pp, spec)
            candidate_run = checked_run(candidate)  # another layout: a run of its own
            validate(candidate_run)
            found.append(Candidate(text, plan_memory(candidate_run, spec, device_memory)))
        except ConfigError as err:
            skipped.append(Skipped(text, err.one_line()))
    cost = {"none": 0, "selective": 1, "full": 2}
    ranked = sorted(
        found,
        key=lambda c: (
            c.plan.fits is False,
            cost[c.plan.activation_checkpointing],
            c.plan.layout["tp"],
            c.plan.layout.get("cp", 1),
            c.plan.layout.get("pp", 1),
            c.plan.peak.total,
            c.plan.layout.get("ep", 1),  # (at equal memory: fewer ranks in each token exchange)
        ),
    )
    return ranked, _one_per_reason(skipped)


def _check_blocks(pp: int, spec: ModelSpec) -> None:
    """A candidate's stages are even: pp divides the model's blocks."""
    if pp > 1 and len(spec.blocks) % pp:
        raise ConfigError(
            "pp",
            pp,
            f"does not divide the model's {len(spec.blocks)} blocks (uneven stages)",
            allowed=", ".join(str(d) for d in _divisors(len(spec.blocks))),
        )


def _one_per_reason(skipped: list[Skipped]) -> list[Skipped]:
    """The skipped candidates, one per layout and reason (the activation checkpointing and
    resharding variants of a layout fail alike)."""
    seen: dict[tuple[str, str], Skipped] = {}
    for s in skipped:
        layout = s.overrides.split(" strategy.activation_checkpointing=")[0]
        seen.setdefault((layout, s.reason), Skipped(layout, s.reason))
    return list(seen.values())
