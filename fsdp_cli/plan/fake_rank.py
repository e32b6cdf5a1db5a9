"""Rank R of a layout set up in this process as ``Trainer.fit`` sets up a rank, on fake tensors.

Inside a fake process group (:mod:`fsdp_cli.plan.fake_world`), :func:`built_rank` goes through
what ``Trainer.fit`` does on a rank, with the same builders and strategy classes:
``build_strategy`` and ``build_module`` on the :class:`~fsdp_cli.config.resolved.ResolvedRun`,
the strategy's ``setup_environment`` (its mesh), Lightning's ``configure_model`` call on the meta
device, then the strategy's own sharding (``FSDP2Strategy.parallelize``, FSDP1's wrapping, a
user's ``configure_model``); tensors are then "allocated" as fake ones. A rehearsal
(:mod:`fsdp_cli.plan.rehearsal`) reads what the rank holds off the result; the fake step
(:mod:`fsdp_cli.plan.fake_step`) trains it, with fewer of the model's identical blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from fsdp_cli.config.resolved import ResolvedRun
from fsdp_cli.errors import ConfigError
from fsdp_cli.plan.fake_world import FakeWorld, FakeWorldEnvironment


@dataclass
class BuiltRank:
    """Rank R after set-up: its strategy, trainer and module (fake tensors until the block ends)."""

    run: ResolvedRun
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


@contextmanager
def built_rank(
    run: ResolvedRun,
    world: FakeWorld,
    *,
    blocks: int | None = None,
    before_parallelize: Callable[[BuiltRank], None] | None = None,
) -> Iterator[BuiltRank]:
    """Rank ``world.rank`` of ``run`` set up as ``Trainer.fit`` sets up a rank, inside a fake
    process group; ``blocks``: keep only the first N repeated blocks (the fake step's builds);
    ``before_parallelize``: called with the whole model on the meta device, before the strategy
    shards it (or, under pipeline parallel, cuts it to this rank's stages)."""
    import torch

    from fsdp_cli.builders.model import build_module
    from fsdp_cli.builders.strategy import build_strategy
    from fsdp_cli.compat.torch_internals import FakeTensorMode
    from fsdp_cli.strategies.fsdp2 import FSDP2Strategy

    strategy = build_strategy(run)
    trainer = _trainer(run, strategy, world)
    # A LightningModule may create its layers in __init__: on the meta device here.
    with torch.device("meta"):
        module = build_module(run)
    built = BuiltRank(run, world, strategy, trainer, module)
    with _refusing(run, world):
        # Trainer._run's order: connect, setup_environment (the mesh), configure_model, setup.
        _connect_and_configure(built)
        built.blocks = block_count(built.target)
        if blocks is not None:
            keep_first_blocks(built.target, blocks)
        if before_parallelize is not None:
            before_parallelize(built)
        if isinstance(strategy, FSDP2Strategy):
            strategy.parallelize()  # on the meta model, as FSDP2Strategy.setup does first
    with FakeTensorMode(allow_non_fake_inputs=True):
        with _refusing(run, world):
            _setup(built)
        yield built


def _connect_and_configure(built: BuiltRank) -> None:
    """The strategy connected to the module and the trainer, its mesh set up, and the module's
    ``configure_model`` run on the meta device."""
    import torch
    from lightning.pytorch.trainer.states import TrainerFn

    strategy, trainer, module = built.strategy, built.trainer, built.module
    strategy.connect(module)
    module.trainer = trainer
    trainer.state.fn = TrainerFn.FITTING
    strategy.setup_environment()
    # What Trainer.fit runs, but on the meta device: the strategy's tensor_init_context would
    # choose the real device (DDP allocates the whole model there).
    with torch.device("meta"), strategy.model_sharded_context():
        with trainer.precision_plugin.module_init_context():
            module.configure_model()


def _trainer(run: ResolvedRun, strategy: Any, world: FakeWorld) -> Any:
    """The Trainer ``fsdp-train`` would build, on this machine's CPU: Lightning connects the
    strategy to its accelerator, devices, precision plugin and (the fake world's) environment."""
    import lightning as L

    from fsdp_cli.builders.trainer import precision_arguments

    arguments = precision_arguments(run)
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
    from fsdp_cli.parallel.nf4 import settle_constants
    from fsdp_cli.strategies.ddp import DDPStrategy
    from fsdp_cli.strategies.fsdp1 import FSDP1Strategy
    from fsdp_cli.strategies.fsdp2 import FSDP2Strategy

    strategy, trainer = built.strategy, built.trainer
    device = strategy.root_device
    if isinstance(strategy, FSDP2Strategy):
        # FSDP2Strategy.setup without init_weights: a rehearsal needs where tensors live, not values.
        built.target.to_empty(device=device)
        settle_constants(built.target, device)  # (a QLoRA base's NF4 scale mean and code table)
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
def _refusing(run: ResolvedRun, world: FakeWorld) -> Iterator[None]:
    """What stops the build on rank R would stop every rank of the real run: one line."""
    try:
        yield
    except ConfigError:
        raise
    except Exception as err:  # any failure to build is the answer, as one line
        raise refused(run, world, err, "cannot be built") from err


def refused(run: ResolvedRun, world: FakeWorld, err: BaseException, what: str) -> ConfigError:
    text = (str(err).strip().splitlines() or [""])[0]
    layout = run.layout
    named = f"{run.entry.name} dp={layout.dp} tp={layout.tp}"
    if layout.pp > 1:
        named += f" pp={layout.pp}"
    if layout.replicate > 1 and layout.shard > 1:  # hybrid: replicas of shard groups
        named += f" replicate={layout.replicate}"
    return ConfigError(
        "layout",
        f"{named} ({world.world_size} ranks)",
        f"the model {what} on it (rank {world.rank}): {type(err).__name__}: {text}",
        hint="every rank of the real run would stop there; change the layout (tp, wrap) or the model",
    )


# --------------------------------------------------------------------------- fewer blocks


def keep_first_blocks(model: Any, blocks: int) -> None:
    """Drop all but the first ``blocks`` of the model's repeated blocks (its largest
    ``ModuleList``/``ModuleDict`` of one class), in place, before it is sharded."""
    from torch import nn

    container = block_container(model)
    if container is None or len(container) <= blocks:
        return
    if isinstance(container, nn.ModuleDict):
        for key in list(container.keys())[blocks:]:
            del container[key]
    else:
        del container[blocks:]


def block_container(model: Any) -> Any:
    """The ``ModuleList``/``ModuleDict`` holding the repeated blocks (as
    :func:`fsdp_cli.parallel.wrap.repeated_block_class` finds their class), or None."""
    from torch import nn

    best: tuple[int, Any] | None = None
    for module in model.modules():
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and len(module) > 1:
            if len({type(c) for c in module.children()}) == 1:
                size = sum(p.numel() for p in module.parameters())
                if best is None or size > best[0]:
                    best = (size, module)
    return best[1] if best else None


def block_count(model: Any) -> int:
    container = block_container(model)
    return len(container) if container is not None else 0
