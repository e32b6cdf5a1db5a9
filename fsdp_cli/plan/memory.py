"""Per-rank memory of a run: its model description laid out over its strategy and mesh.

Parameters, gradients and optimizer state are what each rank's local shards hold, including the
padding the libraries add (a test compares them with the bytes real CPU runs hold, rank by rank):

* FSDP2 chunks dimension 0 of every (tensor-parallel local) parameter over the shard group and
  allocates every rank the first, longest chunk; gradients are views into one reduce-scatter
  output of those padded sizes; AdamW's moments follow the unpadded local shard.
* FSDP1 flattens each unit's parameters into one buffer (each parameter aligned to 16 bytes,
  the total padded to a multiple of the group size) and gives each rank an equal slice; the
  gradient is a slice of the same size; AdamW's moments follow each parameter's part of the slice.
* DDP holds everything whole (gradients are views into its buckets).

AdamW keeps two moments in the parameter dtype and a 4-byte step per parameter it updates.
Activations and the transient all-gather / reduce-scatter buffers are estimates (see
:mod:`fsdp_cli.plan.model`); the total is what a GPU's allocator would peak at, before its own
fragmentation, which ``FIT_FRACTION`` leaves room for.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from fsdp_cli.config.schema import (
    ActivationCheckpointing,
    DDPConfig,
    FSDP2Config,
    FSDPConfig,
    ShardingStrategy,
    TrainConfig,
)
from fsdp_cli.parallel.shapes import ParamShape, chunk_sizes, tp_local_shape
from fsdp_cli.plan.model import Activations, ModelSpec

FIT_FRACTION = 0.95
"""A plan fits when its largest rank needs at most this share of the device memory."""
ADAM_STEP_BYTES = 4
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class RankMemory:
    rank: int
    params: int = 0
    grads: int = 0
    optimizer: int = 0
    activations: int = 0
    """With the configured activation checkpointing."""
    activations_no_ac: int = 0
    activations_full_ac: int = 0
    buffers: int = 0
    """FSDP all-gather / reduce-scatter buffers (DDP under autocast: the low-precision weight copies)."""
    offloaded: int = 0
    """Parameters, gradients and optimizer state kept in host memory (``cpu_offload`` on GPUs)."""

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers


@dataclass
class MemoryPlan:
    strategy: str
    layout: dict[str, int]
    precision: str
    micro_batch_size: int
    seq_len: int
    activation_checkpointing: str
    ranks: list[RankMemory]
    device_memory: int | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def peak(self) -> RankMemory:
        return max(self.ranks, key=lambda r: r.total)

    @property
    def fits(self) -> bool | None:
        if self.device_memory is None:
            return None
        return self.peak.total <= FIT_FRACTION * self.device_memory

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for rank, data in zip(self.ranks, out["ranks"]):
            data["total"] = rank.total
        out["fits"] = self.fits
        out["peak_rank"] = self.peak.rank
        return out


@dataclass(frozen=True)
class Dtypes:
    param: int
    compute: int
    reduce: int


def dtypes_of(cfg: TrainConfig) -> Dtypes:
    """Bytes per element of stored parameters, compute (activations, all-gathers) and reduction."""
    name = cfg.precision.name
    stored = {"bf16-true": 2, "16-true": 2, "64-true": 8}.get(name, 4)
    compute = 2 if name.endswith("-mixed") else stored
    reduce = 4 if name.endswith("-mixed") else stored
    mp = getattr(cfg.strategy, "mp_policy", None) or getattr(cfg.strategy, "mixed_precision", None)
    if mp is not None:
        compute = DTYPE_BYTES[mp.param_dtype.value] if mp.param_dtype is not None else compute
        reduce = DTYPE_BYTES[mp.reduce_dtype.value] if mp.reduce_dtype is not None else reduce
    return Dtypes(param=stored, compute=compute, reduce=reduce)


def plan_memory(cfg: TrainConfig, spec: ModelSpec, device_memory: int | None = None) -> MemoryPlan:
    """Every rank's memory for a resolved config (layout sizes are numbers, not ``auto``)."""
    strategy, dp, tp = cfg.strategy, int(cfg.dp), cfg.tp
    world = int(cfg.devices) * cfg.num_nodes
    micro = cfg.data.micro_batch_size or cfg.data.global_batch_size // dp
    dtypes = dtypes_of(cfg)
    if isinstance(strategy, FSDP2Config):
        replicate = strategy.replicate_size
        ranks, layout = (
            _fsdp2(spec, dp // replicate, tp, replicate, dtypes, strategy),
            {
                "replicate": replicate,
                "shard": dp // replicate,
                "tp": tp,
            },
        )
    elif isinstance(strategy, FSDPConfig):
        shard, ranks = _fsdp1(spec, cfg, strategy, dtypes)
        layout = {"replicate": world // shard, "shard": shard, "tp": 1}
    else:
        ranks, layout = (
            _ddp(spec, world, dtypes, cfg.precision.name),
            {"replicate": world, "shard": 1, "tp": 1},
        )
    ac = _ac_mode(cfg)
    acts = spec.activations(cfg.data.seq_len, dtypes.compute)
    sequence_parallel = bool(getattr(strategy, "sequence_parallel", False))
    for rank in ranks:
        rank.activations_no_ac = micro * _activation_bytes(acts, "none", 1, tp, sequence_parallel)
        rank.activations_full_ac = micro * _activation_bytes(acts, "full", 1, tp, sequence_parallel)
        every = getattr(strategy, "ac_every_n_blocks", 1)
        rank.activations = micro * _activation_bytes(acts, ac, every, tp, sequence_parallel)
        if cfg.accelerator.value == "gpu" and getattr(strategy, "cpu_offload", False):
            rank.offloaded = rank.params + rank.grads + rank.optimizer
            rank.params = rank.grads = rank.optimizer = 0
    return MemoryPlan(
        strategy=strategy.name,
        layout={**layout, "world": world},
        precision=cfg.precision.name,
        micro_batch_size=micro,
        seq_len=cfg.data.seq_len,
        activation_checkpointing=ac,
        ranks=ranks,
        device_memory=device_memory,
        notes=list(spec.notes),
    )


def _ac_mode(cfg: TrainConfig) -> str:
    strategy = cfg.strategy
    if isinstance(strategy, FSDP2Config):
        return strategy.activation_checkpointing.value
    if isinstance(strategy, FSDPConfig) and strategy.activation_checkpointing_policy:
        return ActivationCheckpointing.full.value
    return ActivationCheckpointing.none.value


def _activation_bytes(acts: Activations, mode: str, every: int, tp: int, sequence_parallel: bool) -> int:
    """One sequence's saved activations on one rank, plus the transient of one block in backward
    (its recomputation under checkpointing, its activation gradients otherwise)."""
    inner = 1 / tp if acts.tp_shards_blocks else 1.0
    blocks = [b * inner for b in acts.blocks]
    inputs = [i / tp if sequence_parallel else i for i in acts.block_inputs]
    if mode == "full":
        checkpointed = set(range(len(blocks)))
    elif mode == "selective":
        checkpointed = set(range(every - 1, len(blocks), every))
    else:
        checkpointed = set()
    kept = sum(inputs[i] if i in checkpointed else blocks[i] for i in range(len(blocks)))
    transient = max(blocks, default=0)
    return int(kept + transient + acts.other)


# --------------------------------------------------------------------------- strategies


def _unit_sizes(spec: ModelSpec, tp: int) -> dict[str, int]:
    """Elements per FSDP unit on one tensor-parallel rank (rank 0's share), cached per spec."""
    if tp not in spec.unit_sizes:
        sizes: dict[str, int] = {}
        for p in spec.params:
            unit = spec.unit_of(p)
            sizes[unit] = sizes.get(unit, 0) + math.prod(tp_local_shape(p, tp, 0))
        spec.unit_sizes[tp] = sizes
    return spec.unit_sizes[tp]


def _fsdp2(
    spec: ModelSpec, shard: int, tp: int, replicate: int, dtypes: Dtypes, strategy: FSDP2Config
) -> list[RankMemory]:
    # Parameters of one shape split alike: count them once per shape (an 8B model has ~10 shapes).
    shapes = Counter((p.shape, p.tp_dim) for p in spec.params)
    buffers = _gather_buffers(_unit_sizes(spec, tp), dtypes, keep_all=strategy.reshard_after_forward is False)
    by_coordinate: dict[tuple[int, int], RankMemory] = {}
    ranks = []
    for rank in range(replicate * shard * tp):
        coordinate = ((rank // tp) % shard, rank % tp)
        if coordinate not in by_coordinate:
            by_coordinate[coordinate] = _fsdp2_rank(shapes, shard, tp, coordinate, dtypes)
        ranks.append(dataclasses.replace(by_coordinate[coordinate], rank=rank, buffers=buffers))
    return ranks


def _fsdp2_rank(
    shapes: Counter[tuple[tuple[int, ...], int | None]],
    shard: int,
    tp: int,
    coordinate: tuple[int, int],
    dtypes: Dtypes,
) -> RankMemory:
    shard_rank, tp_rank = coordinate
    mem = RankMemory(0)
    for (shape, tp_dim), count in shapes.items():
        local = tp_local_shape(ParamShape("", shape, tp_dim), tp, tp_rank)
        rest = math.prod(local[1:])
        rows = chunk_sizes(local[0], shard) if local[0] else [0] * shard
        mem.params += count * rows[0] * rest * dtypes.param  # every rank allocates the longest chunk
        mem.grads += count * rows[0] * rest * dtypes.param
        mem.optimizer += count * (2 * rows[shard_rank] * rest * dtypes.param + ADAM_STEP_BYTES)
    return mem


def _gather_buffers(units: dict[str, int], dtypes: Dtypes, *, keep_all: bool) -> int:
    """Unsharded parameters of the unit running and the one prefetched (of every unit when they
    stay gathered until backward), and one unit's unsharded gradients plus their reduce copy."""
    if not units:
        return 0
    largest = max(units.values())
    gathered = sum(units.values()) if keep_all else 2 * largest
    return gathered * dtypes.compute + largest * (dtypes.compute + dtypes.reduce)


def _fsdp1(
    spec: ModelSpec, cfg: TrainConfig, strategy: FSDPConfig, dtypes: Dtypes
) -> tuple[int, list[RankMemory]]:
    world = int(cfg.devices) * cfg.num_nodes
    sharding = strategy.sharding_strategy
    if sharding in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy.HYBRID_SHARD_ZERO2):
        group = strategy.hybrid_shard_size or int(cfg.devices)
    else:
        group = world
    sharded = sharding is not ShardingStrategy.NO_SHARD
    aligned = 16 // dtypes.compute
    units: dict[str, list[tuple[int, int]]] = {}  # unit -> (offset, numel) of each parameter
    totals: dict[str, int] = {}
    for p in spec.params:
        unit = spec.unit_of(p)
        total = totals.get(unit, 0)
        total += (aligned - total % aligned) % aligned
        units.setdefault(unit, []).append((total, p.numel))
        totals[unit] = total + p.numel
    totals = {u: t + (group - t % group) % group for u, t in totals.items()}
    ranks = []
    for rank in range(world):
        mem = RankMemory(rank)
        r = rank % group
        for unit, params in units.items():
            size = totals[unit] // group if sharded else totals[unit]
            start = r * size if sharded else 0
            mem.params += size * dtypes.param
            mem.grads += size * dtypes.param
            for offset, numel in params:
                local = max(0, min(offset + numel, start + size) - max(offset, start))
                if local:
                    mem.optimizer += 2 * local * dtypes.param + ADAM_STEP_BYTES
        keep_all = sharding in (ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.HYBRID_SHARD_ZERO2)
        mem.buffers = _gather_buffers(totals, dtypes, keep_all=keep_all) if sharded else 0
        ranks.append(mem)
    return group if sharded else 1, ranks


def _ddp(spec: ModelSpec, world: int, dtypes: Dtypes, precision: str) -> list[RankMemory]:
    numel = sum(p.numel for p in spec.params)
    ranks = []
    for rank in range(world):
        mem = RankMemory(
            rank,
            params=numel * dtypes.param,
            grads=numel * dtypes.param,
            optimizer=2 * numel * dtypes.param + ADAM_STEP_BYTES * len(spec.params),
        )
        # Autocast keeps a low-precision copy of every weight from forward to backward.
        mem.buffers = numel * dtypes.compute if precision.endswith("-mixed") else 0
        ranks.append(mem)
    return ranks


def strategy_supported(cfg: TrainConfig) -> bool:
    return isinstance(cfg.strategy, (FSDP2Config, FSDPConfig, DDPConfig))
