"""FSDP1 builder: ``strategy=fsdp`` -> :class:`fsdp_cli.strategies.fsdp1.FSDP1Strategy`."""

from __future__ import annotations

import functools
from datetime import timedelta
from typing import Any

from lightning.pytorch.strategies import Strategy

from fsdp_cli.builders.precision import mixed_precision_dtypes
from fsdp_cli.config.schema import BackwardPrefetch, FSDPConfig, TrainConfig, WrapConfig, WrapPolicy


def build_fsdp1(cfg: TrainConfig, strategy: FSDPConfig) -> Strategy:
    from torch.distributed.fsdp import BackwardPrefetch as TorchBackwardPrefetch
    from torch.distributed.fsdp import CPUOffload

    from fsdp_cli.compat.torch_internals import fsdp1_sharding_strategy
    from fsdp_cli.strategies.fsdp1 import FSDP1Strategy

    return FSDP1Strategy(
        sharding_strategy=fsdp1_sharding_strategy(strategy.sharding_strategy.value),
        hybrid_shard_size=_hybrid_shard_size(cfg, strategy),
        # FSDP1 pins offloaded memory, which needs CUDA; on CPU processes offloading is a no-op anyway.
        cpu_offload=CPUOffload(offload_params=True)
        if strategy.cpu_offload and cfg.accelerator.value == "gpu"
        else None,
        mixed_precision=fsdp1_mixed_precision(cfg.precision.name, strategy),
        auto_wrap_policy=size_policy(cfg.wrap),
        wrap=cfg.wrap if cfg.wrap.policy in (WrapPolicy.block, WrapPolicy.classes) else None,
        activation_checkpointing_policy=list(strategy.activation_checkpointing_policy) or None,
        checkpoint_format=cfg.checkpoint.format.value,
        process_group_backend=strategy.process_group_backend,
        timeout=timedelta(seconds=strategy.timeout_s),
        use_orig_params=strategy.use_orig_params,
        limit_all_gathers=strategy.limit_all_gathers,
        forward_prefetch=strategy.forward_prefetch,
        backward_prefetch=None
        if strategy.backward_prefetch is BackwardPrefetch.none
        else TorchBackwardPrefetch[strategy.backward_prefetch.value],
        sync_module_states=strategy.sync_module_states,
    )


def _hybrid_shard_size(cfg: TrainConfig, strategy: FSDPConfig) -> int | None:
    """HYBRID_SHARD's shard group, the processes of one node unless set (as validate checks it):
    given explicitly, so the strategy builds the mesh even with ``wrap=none``."""
    if "HYBRID" not in strategy.sharding_strategy.value:
        return strategy.hybrid_shard_size
    return strategy.hybrid_shard_size or int(cfg.devices)


def size_policy(wrap: WrapConfig) -> Any:
    """``wrap=size`` as FSDP1's size-based auto-wrap policy; class-based wrapping is resolved by
    the strategy against the built model (``wrap=``), so unknown names can be reported."""
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy

    if wrap.policy is WrapPolicy.size:
        return functools.partial(size_based_auto_wrap_policy, min_num_params=wrap.min_num_params)
    return None


def fsdp1_mixed_precision(precision: str, strategy: FSDPConfig) -> Any | None:
    """FSDP1 MixedPrecision for ``*-mixed``: low-precision compute, fp32 gradient reduction.

    (Lightning's own default reduces gradients in bf16/fp16; fp32 keeps large all-reduces exact.)
    """
    from torch.distributed.fsdp import MixedPrecision

    dtypes = mixed_precision_dtypes(precision, strategy.mixed_precision)
    if dtypes.param is None and dtypes.reduce is None:
        return None
    return MixedPrecision(param_dtype=dtypes.param, reduce_dtype=dtypes.reduce, buffer_dtype=None)
