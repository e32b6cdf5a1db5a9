"""A rehearsal: one CPU process builds rank R of a layout of any size with the code a real rank runs.

The process joins a fake process group of the layout's world size (:mod:`fsdp_cli.plan.fake_world`)
and goes through what ``Trainer.fit`` does on a rank, with the same builders and strategy
classes: ``build_strategy`` and ``build_module``, the strategy's ``setup_environment`` (its mesh),
Lightning's ``configure_model`` call on the meta device, then the strategy's own sharding:
``FSDP2Strategy.parallelize`` (tensor parallel, activation checkpointing, float8, ``fully_shard``,
HSDP, or the user's ``parallelize_fn``), FSDP1's wrapping, a user's ``configure_model``.
Tensors are then "allocated" as fake tensors (shapes without memory), so nothing is allocated
and no rank starts, however large the model.

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

from fsdp_cli.config.schema import HFModelConfig, TrainConfig
from fsdp_cli.errors import ConfigError
from fsdp_cli.plan.fake_world import FakeWorld, FakeWorldEnvironment, fake_process_group
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
    seconds: float = 0.0
    step: dict[str, Any] | None = None
    """The fake training step's measured peak (:mod:`fsdp_cli.plan.fake_step`)."""
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class BuiltRank:
    """Rank R after set-up: its strategy, trainer and module (fake tensors until the block ends)."""

    cfg: TrainConfig
    world: FakeWorld
    strategy: Any
    trainer: Any
    module: Any
    blocks: int = 0
    """The model's repeated blocks, as built (before any were dropped)."""

    @property
    def target(self) -> Any:
        """What the strategy shards: the LightningModule's ``model``, or the module itself."""
        parallelize_target = getattr(self.strategy, "parallelize_target", None)
        return parallelize_target() if callable(parallelize_target) else self.strategy.model


def rehearse(cfg: TrainConfig, rank: int = 0, *, step: bool = True) -> Rehearsal:
    """Rehearse rank ``rank`` of ``cfg`` (resolved and validated). A layout the model cannot take
    raises :class:`ConfigError` (one line)."""
    world = FakeWorld(num_nodes=cfg.num_nodes, per_node=int(cfg.devices), rank=rank)
    if not 0 <= rank < world.world_size:
        raise ConfigError(
            "--rank",
            rank,
            f"not one of this layout's {world.world_size} ranks",
            allowed=f"0..{world.world_size - 1}",
        )
    cfg = rehearsal_config(cfg)
    started = time.perf_counter()
    with _quiet(), fake_process_group(world):
        with built_rank(cfg, world) as built:
            result = Rehearsal(
                world_size=world.world_size,
                rank=rank,
                mesh_coordinates=mesh_coordinates(built),
                held_bytes=held_bytes(built),
                fsdp_units=fsdp_units(built),
            )
            depth = built.blocks
        if step:
            from fsdp_cli.plan.fake_step import measure_step

            result.step = measure_step(cfg, world, depth)
    result.seconds = round(time.perf_counter() - started, 2)
    return result


_REFUSALS: dict[str, ConfigError | None] = {}


def refusal(cfg: TrainConfig) -> ConfigError | None:
    """Why rank 0 of ``cfg`` cannot be built (no fake step), or None. Remembered per config: a
    sweep asks before any job starts and again as each job starts."""
    key = repr(cfg)
    if key not in _REFUSALS:
        try:
            rehearse(cfg, 0, step=False)
            _REFUSALS[key] = None
        except ConfigError as err:
            _REFUSALS[key] = err
    return _REFUSALS[key]


