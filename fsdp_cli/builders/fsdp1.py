"""FSDP1 builder: ``strategy=fsdp`` -> :class:`fsdp_cli.strategies.fsdp1.FSDP1Strategy`."""

from __future__ import annotations

import functools
from datetime import timedelta
from typing import Any

from lightning.pytorch.strategies import Strategy

from fsdp_cli.builders.checkpointing import checkpointing
from fsdp_cli.config.resolved import ResolvedRun
from fsdp_cli.config.schema import BackwardPrefetch, WrapPolicy
from fsdp_cli.parallel.options import WrapOptions
from fsdp_cli.precision import ResolvedPrecision


def build_fsdp1(run: ResolvedRun) -> Strategy:
    from torch.distributed.fsdp import BackwardPrefetch as TorchBackwardPrefetch
    from torch.distributed.fsdp import CPUOffload

    from fsdp_cli.compat.torch_internals import fsdp1_sharding_strategy
    from fsdp_cli.strategies.fsdp1 import FSDP1Strategy

    cfg, strategy = run.cfg, run.cfg.strategy
    return FSDP1Strategy(
        sharding_strategy=fsdp1_sharding_strategy(strategy.sharding_strategy.value),
        # The replicate x shard split the run decided (HYBRID_*: the processes of one node unless
        # set), given explicitly so the strategy builds the mesh even with wrap=none.
        dims=run.dims,
        # FSDP1 pins offloaded memory, which needs CUDA; on CPU processes offloading is a no-op anyway.
        cpu_offload=CPUOffload(offload_params=True) if strategy.cpu_offload and run.layout.on_gpu else None,
        mixed_precision=fsdp1_mixed_precision(run.precision),
        auto_wrap_policy=size_policy(cfg.wrap),
        wrap=cfg.wrap if cfg.wrap.policy in (WrapPolicy.block, WrapPolicy.classes) else None,
        activation_checkpointing_policy=list(strategy.activation_checkpointing_policy) or None,
        **checkpointing(run),
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


def size_policy(wrap: WrapOptions) -> Any:
    """``wrap=size`` as FSDP1's size-based auto-wrap policy; class-based wrapping is resolved by
    the strategy against the built model (``wrap=``), so unknown names can be reported."""
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy

    if wrap.policy is WrapPolicy.size:
        return functools.partial(size_based_auto_wrap_policy, min_num_params=wrap.min_num_params)
    return None


def fsdp1_mixed_precision(precision: ResolvedPrecision) -> Any | None:
    """FSDP1 MixedPrecision for the policy in effect (``*-mixed``: low-precision compute, fp32
    gradient reduction; an explicit ``strategy.mixed_precision`` field wins).

    (Lightning's own default reduces gradients in bf16/fp16; fp32 keeps large all-reduces exact.)
    """
    from torch.distributed.fsdp import MixedPrecision

    from fsdp_cli.builders.precision import torch_dtype

    policy = precision.policy
    if policy.param is None and policy.reduce is None:
        return None
    return MixedPrecision(
        param_dtype=torch_dtype(policy.param), reduce_dtype=torch_dtype(policy.reduce), buffer_dtype=None
    )
