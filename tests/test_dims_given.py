"""Mesh sizes are decided once, by the parent: the strategies take the run's dims as they are,
and the sizes-only constructor (for library users) reaches the same dims through the same code."""

from __future__ import annotations

import pytest
from conftest import composed, run_of
from lightning.fabric.plugins.environments import LightningEnvironment

from fsdp_cli.builders.strategy import build_strategy
from fsdp_cli.errors import ConfigError
from fsdp_cli.parallel.dims import ParallelDims


def _in_world(strategy, world_size: int):
    strategy.cluster_environment = LightningEnvironment()
    strategy.cluster_environment.set_world_size(world_size)
    return strategy


def test_fsdp2_takes_the_dims_the_run_decided() -> None:
    from fsdp_cli.strategies.fsdp2 import FSDP2Strategy

    run = run_of(composed("strategy=fsdp2", "accelerator=cpu", "devices=4", "strategy.replicate_size=2"))
    strategy = _in_world(build_strategy(run), 4)
    assert strategy.given_dims == run.dims == ParallelDims(dp_replicate=2, dp_shard=2, tp=1)
    assert strategy._resolve_dims() == run.dims
    by_sizes = _in_world(FSDP2Strategy(data_parallel_size=4, replicate_size=2), 4)
    assert by_sizes._resolve_dims() == run.dims
    with pytest.raises(ConfigError, match=r"replicate\(2\) \* shard\(2\) \* tp\(1\) != world size 8"):
        _in_world(build_strategy(run), 8)._resolve_dims()


def test_fsdp1_takes_the_hybrid_split_the_run_decided() -> None:
    run = run_of(
        composed(
            "strategy=fsdp",
            "accelerator=cpu",
            "devices=4",
            "strategy.sharding_strategy=HYBRID_SHARD",
            "strategy.hybrid_shard_size=2",
        )
    )
    strategy = build_strategy(run)
    assert strategy.given_dims == run.dims == ParallelDims(dp_replicate=2, dp_shard=2, tp=1)
    assert strategy.kwargs["device_mesh"] is not None  # Lightning accepts HYBRID_SHARD: a mesh is coming