def rehearsal_config(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` as rehearsed: a Hugging Face model's weights are never read (their values do not
    matter, only the shapes its config.json gives)."""
    if isinstance(cfg.model, HFModelConfig) and cfg.model.pretrained:
        cfg = replace(cfg, model=replace(cfg.model, pretrained=False))
    return cfg


@contextmanager
def built_rank(cfg: TrainConfig, world: FakeWorld, *, blocks: int | None = None) -> Iterator[BuiltRank]:
    """Rank ``world.rank`` of ``cfg`` set up as ``Trainer.fit`` sets up a rank, inside a fake
    process group; ``blocks``: keep only the first N repeated blocks (the fake step's builds)."""
    import torch
    from lightning.pytorch.trainer.states import TrainerFn

    from fsdp_cli.builders.model import build_module
    from fsdp_cli.builders.strategy import build_strategy
    from fsdp_cli.compat.torch_internals import FakeTensorMode
    from fsdp_cli.strategies.fsdp2 import FSDP2Strategy

    strategy = build_strategy(cfg)
    trainer = _trainer(cfg, strategy, world)
    # A LightningModule may create its layers in __init__: on the meta device here.
    with torch.device("meta"):
        module = build_module(cfg)
    built = BuiltRank(cfg, world, strategy, trainer, module)
    with _refusing(cfg, world):
        # Trainer._run's order: connect, setup_environment (the mesh), configure_model, setup.
        strategy.connect(module)
        module.trainer = trainer
        trainer.state.fn = TrainerFn.FITTING
        strategy.setup_environment()
        # What Trainer.fit runs, but on the meta device: the strategy's tensor_init_context would
        # choose the real device (DDP allocates the whole model there).
        with torch.device("meta"), strategy.model_sharded_context():
            with trainer.precision_plugin.module_init_context():
                module.configure_model()
        from fsdp_cli.plan.fake_step import block_count, keep_first_blocks

        built.blocks = block_count(built.target)
        if blocks is not None:
            keep_first_blocks(built.target, blocks)
        if isinstance(strategy, FSDP2Strategy):
            strategy.parallelize()  # on the meta model, as FSDP2Strategy.setup does first
    with FakeTensorMode(allow_non_fake_inputs=True):
        with _refusing(cfg, world):
            _setup(built)
        yield built


def _trainer(cfg: TrainConfig, strategy: Any, world: FakeWorld) -> Any:
    """The Trainer ``fsdp-train`` would build, on this machine's CPU: Lightning connects the
    strategy to its accelerator, devices, precision plugin and (the fake world's) environment."""
    import lightning as L

    from fsdp_cli.builders.trainer import precision_arguments

    arguments = precision_arguments(cfg)
    arguments["plugins"] = [FakeWorldEnvironment(world), *arguments.get("plugins", [])]
    return L.Trainer(
        accelerator="cpu",
        devices=world.per_node,
        num_nodes=world.num_nodes,
        strategy=strategy,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        max_steps=1,
        **arguments,
    )


def _setup(built: BuiltRank) -> None:
    """The strategy's ``setup``, with tensors created as fake ones (an active FakeTensorMode)."""
    from fsdp_cli.strategies.ddp import DDPStrategy
    from fsdp_cli.strategies.fsdp1 import FSDP1Strategy
    from fsdp_cli.strategies.fsdp2 import FSDP2Strategy

    strategy, trainer = built.strategy, built.trainer
    device = strategy.root_device
    if isinstance(strategy, FSDP2Strategy):
        # FSDP2Strategy.setup without init_weights: a rehearsal needs where tensors live, not values.
        built.target.to_empty(device=device)
        strategy.model = strategy.precision_plugin.convert_module(strategy.model)
        strategy.setup_optimizers(trainer)
    elif isinstance(strategy, DDPStrategy):
        # DistributedDataParallel reads every parameter's data when it is built (a fake tensor has
        # none), so the module stays unwrapped: under DDP every rank holds all of it anyway.
        strategy.model = strategy.precision_plugin.convert_module(strategy.model)
        allocate = FakeAllocator(device)
        for module in built.module.modules():
            allocate(module)
        strategy.setup_optimizers(trainer)
    else:
        if isinstance(strategy, FSDP1Strategy):
            # FSDP1 allocates each unit just before sharding it, through param_init_fn.
            strategy.kwargs["param_init_fn"] = FakeAllocator(device)
        strategy.setup(trainer)


class FakeAllocator:
    """``module.to_empty(device, recurse=False)`` into fake tensors, keeping tied parameters tied.

    (``to_empty`` from meta to fake tensors gives each module a new Parameter, which would count a
    tied embedding twice; from meta to a real device it keeps one.)"""

    def __init__(self, device: Any) -> None:
        self.device = device
        self.done: dict[int, tuple[Any, Any]] = {}  # id(meta parameter) -> (it, its fake replacement)

    def __call__(self, module: Any) -> None:
        import torch
        from torch import nn

        for name, param in list(module.named_parameters(recurse=False)):
            if id(param) not in self.done:
                fake = nn.Parameter(
                    torch.empty_like(param, device=self.device), requires_grad=param.requires_grad
                )
                self.done[id(param)] = (param, fake)  # the meta one kept alive: its id stays unique
            setattr(module, name, self.done[id(param)][1])
        for name, buffer in list(module.named_buffers(recurse=False)):
            setattr(module, name, torch.empty_like(buffer, device=self.device))


@contextmanager
def _refusing(cfg: TrainConfig, world: FakeWorld) -> Iterator[None]:
    """What stops the build on rank R would stop every rank of the real run: one line."""
    try:
        yield
    except ConfigError:
        raise
    except Exception as err:  # any failure to build is the answer, as one line
        raise refused(cfg, world, err, "cannot be built") from err


def refused(cfg: TrainConfig, world: FakeWorld, err: BaseException, what: str) -> ConfigError:
    text = (str(err).strip().splitlines() or [""])[0]
    layout = f"{cfg.strategy.name} dp={cfg.dp} tp={cfg.tp}"
    replicate = getattr(cfg.strategy, "replicate_size", 1)
    if replicate > 1:
        layout += f" replicate={replicate}"
    return ConfigError(
        "layout",
        f"{layout} ({world.world_size} ranks)",
        f"the model {what} on it (rank {world.rank}): {type(err).__name__}: {text}",
        hint="every rank of the real run would stop there; change the layout (tp, wrap) or the model",
    )


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


def storage_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors by their local shards)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    seen: dict[int, int] = {}
    for t in tensors:
        for inner in _plain_tensors(t.to_local() if hasattr(t, "to_local") else t):
            storage = inner.untyped_storage()
            seen[StorageWeakRef(storage).cdata] = storage.nbytes()
    return sum(seen.values())


def _plain_tensors(t: Any) -> list[Any]:
    """The tensors holding memory behind ``t``: a wrapper subclass (torchao's float8 weights) by
    the inner tensors it declares through the ``__tensor_flatten__`` protocol."""
    if not hasattr(t, "__tensor_flatten__"):
        return [t]
    names, _ = t.__tensor_flatten__()
    return [inner for name in names for inner in _plain_tensors(getattr(t, name))]


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
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    return dict(zip(names, mesh.get_coordinate() or ()))


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
    than :data:`TOLERANCE`."""
    planned = plan.ranks[rehearsal.rank]
    lines = []
    for kind in HELD:
        held, expected = getattr(rehearsal.held_bytes, kind), getattr(planned, kind)
        if abs(held - expected) > TOLERANCE * max(held, expected, 1):
            lines.append(
                f"rank {rehearsal.rank} {kind}: rehearsed {held:,} bytes, planned {expected:,} "
                f"({(held - expected) / max(expected, 1):+.1%})"
            )
    return lines


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
