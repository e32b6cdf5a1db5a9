"""The sizes of a run's device mesh, checked once and turned into the mesh once.

``ParallelDims`` is pipeline parallel x data-parallel replicate x data-parallel shard x tensor
parallel (its :data:`DIMENSIONS`, by name). The parent
process builds it from the config to check the layout before any rank starts (no torch import);
every rank builds the same object and asks it for the mesh, whose dimensions every layer then
takes by name: ``fully_shard`` the (replicate, shard) part, tensor parallel the ``tp`` part, the
data sampler and the loss reduction the flattened data-parallel part.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fsdp_cli.errors import ConfigError

PP, DP_REPLICATE, DP_SHARD, TP = (
    "pipeline_parallel",
    "data_parallel_replicate",
    "data_parallel_shard",
    "tensor_parallel",
)
DIMENSIONS = (PP, DP_REPLICATE, DP_SHARD, TP)
"""The mesh's dimensions, outermost first: a pipeline's stages talk least often (point to point,
once per micro-batch), tensor parallel most (every layer), so tp ranks are neighbours."""
DATA_PARALLEL = "data_parallel"
"""The flattened replicate x shard dimension (what Lightning's ModelParallelStrategy calls it)."""


@dataclass(frozen=True)
class SizeNames:
    """How errors name the sizes: the CLI's keys, or the strategy's constructor arguments."""

    dp: str = "dp"
    tp: str = "tp"
    replicate: str = "strategy.replicate_size"
    pp: str = "pp"


LIBRARY_NAMES = SizeNames(
    "data_parallel_size", "tensor_parallel_size", "replicate_size", "pipeline_parallel_size"
)


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int = 1
    _mesh: Any = field(default=None, init=False, repr=False, compare=False)
    _data_parallel_mesh: Any = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def resolve(
        cls,
        *,
        world_size: int,
        dp: int | None = None,
        tp: int = 1,
        replicate: int = 1,
        pp: int = 1,
        names: SizeNames = SizeNames(),
        world: str = "",
    ) -> ParallelDims:
        """Check the sizes against ``world_size`` (``dp=None``: the world size / (pp x tp)); every
        error names each factor. ``world`` says where the world size comes from (``devices=4 x num_nodes=1``)."""
        origin = f" ({world})" if world else ""
        _check_divides(names.pp, pp, world_size, f"must divide the world size {world_size}{origin}")
        if pp > 1:  # the other sizes split each stage's share of the world
            origin = f" (= {world_size} / {names.pp}={pp}{', ' + world if world else ''})"
            world_size //= pp
        _check_divides(names.tp, tp, world_size, f"must divide the world size {world_size}{origin}")
        dp = world_size // tp if dp is None else dp
        if dp * tp != world_size:
            raise ConfigError(
                names.dp,
                dp,
                f"{names.dp}({dp}) * {names.tp}({tp}) != world size {world_size}{origin}",
                allowed=f"{names.dp}={world_size // tp} for {names.tp}={tp}",
                hint=f"leave {names.dp}=auto to derive it from the world size",
            )
        _check_divides(
            names.replicate,
            replicate,
            dp,
            f"must divide {names.dp}={dp} (HSDP: replicate x shard = dp)",
            hint=f"{names.replicate}=1 is plain FSDP; {names.replicate}=num_nodes shards within each node",
        )
        return cls(dp_replicate=replicate, dp_shard=dp // replicate, tp=tp, pp=pp)

    def for_world(self, world_size: int) -> ParallelDims:
        """These sizes as given (a fresh copy: each strategy builds its mesh on its own), after
        checking that the world the processes formed is the one they were decided for."""
        if self.world_size != world_size:
            raise ConfigError(
                "dims",
                f"{self.pp}x{self.dp_replicate}x{self.dp_shard}x{self.tp}",
                f"pp({self.pp}) * replicate({self.dp_replicate}) * shard({self.dp_shard}) * tp({self.tp}) "
                f"!= world size {world_size}",
                hint="decide the sizes for the world the processes form",
            )
        return ParallelDims(dp_replicate=self.dp_replicate, dp_shard=self.dp_shard, tp=self.tp, pp=self.pp)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    def sizes(self) -> dict[str, int]:
        """Each named dimension's size (:data:`DIMENSIONS` order)."""
        return dict(zip(DIMENSIONS, (self.pp, self.dp_replicate, self.dp_shard, self.tp), strict=True))

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def fsdp_enabled(self) -> bool:
        """Parameters are sharded (more than one rank per shard group)."""
        return self.dp_shard > 1

    @property
    def hsdp_enabled(self) -> bool:
        return self.dp_replicate > 1

    # ------------------------------------------------------------------ the mesh (on a rank)

    def build_mesh(self, device_type: str) -> Any:
        """The 4-D mesh (pp, replicate, shard, tp), built once; sizes of 1 are kept so that every
        dimension can be asked for by name."""
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            from fsdp_cli.compat.torch_internals import flatten_mesh

            sizes = self.sizes()
            mesh = init_device_mesh(device_type, tuple(sizes.values()), mesh_dim_names=tuple(sizes))
            # Flattened once and kept: slicing a flattened dimension out of the root mesh is
            # deprecated in torch.
            self._data_parallel_mesh = flatten_mesh(mesh[DP_REPLICATE, DP_SHARD], DATA_PARALLEL)
            self._mesh = mesh
        return self._mesh

    def build_fsdp1_mesh(self, device_type: str, *, hybrid: bool = False) -> Any:
        """FSDP1's mesh, built once: (replicate, shard) for HYBRID_SHARD, else a 1-D (shard,) mesh
        (which makes FSDP1's sharded state dicts DTensors, as FSDP2's are). ``hybrid``: 2-D even
        with one replica (HYBRID_SHARD on one node), as FSDP1's hybrid strategies refuse a 1-D mesh."""
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            # (NO_SHARD's sizes are world x 1, but FSDP1 takes one dimension for it.)
            if hybrid:
                shape, dim_names = (self.dp_replicate, self.dp_shard), ("replicate", "shard")
            else:
                shape, dim_names = (self.dp,), ("shard",)
            self._mesh = init_device_mesh(device_type, shape, mesh_dim_names=dim_names)
        return self._mesh

    @property
    def mesh(self) -> Any:
        if self._mesh is None:
            raise RuntimeError("ParallelDims.build_mesh() has not been called on this rank")
        return self._mesh

    @property
    def fsdp_mesh(self) -> Any:
        """What ``fully_shard`` shards over: (replicate, shard) for HSDP, else the shard dimension."""
        return self.mesh[DP_REPLICATE, DP_SHARD] if self.hsdp_enabled else self.mesh[DP_SHARD]

    @property
    def tp_mesh(self) -> Any:
        return self.mesh[TP]

    @property
    def pp_mesh(self) -> Any:
        """The ranks holding the other stages of this rank's pipeline (same data and tp position)."""
        return self.mesh[PP]

    @property
    def data_parallel_mesh(self) -> Any:
        """Every rank that sees a different batch: replicate x shard, flattened."""
        if self._data_parallel_mesh is None:
            raise RuntimeError("ParallelDims.build_mesh() has not been called on this rank")
        return self._data_parallel_mesh


def _check_divides(key: str, size: int, whole: int, problem: str, *, hint: str | None = None) -> None:
    """``size`` is at least 1 and divides ``whole``; else the one line naming ``key``, listing the
    sizes that would (the hint, unless given: the nearest of them below, or a device count change)."""
    if size >= 1 and whole % size == 0:
        return
    divisors = _divisors(whole)
    nearest = max(d for d in divisors if d <= max(size, 1))
    raise ConfigError(
        key,
        size,
        problem,
        allowed=", ".join(map(str, divisors)),
        hint=hint or f"use {key}={nearest} or change devices",
    )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
