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
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from fsdp_cli.adapters.options import AdapterDtype
from fsdp_cli.config.resolved import ResolvedRun
from fsdp_cli.config.schema import FSDPConfig, ShardingStrategy
from fsdp_cli.errors import ConfigError
from fsdp_cli.parallel.nf4 import bytes_per_element, nf4_constant_bytes
from fsdp_cli.parallel.options import ActivationCheckpointing
from fsdp_cli.parallel.shapes import ParamShape, chunk_sizes, expert_rows, tp_local_shape
from fsdp_cli.pipeline.sizes import PipelineSizes
from fsdp_cli.plan.model import FP32, Activations, ModelSpec

FIT_FRACTION = 0.95
"""A plan fits when its largest rank needs at most this share of the device memory."""
ADAM_STEP_BYTES = 4
GIB = 2**30


def gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB"


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
    stages: list[int] = field(default_factory=list)
    """The pipeline stages this rank holds (empty without pipeline parallel)."""

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
    pipeline: dict[str, Any] | None = None
    """With pp > 1: the schedule, micro-batches and their size, the forwards each pipeline rank
    holds and the schedule's theoretical bubble."""
    activations_known: bool = True
    """False: the model's activations could not be estimated (its forward does not run on the
    meta device): the totals are without them, and nothing is said to fit."""

    @property
    def peak(self) -> RankMemory:
        return max(self.ranks, key=lambda r: r.total)

    @property
    def fits(self) -> bool | None:
        """None when unknown: no device memory given, or activations not estimated and the rest
        fits (without them the total is a lower bound: it can only say no)."""
        if self.device_memory is None:
            return None
        fits = self.peak.total <= FIT_FRACTION * self.device_memory
        return None if fits and not self.activations_known else fits

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


def dtypes_of(run: ResolvedRun) -> Dtypes:
    """Bytes per element of stored parameters, compute (activations, all-gathers) and reduction:
    the precision in effect, explicit mixed-precision policy included."""
    return Dtypes(*run.precision.bytes())


def stored_bytes(run: ResolvedRun, spec: ModelSpec, dtypes: Dtypes) -> Callable[[ParamShape], float]:
    """Bytes per element each parameter is stored in (its gradient and Adam moments alike): the
    precision's, except fp32 for the trained modules over a 16-bit base (``peft.adapter_dtype``,
    :mod:`fsdp_cli.adapters.dtype`): parameters that train in a module with nothing frozen; and a
    QLoRA base's NF4 weights, about half a byte (:func:`fsdp_cli.parallel.nf4.bytes_per_element`)."""
    peft = run.cfg.peft
    nf4 = bytes_per_element(dtypes.param)  # (QLoRA's base: about half a byte per weight)
    if not peft.enabled or peft.adapter_dtype is not AdapterDtype.float32 or dtypes.param >= FP32:
        return lambda p: nf4 if p.quantized else dtypes.param
    frozen_modules = {p.module for p in spec.params if not p.trainable}
    return lambda p: (
        nf4 if p.quantized else FP32 if p.trainable and p.module not in frozen_modules else dtypes.param
    )


@dataclass
class Placement:
    """What one strategy's planner says about a run."""

    ranks: list[RankMemory]
    activation_checkpointing: str = ActivationCheckpointing.none.value
    ac_every_n_blocks: int = 1
    sequence_parallel: bool = False
    pipeline: PipelineSizes | None = None
    """With pp > 1: the sizes the ranks' ``stages`` refer to."""


@dataclass(frozen=True)
class Planner:
    """A strategy's memory planner (:data:`PLANNERS`)."""

    place: Callable[[ResolvedRun, ModelSpec, Dtypes], Placement]
    hint: Callable[[ResolvedRun, MemoryPlan, float], str | None]
    """The strategy's own way to fit into ``limit`` bytes per device, or None."""


