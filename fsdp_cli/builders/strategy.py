"""Strategy builder: the ``strategy`` group (plus dp/tp, precision, wrap, checkpoint) -> a Lightning strategy."""

from __future__ import annotations

import dataclasses
from datetime import timedelta

from lightning.pytorch.strategies import Strategy

from fsdp_cli.builders.imports import import_object
from fsdp_cli.builders.precision import fsdp2_mp_policy, mixed_precision_dtypes
from fsdp_cli.compat.torch_internals import ddp_buffer_sync
from fsdp_cli.config.schema import (
    CheckpointFormat,
    DDPConfig,
    FSDP2Config,
    FSDPConfig,
    LlamaConfig,
    ModelParallelConfig,
    TrainConfig,
)
from fsdp_cli.parallel.parallelize import ParallelizeOptions


def build_strategy(cfg: TrainConfig) -> Strategy:
    strategy = cfg.strategy
    if isinstance(strategy, DDPConfig):
        return build_ddp(cfg, strategy)
    if isinstance(strategy, FSDP2Config):
        return build_fsdp2(cfg, strategy)
    if isinstance(strategy, FSDPConfig):
        from fsdp_cli.builders.fsdp1 import build_fsdp1

        return build_fsdp1(cfg, strategy)
    if isinstance(strategy, ModelParallelConfig):
        return build_model_parallel(cfg, strategy)
    raise TypeError(f"unknown strategy config {type(strategy).__name__}")


def build_ddp(cfg: TrainConfig, strategy: DDPConfig) -> Strategy:
    from fsdp_cli.strategies.ddp import DDPStrategy

    ddp = DDPStrategy(
        process_group_backend=strategy.process_group_backend,
        timeout=timedelta(seconds=strategy.timeout_s),
        find_unused_parameters=strategy.find_unused_parameters,
        gradient_as_bucket_view=strategy.gradient_as_bucket_view,
        static_graph=strategy.static_graph,
        bucket_cap_mb=strategy.bucket_cap_mb,
        **ddp_buffer_sync(ddp_broadcasts_buffers(cfg, strategy)),
    )
    ddp.checkpoint_format = cfg.checkpoint.format.value
    return ddp


def ddp_broadcasts_buffers(cfg: TrainConfig, strategy: DDPConfig) -> bool:
    """``strategy.broadcast_buffers``; null: no per-step broadcast for the built-in Llama (its
    buffers are RoPE tables every rank computes alike), DDP's default for every other model."""
    if strategy.broadcast_buffers is not None:
        return strategy.broadcast_buffers
    return not isinstance(cfg.model, LlamaConfig)


def build_fsdp2(cfg: TrainConfig, strategy: FSDP2Config) -> Strategy:
    from fsdp_cli.strategies.fsdp2 import FSDP2Strategy

    return FSDP2Strategy(
        data_parallel_size=int(cfg.dp),
        tensor_parallel_size=cfg.tp,
        parallelize_fn=import_object(strategy.parallelize_fn, "strategy.parallelize_fn")
        if strategy.parallelize_fn
        else None,
        options=parallelize_options(cfg, strategy),
        replicate_size=strategy.replicate_size,
        save_distributed_checkpoint=cfg.checkpoint.format is CheckpointFormat.sharded,
        process_group_backend=strategy.process_group_backend,
        timeout=timedelta(seconds=strategy.timeout_s),
    )


def parallelize_options(cfg: TrainConfig, strategy: FSDP2Config) -> ParallelizeOptions:
    """The schema's settings, copied by name into ParallelizeOptions; only the two that become
    torch objects (the mixed-precision and offload policies) are translated."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    same_name = {f.name for f in dataclasses.fields(strategy)} & ParallelizeOptions.names()
    return ParallelizeOptions(
        **{name: getattr(strategy, name) for name in same_name if name != "mp_policy"},
        mp_policy=fsdp2_mp_policy(mixed_precision_dtypes(cfg.precision.name, strategy.mp_policy)),
        # Pinned host memory needs CUDA; on a CPU run the "offload" is a no-op move anyway.
        offload_policy=CPUOffloadPolicy(pin_memory=cfg.accelerator.value == "gpu")
        if strategy.cpu_offload
        else None,
        wrap=cfg.wrap,
    )


def build_model_parallel(cfg: TrainConfig, strategy: ModelParallelConfig) -> Strategy:
    from fsdp_cli.strategies.model_parallel import ModelParallelStrategy

    sharded = strategy.save_distributed_checkpoint
    if sharded is None:
        sharded = cfg.checkpoint.format is CheckpointFormat.sharded
    return ModelParallelStrategy(
        data_parallel_size=int(cfg.dp),
        tensor_parallel_size=cfg.tp,
        save_distributed_checkpoint=sharded,
        process_group_backend=strategy.process_group_backend,
        timeout=timedelta(seconds=strategy.timeout_s),
    )
