"""One entry per strategy: everything fsdp-train needs to know about it, in one place.

Validation, the resolved layout, the precision in effect, the builders, the memory plan and the
model's initialisation each ask a strategy's :class:`StrategyEntry` instead of switching on its
config class (in the manner of torchtitan's ``TrainSpec``). Adding a strategy means a schema in
:mod:`fsdp_cli.config.schema`, a builder, a memory planner, and an entry here.

Builders and planners are named by dotted path (``module:attribute``) and imported when used, so
the config-only paths (``--cfg job``, config errors) import neither torch nor Lightning.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from fsdp_cli.config.schema import (
    CheckpointFormat,
    DDPConfig,
    DDPFullyShardedConfig,
    DType,
    FSDP2Config,
    FSDPConfig,
    FSDPNativeConfig,
    MixedPrecisionPolicyConfig,
    ModelParallelConfig,
    ShardingStrategy,
    TrainConfig,
)
from fsdp_cli.errors import ConfigError

if TYPE_CHECKING:  # (type-only: the resolved run is made from an entry)
    from fsdp_cli.config.resolved import ResolvedRun
    from fsdp_cli.parallel.options import ParallelizeSettings
    from fsdp_cli.precision import PolicyDtypes

Check = Callable[["ResolvedRun"], None]


class Sharding(NamedTuple):
    """How a strategy lays its data-parallel ranks out: ``replicate`` groups of ``shard`` ranks
    (``shard=1``: every rank holds every parameter)."""

    replicate: int
    shard: int


class StrategyEntry(NamedTuple):
    """(A named tuple: the config-only commands import the registry, and a frozen dataclass
    costs ten times as much to define.)"""

    name: str
    schema: type
    builder: str
    """``module:function(run) -> lightning Strategy``."""
    planner: str | None
    """``module:Planner`` (:class:`fsdp_cli.plan.memory.Planner`); None: no memory plan."""
    sharding: Callable[[Any, int, int, int], Sharding]
    """``(strategy config, dp, devices per node, world size)`` -> the replicate x shard split of
    the data-parallel ranks."""
    checks: tuple[Check, ...] = ()
    """Strategy-specific validation (after the generic range checks and the layout's)."""
    tensor_parallel: bool = False
    """Accepts ``tp > 1``."""
    replicate_size: Callable[[Any], int] = lambda strategy: 1
    """The replicate factor the layout checks against ``dp`` (FSDP2's HSDP)."""
    parallelize: Callable[[Any], ParallelizeSettings | None] = lambda strategy: None
    """The parallelize settings it applies to the built-in and Hugging Face models (FSDP2)."""
    explicit_policy: Callable[[Any], MixedPrecisionPolicyConfig | None] = lambda strategy: None
    """The strategy's own mixed-precision policy config, whose set fields override the precision."""
    policy_casts: bool = False
    """Mixed precision is realised by the FSDP policy alone (no autocast on top)."""
    builds_on_meta: Callable[[Any], bool] = lambda strategy: False
    """The built-in model is created on the meta device and each rank materialises only its shard
    (after parallelizing it)."""
    fills_after_sharding: bool = False
    """A Hugging Face model stays on the meta device until it is sharded, then each rank reads
    only its own slices of the weights (nothing whole is ever allocated)."""
    user_parallelizes: bool = False
    """The LightningModule applies its own parallelism in ``configure_model``."""
    offloads: Callable[[Any], bool] = lambda strategy: False
    """Keeps shards (or parameters) in host memory."""
    checkpoint_format: Callable[[TrainConfig], CheckpointFormat] = lambda cfg: cfg.checkpoint.format

    def build(self, run: Any) -> Any:
        return _load(self.builder)(run)

    def load_planner(self) -> Any:
        """The :class:`fsdp_cli.plan.memory.Planner` it names, or None."""
        return _load(self.planner) if self.planner else None


def _load(path: str) -> Any:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


# --------------------------------------------------------------------------- checks


def check_tensor_parallel(run: ResolvedRun) -> None:
    """``tp > 1`` only for a strategy that splits layers."""
    if run.layout.tp > 1 and not run.entry.tensor_parallel:
        raise ConfigError(
            "tp",
            run.layout.tp,
            f"strategy={run.entry.name} has no tensor parallelism",
            allowed="tp=1",
            hint="use strategy=fsdp2 (or model_parallel) for tensor parallel",
        )


def _no_sharded_fp16(run: ResolvedRun) -> None:
    cfg = run.cfg
    if run.precision.spec.loss_scaling:
        raise ConfigError(
            "precision",
            cfg.precision.name,
            f"strategy={cfg.strategy.name} has no sharded gradient scaler for float16",
            allowed="32-true, bf16-mixed, bf16-true",
            hint="use precision=bf16-mixed (no loss scaling needed), or strategy=fsdp for fp16",
        )


def _policy_fits_precision(key: str) -> Check:
    def check(run: ResolvedRun) -> None:
        cfg = run.cfg
        policy = run.entry.explicit_policy(cfg.strategy)
        if policy is None or policy.param_dtype is None:
            return
        if run.precision.spec.fixes_param_dtype:
            raise ConfigError(
                f"strategy.{key}.param_dtype",
                policy.param_dtype,
                f"precision={cfg.precision.name} already fixes the parameter dtype",
                hint=f"use precision=32-true with an explicit {key}, or precision=bf16-mixed",
            )

    return check


def _check_fsdp2(run: ResolvedRun) -> None:
    strategy: FSDP2Config = run.cfg.strategy
    shard = run.layout.shard
    raf = strategy.reshard_after_forward
    if not isinstance(raf, bool):
        if not isinstance(raf, int) or raf < 1 or shard % raf != 0:
            raise ConfigError(
                "strategy.reshard_after_forward",
                raf,
                f"must be true, false, or an int dividing the shard size {shard}",
                allowed="true, false, " + ", ".join(str(d) for d in range(1, shard + 1) if shard % d == 0),
                hint="true = FULL_SHARD, false = SHARD_GRAD_OP",
            )
    if strategy.parallelize_fn is not None:
        from fsdp_cli.dotted import check_dotted

        check_dotted("strategy.parallelize_fn", strategy.parallelize_fn)


def _check_fsdp1(run: ResolvedRun) -> None:
    strategy: FSDPConfig = run.cfg.strategy
    layout = run.layout
    world = layout.world_size
    if _hybrid(strategy):
        if world % layout.shard != 0:
            raise ConfigError(
                "strategy.hybrid_shard_size",
                strategy.hybrid_shard_size,
                f"must divide the world size {world} (devices={layout.devices} x num_nodes={layout.num_nodes})",
                allowed=", ".join(str(d) for d in range(1, world + 1) if world % d == 0),
                hint="null shards within each node and replicates across nodes",
            )
        if layout.shard == 1 and world > 1:
            # torch's FSDP1 clamps a one-rank shard group to NO_SHARD, which then never reduces
            # gradients across the replicas: each would train on its own batch only.
            key, value = (
                ("strategy.hybrid_shard_size", 1)
                if strategy.hybrid_shard_size
                else ("strategy.sharding_strategy", strategy.sharding_strategy.value)
            )
            raise ConfigError(
                key,
                value,
                f"shard groups of one process (devices={layout.devices} per node): torch's FSDP1 then runs "
                "NO_SHARD inside each group and never syncs gradients across them",
                allowed="shard groups of 2 or more processes",
                hint="strategy.sharding_strategy=NO_SHARD replicates on every rank; or run 2+ processes per node",
            )
    elif strategy.hybrid_shard_size is not None:
        raise ConfigError(
            "strategy.hybrid_shard_size",
            strategy.hybrid_shard_size,
            f"only applies to HYBRID_SHARD, not {strategy.sharding_strategy.value}",
            hint="set strategy.sharding_strategy=HYBRID_SHARD or leave hybrid_shard_size=null",
        )


def _needs_configure_model(run: ResolvedRun) -> None:
    from fsdp_cli.config.schema import CustomModelConfig

    if not isinstance(run.cfg.model, CustomModelConfig):
        raise ConfigError(
            "strategy",
            "model_parallel",
            "needs a LightningModule that parallelizes itself in configure_model()",
            allowed="model=custom model._target_=<your LightningModule>",
            hint="for the built-in model use strategy=fsdp2 (it applies FSDP2 and tensor parallel for you)",
        )


# --------------------------------------------------------------------------- layouts


def _hybrid(strategy: FSDPConfig) -> bool:
    return strategy.sharding_strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy.HYBRID_SHARD_ZERO2)