def plan_memory(run: ResolvedRun, spec: ModelSpec, device_memory: int | None = None) -> MemoryPlan:
    """Every rank's memory for a resolved run (layout sizes are numbers, not ``auto``)."""
    planner = planner_of(run)
    if planner is None:
        raise ValueError(f"strategy={run.entry.name}: no memory plan for it")
    layout, data = run.layout, run.cfg.data
    micro = per_rank_batch(run)
    dtypes = dtypes_of(run)
    placement = planner.place(run, spec, dtypes)
    if run.cfg.pp > 1 and placement.pipeline is None:
        raise ConfigError(
            "pp", run.cfg.pp, f"strategy={run.entry.name} has no pipeline plan", allowed="strategy=fsdp2"
        )
    # Context parallel: each rank holds seq_len / cp tokens of every sequence (the all-to-all's
    # whole-sequence q, k, v of heads / cp are as many bytes).
    acts = spec.activations(data.seq_len // layout.cp, dtypes.compute)
    mode, every, sp = (
        placement.activation_checkpointing,
        placement.ac_every_n_blocks,
        placement.sequence_parallel,
    )
    offloaded = layout.on_gpu and run.cfg.strategy.offloads()
    for rank in placement.ranks:
        held = _held_activations(placement, rank, acts, micro, layout.tp, sp)
        rank.activations_no_ac = held("none", 1)
        rank.activations_full_ac = held("full", 1)
        rank.activations = held(mode, every)
        if offloaded:
            rank.offloaded = rank.params + rank.grads + rank.optimizer
            rank.params = rank.grads = rank.optimizer = 0
    return MemoryPlan(
        strategy=run.entry.name,
        layout=_layout_sizes(run, placement),
        precision=run.precision.name,
        micro_batch_size=micro,
        seq_len=data.seq_len,
        activation_checkpointing=mode,
        ranks=placement.ranks,
        device_memory=device_memory,
        notes=list(spec.notes),
        pipeline=_pipeline_facts(placement.pipeline),
        activations_known=acts.known,
    )


def _layout_sizes(run: ResolvedRun, placement: Placement) -> dict[str, int]:
    """The mesh sizes a plan is titled with (``pp`` first, when the placement is pipelined)."""
    layout = run.layout
    return {
        **({"pp": run.cfg.pp} if placement.pipeline else {}),
        "replicate": layout.replicate,
        "shard": layout.shard,
        **({"cp": layout.cp} if layout.cp > 1 else {}),
        **({"ep": layout.ep} if layout.ep > 1 else {}),
        "tp": layout.tp,
        "world": layout.world_size,
    }


def per_rank_batch(run: ResolvedRun) -> int:
    """Sequences one data-parallel rank takes in one forward (``data.micro_batch_size``; without
    it, its whole share of the global batch): under pipeline parallel, what one schedule step
    splits into the pipeline's micro-batches."""
    data = run.cfg.data
    return data.micro_batch_size or data.global_batch_size // run.layout.dp


def _held_activations(
    placement: Placement, rank: RankMemory, acts: Activations, micro: int, tp: int, sp: bool
) -> Callable[[str, int], int]:
    """The activation bytes ``rank`` holds under a checkpointing mode: ``micro`` sequences'
    worth; under pipeline parallel, the forwards its schedule keeps of its largest stage, at the
    micro-batch size, plus one block's backward transient."""
    sizes = placement.pipeline
    if sizes is None:
        return lambda mode, every: micro * int(sum(_activation_parts(acts, mode, every, tp, sp)))
    from fsdp_cli.plan.stages import stage_activations

    held = sizes.held(rank.stages[0] % sizes.pp)
    parts = [stage_activations(acts, sizes, s) for s in rank.stages]

    def bytes_held(mode: str, every: int) -> int:
        kept, transient = zip(*(_activation_parts(a, mode, every, tp, sp) for a in parts), strict=True)
        return int(sizes.microbatch_size * (held * max(kept) + max(transient)))

    return bytes_held


def _pipeline_facts(sizes: PipelineSizes | None) -> dict[str, Any] | None:
    if sizes is None:
        return None
    return {
        "schedule": sizes.facts.name,
        "stages_per_rank": sizes.stages_per_rank,
        "microbatches": sizes.microbatches,
        "microbatch_size": sizes.microbatch_size,
        "stage_blocks": [[r.start, r.stop] for r in sizes.blocks],
        "held_forwards": [sizes.held(r) for r in range(sizes.pp)],
        "bubble_fraction": sizes.bubble,
    }


def planner_of(run: ResolvedRun) -> Planner | None:
    """The strategy's planner (:data:`PLANNERS`); None: no plan for it."""
    return PLANNERS[run.entry.name]


def _activation_parts(
    acts: Activations, mode: str, every: int, tp: int, sequence_parallel: bool
) -> tuple[float, float]:
    """One sequence's saved activations on one rank, and the transient of one block in backward
    (its recomputation under checkpointing, its activation gradients otherwise)."""
    blocks = _tp_block_bytes(acts, tp, sequence_parallel)
    inputs = [i / tp if sequence_parallel else i for i in acts.block_inputs]
    if mode == "full":
        checkpointed = set(range(len(blocks)))
    elif mode == "selective":
        checkpointed = set(range(every - 1, len(blocks), every))
    else:
        checkpointed = set()
    kept = sum(inputs[i] if i in checkpointed else blocks[i] for i in range(len(blocks)))
    transient = max(blocks, default=0)
    return kept + acts.other, transient


def _tp_block_bytes(acts: Activations, tp: int, sequence_parallel: bool) -> list[float]:
    """Each block's saved bytes on one tensor-parallel rank. Only the heads' and the MLP's inner
    activations are split by tp; the residual stream (the norms) is whole on every rank without
    sequence parallel, and with it all but the all-gathered inputs of attention and the MLP are
    split along the sequence (Megatron's sbh(10 + 24/t) without SP against sbh(34/t) with it)."""
    if not acts.tp_shards_blocks or tp == 1:
        return [float(b) for b in acts.blocks]
    whole = acts.block_whole if acts.block_whole is not None else acts.blocks
    gathered = acts.block_gathered if acts.block_gathered is not None else whole  # unknown: whole
    if sequence_parallel:
        return [(b - g) / tp + g for b, g in zip(acts.blocks, gathered, strict=True)]
    return [(b - w) / tp + w for b, w in zip(acts.blocks, whole, strict=True)]


# --------------------------------------------------------------------------- strategies


def _unit_sizes(spec: ModelSpec, tp: int, ep: int = 1, nf4: float = 1.0) -> dict[str, int]:
    """Elements per FSDP unit on one tensor-parallel rank (rank 0's share; a unit's experts: this
    rank's 1 / ep of them, gathered with it), cached per spec. A QLoRA base weight counts ``nf4``
    of an element: its 4-bit bytes over the compute dtype's (0 where FSDP2 leaves it out)."""
    if (tp, ep, nf4) not in spec.unit_sizes:
        sizes: dict[str, int] = {}
        for p in spec.params:
            unit = spec.unit_of(p)
            numel = math.prod(tp_local_shape(p, tp, 0)) // (ep if p.expert else 1)
            sizes[unit] = sizes.get(unit, 0) + (round(numel * nf4) if p.quantized else numel)
        spec.unit_sizes[(tp, ep, nf4)] = sizes
    return spec.unit_sizes[(tp, ep, nf4)]


def _fsdp2_place(run: ResolvedRun, spec: ModelSpec, dtypes: Dtypes) -> Placement:
    strategy, layout = run.cfg.strategy, run.layout
    sizes = None
    if run.cfg.pp > 1:
        from fsdp_cli.plan.stages import sizes_of

        sizes = sizes_of(run, spec, per_rank_batch(run))
    pipeline_ranks = [_fsdp2_pipeline_rank(run, spec, dtypes, sizes, r) for r in range(run.cfg.pp)]
    stage_world = layout.world_size // run.cfg.pp
    ranks = []
    for rank in range(layout.world_size):
        pp_rank, local = divmod(rank, stage_world)  # pp is the mesh's outermost dimension
        # (FSDP2 shards over shard x cp: the mesh's (replicate, shard, cp, tp) order)
        coordinate = ((local // layout.tp) % (layout.shard * layout.cp), local % layout.tp)
        ranks.append(dataclasses.replace(pipeline_ranks[pp_rank](coordinate), rank=rank))
    return Placement(
        ranks,
        activation_checkpointing=strategy.activation_checkpointing.value,
        ac_every_n_blocks=strategy.ac_every_n_blocks,
        sequence_parallel=strategy.sequence_parallel,
        pipeline=sizes,
    )


def _fsdp2_pipeline_rank(
    run: ResolvedRun, spec: ModelSpec, dtypes: Dtypes, sizes: PipelineSizes | None, pp_rank: int
) -> Callable[[tuple[int, int]], RankMemory]:
    """The memory of one pipeline rank's (shard, tp) coordinates: the parameters of its stages
    (the whole model without pipeline parallel), each stage an FSDP root of its own."""
    layout, keep_all = run.layout, run.cfg.strategy.reshard_after_forward is False
    if sizes is None:
        # (QLoRA's NF4 weights gather as 4-bit data; with one rank per shard group FSDP2 leaves
        # them out: parallel/fsdp2.py)
        nf4 = 0.0 if layout.shard * layout.cp == 1 else bytes_per_element(dtypes.param) / dtypes.compute
        params, stages, units = spec.params, [], [_unit_sizes(spec, layout.tp, layout.ep, nf4)]
    else:
        from fsdp_cli.plan.stages import stage_params, stage_units

        stages = sizes.rank_stages(pp_rank)
        by_stage = stage_params(spec, sizes)
        params = [p for s in stages for p in by_stage[s]]
        units = [stage_units(spec, by_stage[s], layout.tp) for s in stages]
    # keep_root: parallel/fsdp2.py leaves the root gathered from forward to backward; one stage
    # runs at a time, but with resharding after forward off every stage stays gathered.
    gathered = [_gather_buffers(u, dtypes, keep_all=keep_all, keep_root=True) for u in units]
    buffers = sum(gathered) if keep_all else max(gathered)
    # Parameters of one shape split alike: count them once per shape (an 8B model has ~10 shapes).
    stored = stored_bytes(run, spec, dtypes)
    shapes = Counter((p.shape, p.tp_dim, p.trainable, stored(p), p.expert and layout.ep > 1) for p in params)
    cache: dict[tuple[int, int], RankMemory] = {}
    constants = sum(p.quantized for p in params) * nf4_constant_bytes(dtypes.param)

    def memory(coordinate: tuple[int, int]) -> RankMemory:
        if coordinate not in cache:
            mem = _fsdp2_rank(shapes, layout.shard * layout.cp, layout.tp, coordinate, ep=layout.ep)
            mem.params += constants  # (each NF4 weight's code table and scale mean, on every rank)
            cache[coordinate] = dataclasses.replace(mem, buffers=buffers, stages=stages)
        return cache[coordinate]

    return memory


def _fsdp2_hint(run: ResolvedRun, plan: MemoryPlan, limit: float) -> str | None:
    peak, strategy = plan.peak, run.cfg.strategy
    if plan.pipeline and max(plan.pipeline["held_forwards"]) > run.cfg.pp * plan.pipeline["stages_per_rank"]:
        return f"pipeline.schedule=1F1B or Interleaved1F1B (hold at most about pp={run.cfg.pp} micro-batches, not all)"
    if plan.activation_checkpointing != "full":
        with_ac = peak.total - peak.activations + peak.activations_full_ac
        if with_ac <= limit:
            return f"strategy.activation_checkpointing=full ({gib(with_ac)} per device)"
    if strategy.replicate_size > 1:
        return "shard the parameters: strategy=fsdp2 (with strategy.replicate_size=1)"
    if strategy.activation_checkpointing is ActivationCheckpointing.none:
        return "strategy.activation_checkpointing=full, a smaller data.micro_batch_size, or more devices (fsdp-plan --search)"
    return None


def _fsdp2_rank(
    shapes: Counter[tuple[tuple[int, ...], int | None, bool, int, bool]],
    shard: int,
    tp: int,
    coordinate: tuple[int, int],
    *,
    ep: int = 1,
) -> RankMemory:
    """``shapes``: (shape, tp dim, trainable, bytes per element, split over ep) -> how many."""
    shard_rank, tp_rank = coordinate
    mem = RankMemory(0)
    for (shape, tp_dim, trainable, stored, expert), count in shapes.items():
        local = tp_local_shape(ParamShape("", shape, tp_dim), tp, tp_rank)
        rest = math.prod(local[1:])
        rows = chunk_sizes(local[0], shard) if local[0] else [0] * shard
        index = shard_rank
        if expert:  # this rank's experts, sharded over the expert-shard ranks (mesh: (expert shard, ep))
            _, rest, rows = expert_rows(local, ep, shard)
            index = shard_rank // ep
        mem.params += round(count * rows[0] * rest * stored)  # every rank allocates the longest chunk
        if not trainable:  # frozen (LoRA's base): no gradient, no optimizer state
            continue
        mem.grads += count * rows[0] * rest * stored
        # (a rank whose shard is empty gets no gradient, so no optimizer state, not even a step)
        mem.optimizer += count * (2 * rows[index] * rest * stored + (ADAM_STEP_BYTES if rows[index] else 0))
    return mem


def _gather_buffers(units: dict[str, int], dtypes: Dtypes, *, keep_all: bool, keep_root: bool = False) -> int:
    """Unsharded parameters of the unit running and the one prefetched (of every unit when they
    stay gathered until backward; plus the root's, ``""``, when it stays gathered), and one unit's
    unsharded gradients plus their reduce copy."""
    if not units:
        return 0
    largest = max(units.values())
    root = units.get("", 0) if keep_root else 0
    gathered = sum(units.values()) if keep_all else 2 * largest + (root if root < largest else 0)
    return gathered * dtypes.compute + largest * (dtypes.compute + dtypes.reduce)


def _fsdp1_place(run: ResolvedRun, spec: ModelSpec, dtypes: Dtypes) -> Placement:
    strategy: FSDPConfig = run.cfg.strategy
    sharding, layout = strategy.sharding_strategy, run.layout
    sharded = sharding is not ShardingStrategy.NO_SHARD
    group = layout.shard
    units: dict[str, list[tuple[int, int, bool]]] = {}  # unit -> (offset, numel, trains) per parameter
    totals: dict[str, int] = {}
    unit_bytes: dict[str, int] = {}  # a flat parameter holds one dtype: fp32 adapters are units apart
    unit_of, stored = _fsdp1_unit_of(spec), stored_bytes(run, spec, dtypes)
    for p in spec.params:
        unit = unit_of(p)
        unit_bytes.setdefault(unit, stored(p))
        aligned = 16 // (dtypes.compute if unit_bytes[unit] == dtypes.param else unit_bytes[unit])
        total = totals.get(unit, 0)
        total += (aligned - total % aligned) % aligned
        units.setdefault(unit, []).append((total, p.numel, p.trainable))
        totals[unit] = total + p.numel
    totals = {u: t + (group - t % group) % group for u, t in totals.items()}
    ranks = []
    for rank in range(layout.world_size):
        mem = RankMemory(rank)
        r = rank % group
        for unit, params in units.items():
            size = totals[unit] // group if sharded else totals[unit]
            start = r * size if sharded else 0
            width = unit_bytes[unit]
            mem.params += size * width
            # One gradient for the whole flat parameter as soon as any of its parameters trains.
            mem.grads += size * width if any(trains for *_, trains in params) else 0
            for offset, numel, trains in params:
                local = max(0, min(offset + numel, start + size) - max(offset, start))
                if local and trains:
                    mem.optimizer += 2 * local * width + ADAM_STEP_BYTES
        keep_all = sharding in (ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.HYBRID_SHARD_ZERO2)
        mem.buffers = _gather_buffers(totals, dtypes, keep_all=keep_all) if sharded else 0
        ranks.append(mem)
    ac = (
        ActivationCheckpointing.full
        if strategy.activation_checkpointing_policy
        else ActivationCheckpointing.none
    )
    return Placement(ranks, activation_checkpointing=ac.value)


def _fsdp1_unit_of(spec: ModelSpec) -> Callable[[ParamShape], str]:
    """The unit of each parameter: the spec's, except that with frozen parameters about, a module
    whose parameters all train is a unit of its own
    (:func:`fsdp_cli.strategies.fsdp1.trainable_apart_policy`)."""
    if all(p.trainable for p in spec.params):
        return spec.unit_of
    frozen_modules = {p.module for p in spec.params if not p.trainable}
    return lambda p: p.module if p.module not in frozen_modules else spec.unit_of(p)


def _fsdp1_hint(run: ResolvedRun, plan: MemoryPlan, limit: float) -> str | None:
    if run.cfg.strategy.sharding_strategy is ShardingStrategy.NO_SHARD:
        return "strategy.sharding_strategy=FULL_SHARD"
    return None


def _ddp_place(run: ResolvedRun, spec: ModelSpec, dtypes: Dtypes) -> Placement:
    numel = sum(p.numel for p in spec.params)
    stored = stored_bytes(run, spec, dtypes)
    trained = [p for p in spec.params if p.trainable]
    trained_bytes = sum(p.numel * stored(p) for p in trained)
    ranks = []
    for rank in range(run.layout.world_size):
        mem = RankMemory(
            rank,
            params=sum(p.numel * stored(p) for p in spec.params),
            grads=trained_bytes,
            optimizer=2 * trained_bytes + ADAM_STEP_BYTES * len(trained),
        )
        # Autocast keeps a low-precision copy of every weight from forward to backward.
        mem.buffers = numel * dtypes.compute if run.precision.spec.mixed else 0
        ranks.append(mem)
    return Placement(ranks)


def _ddp_hint(run: ResolvedRun, plan: MemoryPlan, limit: float) -> str | None:
    return "shard the parameters: strategy=fsdp2 (with strategy.replicate_size=1)"


FSDP2 = Planner(place=_fsdp2_place, hint=_fsdp2_hint)
FSDP1 = Planner(place=_fsdp1_place, hint=_fsdp1_hint)
DDP = Planner(place=_ddp_place, hint=_ddp_hint)
PLANNERS: dict[str, Planner | None] = {"fsdp2": FSDP2, "fsdp": FSDP1, "ddp": DDP, "model_parallel": None}
"""Each strategy's planner by its registry entry's name (:data:`fsdp_cli.config.strategies.ENTRIES`);
None: no memory plan (a LightningModule's own ``configure_model`` decides what each rank holds)."""


def strategy_supported(run: ResolvedRun) -> bool:
    return planner_of(run) is not None
