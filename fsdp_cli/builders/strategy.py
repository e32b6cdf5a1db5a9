"""Strategy builders: a resolved run -> its Lightning strategy, one per registry entry
(:mod:`fsdp_cli.config.strategies`), found by the entry's name in :data:`BUILDERS`."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

from lightning.pytorch.strategies import Strategy

from fsdp_cli.builders.checkpointing import checkpointing
from fsdp_cli.builders.fsdp1 import build_fsdp1
from fsdp_cli.builders.precision import fsdp2_mp_policy
from fsdp_cli.compat.torch_internals import ddp_buffer_sync
from fsdp_cli.config.resolved import ResolvedRun
from fsdp_cli.dotted import import_object
from fsdp_cli.parallel.parallelize import ParallelizeOptions


def build_strategy(run: ResolvedRun) -> Strategy:
    """The Lightning strategy of the run's registry entry (:data:`BUILDERS`)."""
    return BUILDERS[run.entry.name](run)


def build_ddp(run: ResolvedRun) -> Strategy:
    from fsdp_cli.strategies.ddp import DDPStrategy

    strategy = run.cfg.strategy
    return DDPStrategy(
        process_group_backend=strategy.process_group_backend,
        timeout=timedelta(seconds=strategy.timeout_s),
        find_unused_parameters=strategy.find_unused_parameters,
        gradient_as_bucket_view=strategy.gradient_as_bucket_view,
        static_graph=strategy.static_graph,
        bucket_cap_mb=strategy.bucket_cap_mb,
        **ddp_buffer_sync(ddp_broadcasts_buffers(run)),
        **checkpointing(run),
    )


def ddp_broadcasts_buffers(run: ResolvedRun) -> bool:
    """``strategy.broadcast_buffers``; null: no per-step broadcast for a model whose buffers every
    rank computes alike (the built-in Llama's RoPE tables: its kind's ``recomputes_buffers``),
    DDP's default for every other model."""
    strategy = run.cfg.strategy
    if strategy.broadcast_buffers is not None:
        return strategy.broadcast_buffers
    return not run.model_kind.recomputes_buffers


def build_fsdp2(run: ResolvedRun) -> Strategy:
    from fsdp_cli.strategies.fsdp2 import FSDP2Strategy

    strategy = run.cfg.strategy
    return FSDP2Strategy(
        dims=run.dims,
        parallelize_fn=import_object(strategy.parallelize_fn, "strategy.parallelize_fn")
        if strategy.parallelize_fn
        else None,
        options=parallelize_options(run),
        pipeline=run.cfg.pipeline,
        process_group_backend=strategy.process_group_backend,
        timeout=timedelta(seconds=strategy.timeout_s),
        **checkpointing(run),
    )


def parallelize_options(run: ResolvedRun) -> ParallelizeOptions:
    """The schema's parallelize settings as they are, plus the objects they become: the
    mixed-precision policy in effect and the offload policy."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    strategy = run.cfg.strategy
    return ParallelizeOptions.from_settings(
        strategy,
        mp_policy=fsdp2_mp_policy(run.precision),
        # Pinned host memory needs CUDA; on a CPU run the "offload" is a no-op move anyway.
        offload_policy=CPUOffloadPolicy(pin_memory=run.layout.on_gpu) if strategy.cpu_offload else None,
        wrap=run.cfg.wrap,
        context_parallel_impl=run.cfg.cp_impl,
    )


def build_model_parallel(run: ResolvedRun) -> Strategy:
    from fsdp_cli.strategies.model_parallel import ModelParallelStrategy

    strategy = run.cfg.strategy
    return ModelParallelStrategy(
        data_parallel_size=run.layout.dp,
        tensor_parallel_size=run.layout.tp,
        process_group_backend=strategy.process_group_backend,
        timeout=timedelta(seconds=strategy.timeout_s),
        **checkpointing(run),
    )


BUILDERS: dict[str, Callable[[ResolvedRun], Strategy]] = {
    "ddp": build_ddp,
    "fsdp2": build_fsdp2,
    "fsdp": build_fsdp1,
    "model_parallel": build_model_parallel,
}
"""Each strategy's builder by its registry entry's name (:data:`fsdp_cli.config.strategies.ENTRIES`)."""
