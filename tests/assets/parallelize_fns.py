"""A user parallelize_fn (NeMo's keyword calling convention) for strategy.parallelize_fn tests."""

from __future__ import annotations

import os
from pathlib import Path

from torch.distributed.fsdp import fully_shard


def shard_whole_model_only(model, device_mesh=None, mp_policy=None, offload_policy=None, **_unused):
    """One FSDP unit for the whole model; leaves a marker so the test can see it ran on every rank."""
    fully_shard(model, mesh=device_mesh["data_parallel_shard"], mp_policy=mp_policy)
    marker = os.environ.get("PARALLELIZE_FN_MARKER")
    if marker:
        Path(f"{marker}.{os.environ.get('RANK', '0')}").touch()
