"""A rehearsal: one CPU process builds rank R of a layout of any size with the code a real rank runs.

The process joins a fake process group of the layout's world size (:mod:`fsdp_cli.plan.fake_world`)
and sets the rank up as ``Trainer.fit`` does, with the same builders and strategy classes
(:mod:`fsdp_cli.plan.fake_rank`): tensor parallel, activation checkpointing, float8,
``fully_shard``, HSDP or the user's ``parallelize_fn``, FSDP1's wrapping, a user's
``configure_model``. Tensors are "allocated" as fake tensors (shapes without memory), so nothing
is allocated and no rank starts, however large the model.

What rank R holds is read off the result: parameters from the local shards (DTensor local
shards, FSDP1's flat parameters, padding included), gradients alike (each is allocated like its
parameter's local shard), optimizer state from the module's own optimizer after one step on
zero gradients. :func:`disagreements` compares them with the formula plan (:mod:`fsdp_cli.plan.memory`).
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from fsdp_cli.compat.torch_internals import storage_bytes
from fsdp_cli.config.resolved import ResolvedRun
from fsdp_cli.errors import ConfigError
from fsdp_cli.plan.fake_rank import BuiltRank, built_rank
from fsdp_cli.plan.fake_world import FakeWorld, fake_process_group
from fsdp_cli.plan.memory import MemoryPlan

HELD = ("params", "grads", "optimizer")
TOLERANCE = 0.01
"""Rehearsed and planned bytes more than 1% apart: the plan is wrong for this layout."""


@dataclass(frozen=True)
class HeldBytes:
    params: int
    grads: int
    optimizer: int


@dataclass
class Rehearsal:
    world_size: int
    rank: int
    mesh_coordinates: dict[str, int]
    held_bytes: HeldBytes
    fsdp_units: list[str]
    float8_linears: int = 0
    """Linear layers converted to torchao's Float8Linear (``strategy.float8=true``)."""
    seconds: float = 0.0
    step: dict[str, Any] | None = None
    """The fake training step's measured peak (:mod:`fsdp_cli.plan.fake_step`)."""
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def rehearse(run: ResolvedRun, rank: int = 0, *, step: bool = True) -> Rehearsal:
    """Rehearse rank ``rank`` of a resolved, validated run. A layout the model cannot take raises
    :class:`ConfigError` (one line)."""
    run = rehearsal_run(run)
    world = FakeWorld(num_nodes=run.layout.num_nodes, per_node=run.layout.devices, rank=rank)
    if not 0 <= rank < world.world_size:
        raise ConfigError(
            "--rank",
            rank,
            f"not one of this layout's {world.world_size} ranks",
            allowed=f"0..{world.world_size - 1}",
        )
    started = time.perf_counter()
    with _quiet(), fake_process_group(world):
        with built_rank(run, world) as built:
            result = Rehearsal(
                world_size=world.world_size,
                rank=rank,
                mesh_coordinates=mesh_coordinates(built),
                held_bytes=held_bytes(built),
                fsdp_units=fsdp_units(built),
                float8_linears=sum(type(m).__name__ == "Float8Linear" for m in built.target.modules()),
            )
            depth = built.blocks
        if step:
            from fsdp_cli.plan.fake_step import measure_step

            result.step = measure_step(run, world, depth)
    result.seconds = round(time.perf_counter() - started, 2)
    return result


_REFUSALS: dict[str, ConfigError | None] = {}


def refusal(run: ResolvedRun) -> ConfigError | None:
    """Why rank 0 of ``run`` cannot be built (no fake step), or None. Remembered per config: a
    sweep asks before any job starts and again as each job starts."""
    key = repr(run.cfg)
    if key not in _REFUSALS:
        try:
            rehearse(run, 0, step=False)
            _REFUSALS[key] = None
        except ConfigError as err:
            _REFUSALS[key] = err
    return _REFUSALS[key]


def rehearsal_run(run: ResolvedRun) -> ResolvedRun:
    """``run`` as rehearsed: a Hugging Face model's weights are never read (their values do not
    matter, only the shapes its config.json gives)."""
    model = run.model_kind.without_weights(run.cfg.model)
    return run if model is run.cfg.model else run.with_config(replace(run.cfg, model=model))


# --------------------------------------------------------------------------- what rank R holds


