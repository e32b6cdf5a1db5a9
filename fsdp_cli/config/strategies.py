"""One entry per strategy: what fsdp-train checks and accepts of it; its schema answers the rest.

Validation, the resolved layout, the precision in effect, the builders, the memory plan and the
model's initialisation each ask a strategy's :class:`StrategyEntry` (or its schema) instead of
switching on its config class (in the manner of torchtitan's ``TrainSpec``). Adding a strategy
means a schema in :mod:`fsdp_cli.config.schema` (answering :class:`~fsdp_cli.config.schema.StrategyAnswers`
for itself: its sharding, policy, offload, checkpoint format), an entry here (its checks and what
it accepts), its builder in :data:`fsdp_cli.builders.strategy.BUILDERS` and its memory planner in
:data:`fsdp_cli.plan.memory.PLANNERS` (both keyed by the entry's name, each in the room the
layering lets reference it: the config room is below both; a test holds the three to the same
names).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from fsdp_cli.config.schema import (
    DDPConfig,
    DDPFullyShardedConfig,
    DType,
    FSDP2Config,
    FSDPConfig,
    FSDPNativeConfig,
    MixedPrecisionPolicyConfig,
    ModelParallelConfig,
    TrainConfig,
)
from fsdp_cli.errors import ConfigError

if TYPE_CHECKING:  # (type-only: the resolved run is made from an entry)
    from fsdp_cli.config.resolved import ResolvedRun
    from fsdp_cli.precision import PolicyDtypes

Check = Callable[["ResolvedRun"], None]


class StrategyEntry(NamedTuple):
    """(A named tuple: the config-only commands import the registry, and a frozen dataclass
    costs ten times as much to define.)"""

    name: str
    schema: type
    checks: tuple[Check, ...] = ()
    """Strategy-specific validation (after the generic range checks and the layout's)."""
    tensor_parallel: bool = False
    """Accepts ``tp > 1``."""
    policy_casts: bool = False
    """Mixed precision is realised by the FSDP policy alone (no autocast on top)."""
    fills_after_sharding: bool = False
    """A Hugging Face model stays on the meta device until it is sharded, then each rank reads
    only its own slices of the weights (nothing whole is ever allocated)."""
    user_parallelizes: bool = False
    """The LightningModule applies its own parallelism in ``configure_model``."""


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


def check_strategy(run: ResolvedRun) -> None:
    """Tensor parallel only where the strategy has it, then the strategy's own checks (its
    registry entry)."""
    for check in (check_tensor_parallel, *run.entry.checks):
        check(run)


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


def _shardable_precision(run: ResolvedRun) -> None:
    """A precision the sharded strategies train in (the precision table's ``shardable``)."""
    if run.precision.spec.shardable:
        return
    from fsdp_cli.precision import PRECISIONS

    usable = [
        p.name
        for p in PRECISIONS.values()
        if p.shardable
        and (run.layout.on_gpu or not p.gpu_only)
        and not (p.loss_scaling and _no_sharded_fp16 in run.entry.checks)
    ]
    raise ConfigError(
        "precision",
        run.cfg.precision.name,
        f"strategy={run.entry.name} cannot train in {run.precision.param} "
        "(Lightning's sharded strategies refuse it on every rank)",
        allowed=", ".join(usable),
        hint=f"use strategy=ddp for {run.precision.name}",
    )


def _policy_fits_precision(key: str) -> Check:
    def check(run: ResolvedRun) -> None:
        cfg = run.cfg
        policy = cfg.strategy.explicit_policy()
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
    if strategy.hybrid():
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
    if not run.model_kind.target_decides:
        raise ConfigError(
            "strategy",
            "model_parallel",
            "needs a LightningModule that parallelizes itself in configure_model()",
            allowed="model=custom model._target_=<your LightningModule>",
            hint="for the built-in model use strategy=fsdp2 (it applies FSDP2 and tensor parallel for you)",
        )


# --------------------------------------------------------------------------- layouts


FSDP2 = StrategyEntry(
    name="fsdp2",
    schema=FSDP2Config,
    checks=(_check_fsdp2, _shardable_precision, _no_sharded_fp16, _policy_fits_precision("mp_policy")),
    tensor_parallel=True,
    policy_casts=True,
    fills_after_sharding=True,
)
FSDP1 = StrategyEntry(
    name="fsdp",
    schema=FSDPConfig,
    checks=(_check_fsdp1, _shardable_precision, _policy_fits_precision("mixed_precision")),
    fills_after_sharding=True,
)
DDP = StrategyEntry(
    name="ddp",
    schema=DDPConfig,
)
MODEL_PARALLEL = StrategyEntry(
    name="model_parallel",
    schema=ModelParallelConfig,
    checks=(_needs_configure_model, _shardable_precision, _no_sharded_fp16),
    tensor_parallel=True,
    user_parallelizes=True,
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
