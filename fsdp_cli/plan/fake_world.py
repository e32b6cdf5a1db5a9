"""One CPU process as rank R of a world of any size: torch's ``fake`` process group.

Every collective on a fake process group returns at once without moving data, so the code a real
rank runs to build its mesh and shard its model (``init_device_mesh``, ``parallelize_module``,
``fully_shard``, FSDP1's wrapping) runs unchanged in one process, as any rank of 8 or 512.
Lightning's strategies read their rank and world size from a cluster environment:
:class:`FakeWorldEnvironment` gives them the fake world's.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from lightning.fabric.plugins.environments import ClusterEnvironment


@dataclass(frozen=True)
class FakeWorld:
    """``num_nodes`` x ``per_node`` ranks, seen from ``rank``."""

    num_nodes: int
    per_node: int
    rank: int

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.per_node


class FakeWorldEnvironment(ClusterEnvironment):
    """Lightning's view of the fake world: this process is ``world.rank``; nobody is launched."""

    def __init__(self, world: FakeWorld) -> None:
        self.world = world

    @property
    def creates_processes_externally(self) -> bool:
        return True  # Lightning must not start processes for the other ranks

    @property
    def main_address(self) -> str:
        return "127.0.0.1"  # never dialled: the fake process group needs no rendezvous

    @property
    def main_port(self) -> int:
        return 0

    @staticmethod
    def detect() -> bool:
        return False

    def world_size(self) -> int:
        return self.world.world_size

    def set_world_size(self, size: int) -> None:
        if size != self.world.world_size:
            raise ValueError(f"the strategy expects {size} ranks; the rehearsal has {self.world.world_size}")

    def global_rank(self) -> int:
        return self.world.rank

    def set_global_rank(self, rank: int) -> None:
        if rank != self.world.rank:
            raise ValueError(f"the strategy computed rank {rank}; the rehearsal is rank {self.world.rank}")

    def local_rank(self) -> int:
        return self.world.rank % self.world.per_node

    def node_rank(self) -> int:
        return self.world.rank // self.world.per_node


@contextmanager
def fake_process_group(world: FakeWorld) -> Iterator[None]:
    """The default process group is a fake one of ``world`` (torch's public ``fake`` backend) until
    the block ends; Lightning's rank-zero state (which the strategies set to this rank) is restored."""
    import torch.distributed as dist
    from lightning.pytorch.utilities import rank_zero
    from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

    if dist.is_initialized():
        raise RuntimeError("a rehearsal needs a process of its own: a process group is already initialised")
    saved = (getattr(rank_zero.rank_zero_only, "rank", 0), getattr(utils_rank_zero_only, "rank", 0))
    dist.init_process_group("fake", rank=world.rank, world_size=world.world_size)
    try:
        yield
    finally:
        from fsdp_cli.compat.torch_internals import clear_dtensor_caches

        dist.destroy_process_group()
        clear_dtensor_caches()  # (its meshes' groups are gone: the next world's must not get them)
        rank_zero.rank_zero_only.rank, utils_rank_zero_only.rank = saved
