"""Old names and keywords, mapped to today's config with a notice for each.

* ``strategy=ddp_fully_sharded`` (lightning_fairscale) and ``strategy=fsdp_native`` (Lightning 1.x)
  run as ``strategy=fsdp`` (PyTorch's native FSDP); fairscale's keywords are translated.
* ``strategy.activation_checkpointing`` (deprecated) becomes ``activation_checkpointing_policy``.
* ``precision=16``/``bf16``/``32``/``64`` become ``16-mixed``/``bf16-mixed``/``32-true``/``64-true``.

Runs in the parent, before validation, without torch; the resolved ``config.yaml`` holds only
the new names.
"""

from __future__ import annotations

import dataclasses

from fsdp_cli.config.schema import (
    DDPFullyShardedConfig,
    DType,
    FSDPConfig,
    FSDPNativeConfig,
    ShardingStrategy,
    TrainConfig,
    WrapConfig,
    WrapPolicy,
)
from fsdp_cli.precision import ALIASES as LEGACY_PRECISION


def migrate(cfg: TrainConfig) -> tuple[TrainConfig, list[str]]:
    """Return the config in current terms and the notices to show the user."""
    notices: list[str] = []
    precision = cfg.precision.name
    if precision in LEGACY_PRECISION:
        new = LEGACY_PRECISION[precision]
        notices.append(f"note: precision={precision} is the old name of precision={new}; running {new}")
        cfg = dataclasses.replace(cfg, precision=dataclasses.replace(cfg.precision, name=new))
    return cfg.strategy.migrate(cfg, notices), notices


def checkpointing_policy_of_old_keyword(
    cfg: TrainConfig, strategy: FSDPConfig, notices: list[str]
) -> TrainConfig:
    """FSDP1's deprecated ``activation_checkpointing`` merged into ``activation_checkpointing_policy``."""
    if not strategy.activation_checkpointing:
        return cfg
    notices.append(
        "warning: strategy.activation_checkpointing is deprecated; use "
        f"strategy.activation_checkpointing_policy={list(strategy.activation_checkpointing)}"
    )
    merged = list(
        dict.fromkeys([*strategy.activation_checkpointing_policy, *strategy.activation_checkpointing])
    )
    strategy = dataclasses.replace(
        strategy, activation_checkpointing_policy=merged, activation_checkpointing=None
    )
    return dataclasses.replace(cfg, strategy=strategy)


def from_lightning_1(cfg: TrainConfig, old: FSDPNativeConfig, notices: list[str]) -> TrainConfig:
    """``strategy=fsdp_native`` runs as ``strategy=fsdp`` (then FSDP1's own old keyword)."""
    notices.append(
        "note: strategy=fsdp_native is Lightning 1.x's name for native FSDP; running strategy=fsdp"
    )
    new = _as_fsdp(old)
    return new.migrate(dataclasses.replace(cfg, strategy=new), notices)


def _as_fsdp(strategy: FSDPConfig) -> FSDPConfig:
    """The plain FSDPConfig with the fields an FSDPConfig has."""
    fields = {f.name: getattr(strategy, f.name) for f in dataclasses.fields(FSDPConfig)}
    return FSDPConfig(**{**fields, "name": "fsdp"})


def from_fairscale(cfg: TrainConfig, old: DDPFullyShardedConfig, notices: list[str]) -> TrainConfig:
    """``strategy=ddp_fully_sharded`` runs as ``strategy=fsdp``, fairscale's keywords translated
    (then FSDP1's own old keyword)."""
    notices.append(
        "note: strategy=ddp_fully_sharded (lightning_fairscale) now runs PyTorch's native FSDP: strategy=fsdp"
    )
    new = _as_fsdp(old)
    if old.reshard_after_forward is not None:
        sharding = (
            ShardingStrategy.FULL_SHARD if old.reshard_after_forward else ShardingStrategy.SHARD_GRAD_OP
        )
        new = dataclasses.replace(new, sharding_strategy=sharding)
    mp = new.mixed_precision
    if old.compute_dtype is not None:
        mp = dataclasses.replace(mp, param_dtype=old.compute_dtype)
    if old.fp32_reduce_scatter:
        mp = dataclasses.replace(mp, reduce_dtype=DType.float32)
    new = dataclasses.replace(new, mixed_precision=mp)
    if old.move_grads_to_cpu:
        new = dataclasses.replace(new, cpu_offload=True)
    if old.min_num_params is not None:
        cfg = dataclasses.replace(
            cfg, wrap=WrapConfig(policy=WrapPolicy.size, min_num_params=old.min_num_params)
        )
    ignored = [
        k for k in ("flatten_parameters", "bucket_cap_mb", "state_dict_to_cpu") if getattr(old, k) is not None
    ]
    if ignored:
        notices.append(
            f"note: strategy.{', strategy.'.join(ignored)} have no native-FSDP equivalent and are ignored"
        )
    return new.migrate(dataclasses.replace(cfg, strategy=new), notices)