def held_bytes(built: BuiltRank) -> HeldBytes:
    import torch

    with torch.no_grad():  # DTensor.to_local() is a plain attribute read without autograd
        return _held_bytes(built)


def _held_bytes(built: BuiltRank) -> HeldBytes:
    params = list(built.module.parameters())
    trainable = [p for p in params if p.requires_grad]
    return HeldBytes(
        params=storage_bytes(params),
        # A gradient is allocated like its parameter's local shard (FSDP2: a view into the
        # reduce-scatter output, padded like the shard; FSDP1: its flat parameter's shard).
        grads=storage_bytes(trainable),
        optimizer=optimizer_state_bytes(built.strategy.optimizers),
    )


def optimizer_state_bytes(optimizers: list[Any]) -> int:
    """The state each optimizer keeps, after one step on zero gradients (states are created lazily)."""
    import torch

    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for p in group["params"]:
                local = p.to_local() if hasattr(p, "to_local") else p
                if p.requires_grad and local.numel():  # FSDP1: a parameter outside this rank's shard has none
                    p.grad = torch.zeros_like(p)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return storage_bytes(
        v
        for o in optimizers
        for state in o.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    )


def mesh_coordinates(built: BuiltRank) -> dict[str, int]:
    mesh = getattr(built.strategy, "run_mesh", None)
    if mesh is None:  # DDP: one data-parallel dimension
        return {"data_parallel": built.world.rank}
    from fsdp_cli.parallel.dims import CP, PP

    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    coordinates = zip(names, mesh.get_coordinate() or (), mesh.shape, strict=False)
    # The pipeline and context-parallel dimensions are named only where they split something.
    return {name: at for name, at, size in coordinates if name not in (PP, CP) or size > 1}


def fsdp_units(built: BuiltRank) -> list[str]:
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    from fsdp_cli.parallel.names import canonical_name

    names = [
        canonical_name(name) or "<root>"
        for name, m in built.target.named_modules()
        if isinstance(m, (FSDPModule, FullyShardedDataParallel))
    ]
    return sorted(names, key=lambda name: name == "<root>")  # the root last, as the setup report has it


# --------------------------------------------------------------------------- against the plan


def disagreements(rehearsal: Rehearsal, plan: MemoryPlan) -> list[str]:
    """One line per kind of bytes where the plan and the rehearsal of the same rank differ by more
    than :data:`TOLERANCE` (the optimizer's, only where the plan knows the optimizer)."""
    from fsdp_cli.plan.check import OWN_OPTIMIZER

    planned = plan.ranks[rehearsal.rank]
    lines = []
    for kind in HELD:
        if kind == "optimizer" and OWN_OPTIMIZER in plan.notes:
            continue  # a LightningModule's own optimizer: the plan said it cannot know it
        held, expected = getattr(rehearsal.held_bytes, kind), getattr(planned, kind)
        if abs(held - expected) > TOLERANCE * max(held, expected, 1):
            lines.append(
                f"rank {rehearsal.rank} {kind}: rehearsed {held:,} bytes, planned {expected:,} "
                f"({(held - expected) / max(expected, 1):+.1%})"
            )
    return lines + _held_forwards_disagreement(rehearsal, plan)


def _held_forwards_disagreement(rehearsal: Rehearsal, plan: MemoryPlan) -> list[str]:
    """Under pp: the forwards the schedule held on this rank in the fake step (each one a
    micro-batch's activations through one stage) against the plan's count, the factor its
    activation bytes are multiplied by (the same tolerance: a count, so any difference)."""
    held = (rehearsal.step or {}).get("held_forwards")
    if held is None or plan.pipeline is None:
        return []
    pp_rank = rehearsal.rank // (rehearsal.world_size // plan.layout["pp"])
    expected = plan.pipeline["held_forwards"][pp_rank]
    if abs(held - expected) <= TOLERANCE * max(held, expected, 1):
        return []
    return [
        f"rank {rehearsal.rank} forwards held (pipeline rank {pp_rank}, {plan.pipeline['schedule']}): "
        f"rehearsed {held}, planned {expected}"
    ]


@contextmanager
def _quiet() -> Iterator[None]:
    """Lightning's start-up chatter and torch's warnings about what a real run would do are noise
    here (every rank would print them; the rehearsal is about shapes)."""
    loggers = [logging.getLogger(n) for n in ("lightning.pytorch", "lightning.fabric")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