def fsdp1_sharding(strategy: FSDPConfig, dp: int, devices: int, world: int) -> Sharding:
    """FSDP1's shard groups: the hybrid size (default: the processes of one node) for HYBRID_*,
    the whole world for the fully sharded strategies, single ranks for NO_SHARD."""
    if strategy.sharding_strategy is ShardingStrategy.NO_SHARD:
        return Sharding(replicate=world, shard=1)
    if _hybrid(strategy):
        shard = strategy.hybrid_shard_size or devices
        return Sharding(replicate=world // shard, shard=shard)
    return Sharding(replicate=1, shard=world)


def _model_parallel_format(cfg: TrainConfig) -> CheckpointFormat:
    sharded = cfg.strategy.save_distributed_checkpoint
    if sharded is None:
        return cfg.checkpoint.format
    return CheckpointFormat.sharded if sharded else CheckpointFormat.full


FSDP2 = StrategyEntry(
    name="fsdp2",
    schema=FSDP2Config,
    builder="fsdp_cli.builders.strategy:build_fsdp2",
    planner="fsdp_cli.plan.memory:FSDP2",
    sharding=lambda s, dp, devices, world: Sharding(replicate=s.replicate_size, shard=dp // s.replicate_size),
    checks=(_check_fsdp2, _no_sharded_fp16, _policy_fits_precision("mp_policy")),
    tensor_parallel=True,
    replicate_size=lambda s: s.replicate_size,
    parallelize=lambda s: s,
    explicit_policy=lambda s: s.mp_policy,
    policy_casts=True,
    builds_on_meta=lambda s: s.parallelize_fn is None,
    fills_after_sharding=True,
    offloads=lambda s: s.cpu_offload,
)
FSDP1 = StrategyEntry(
    name="fsdp",
    schema=FSDPConfig,
    builder="fsdp_cli.builders.fsdp1:build_fsdp1",
    planner="fsdp_cli.plan.memory:FSDP1",
    sharding=fsdp1_sharding,
    checks=(_check_fsdp1, _policy_fits_precision("mixed_precision")),
    explicit_policy=lambda s: s.mixed_precision,
    fills_after_sharding=True,
    offloads=lambda s: s.cpu_offload,
)
DDP = StrategyEntry(
    name="ddp",
    schema=DDPConfig,
    builder="fsdp_cli.builders.strategy:build_ddp",
    planner="fsdp_cli.plan.memory:DDP",
    sharding=lambda s, dp, devices, world: Sharding(replicate=world, shard=1),
)
MODEL_PARALLEL = StrategyEntry(
    name="model_parallel",
    schema=ModelParallelConfig,
    builder="fsdp_cli.builders.strategy:build_model_parallel",
    planner=None,
    sharding=lambda s, dp, devices, world: Sharding(replicate=1, shard=dp),
    checks=(_needs_configure_model, _no_sharded_fp16),
    tensor_parallel=True,
    user_parallelizes=True,
    checkpoint_format=_model_parallel_format,
)

ENTRIES: dict[str, StrategyEntry] = {e.name: e for e in (DDP, FSDP2, FSDP1, MODEL_PARALLEL)}
LEGACY_SCHEMAS: dict[str, type] = {
    "ddp_fully_sharded": DDPFullyShardedConfig,
    "fsdp_native": FSDPNativeConfig,
}
"""Old names, composed against their own schemas and migrated to ``strategy=fsdp`` before anything
else looks at them (:mod:`fsdp_cli.config.migrate`)."""
SCHEMAS: dict[str, type] = {**{e.name: e.schema for e in ENTRIES.values()}, **LEGACY_SCHEMAS}


def entry_of(cfg: TrainConfig) -> StrategyEntry:
    """The entry of a config's strategy (old names run as the strategy they migrate to)."""
    name = cfg.strategy.name
    try:
        return ENTRIES["fsdp" if name in LEGACY_SCHEMAS else name]
    except KeyError:
        raise ConfigError(
            "strategy", cfg.strategy.name, "unknown strategy", allowed=", ".join(ENTRIES)
        ) from None


def policy_dtypes(policy: MixedPrecisionPolicyConfig | None) -> PolicyDtypes | None:
    """A strategy's mixed-precision config as the precision table's :class:`PolicyDtypes`."""
    from fsdp_cli.precision import PolicyDtypes

    if policy is None:
        return None
    name = lambda d: d.value if isinstance(d, DType) else d  # noqa: E731
    return PolicyDtypes(
        param=name(policy.param_dtype),
        reduce=name(policy.reduce_dtype),
        output=name(policy.output_dtype),
        cast_forward_inputs=policy.cast_forward_inputs,
    )
