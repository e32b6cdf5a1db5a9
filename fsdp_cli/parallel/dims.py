"""The sizes of a run's device mesh, checked once and turned into the mesh once.

``ParallelDims`` is pipeline parallel x data-parallel replicate x data-parallel shard x context
parallel x tensor parallel (its :data:`DIMENSIONS`, by name). The parent
process builds it from the config to check the layout before any rank starts (no torch import);
every rank builds the same object and asks it for the mesh, whose dimensions every layer then
takes by name: ``fully_shard`` the (replicate, shard x cp) part, tensor parallel the ``tp`` part,
context parallel the ``cp`` part, the data sampler the flattened data-parallel part (cp ranks
share a batch: each holds a slice of its sequences).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fsdp_cli.errors import ConfigError

EXPERT_SHARD, EP = "expert_data_parallel_shard", "expert_parallel"
"""Under expert parallel (ep > 1) the shard dimension is built as these two, the expert shard
outside cp and ep inside it (ep ranks are neighbours; :meth:`ParallelDims.mesh_sizes`), and
flattened back into :data:`DP_SHARD` for everything else: the
experts of each MoE layer split over ``ep``, their parameters sharded by FSDP2 over what remains
(``expert_data_parallel_shard``, and the replicas under HSDP) — torchtitan's dp -> ep borrowing."""
PP, DP_REPLICATE, DP_SHARD, CP, TP = (
    "pipeline_parallel",
    "data_parallel_replicate",
    "data_parallel_shard",
    "context_parallel",
    "tensor_parallel",
)
DIMENSIONS = (PP, DP_REPLICATE, DP_SHARD, CP, TP)
"""The mesh's dimensions, outermost first: a pipeline's stages talk least often (point to point,
once per micro-batch), tensor parallel most (every layer), so tp ranks are neighbours; context
parallel exchanges every attention's inputs and outputs, next to them (torchtitan's order)."""
DATA_PARALLEL = "data_parallel"
"""The flattened replicate x shard dimension (what Lightning's ModelParallelStrategy calls it)."""
SHARD_CP = "data_parallel_shard_cp"
"""The flattened shard x cp dimension: what FSDP2 shards parameters over under context parallel
(the cp ranks of a batch hold different tokens, so their gradients are averaged like dp's)."""
EXPERT_SHARD_CP = "expert_data_parallel_shard_cp"
"""The flattened expert shard x cp dimension: what FSDP2 shards the experts over under expert and
context parallel together (the cp ranks hold the same experts and route other tokens to them, so
the experts' gradients are averaged over them too, as every other parameter's)."""


@dataclass(frozen=True)
class SizeNames:
    """How errors name the sizes: the CLI's keys, or the strategy's constructor arguments."""

    dp: str = "dp"
    tp: str = "tp"
    replicate: str = "strategy.replicate_size"
    pp: str = "pp"
    cp: str = "cp"
    ep: str = "ep"


LIBRARY_NAMES = SizeNames(
    "data_parallel_size",
    "tensor_parallel_size",
    "replicate_size",
    "pipeline_parallel_size",
    "context_parallel_size",
    "expert_parallel_size",
)


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int = 1
    cp: int = 1
    ep: int = 1
    """Ranks the experts of each MoE layer are split over, borrowed from ``dp_shard`` (they see
    different batches and exchange tokens all-to-all); 1: every rank computes every expert."""
    _mesh: Any = field(default=None, init=False, repr=False, compare=False)
    _data_parallel_mesh: Any = field(default=None, init=False, repr=False, compare=False)
    _shard_cp_mesh: Any = field(default=None, init=False, repr=False, compare=False)
    _shard_mesh: Any = field(default=None, init=False, repr=False, compare=False)
    _expert_shard_cp_mesh: Any = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def resolve(
        cls,
        *,
        world_size: int,
        dp: int | None = None,
        tp: int = 1,
        replicate: int = 1,
        pp: int = 1,
        cp: int = 1,
        ep: int = 1,
        names: SizeNames = SizeNames(),
        world: str = "",
    ) -> ParallelDims:
        """Check the sizes against ``world_size`` (``dp=None``: the world size / (pp x cp x tp));
        every error names each factor. ``world`` says where the world size comes from (``devices=4 x num_nodes=1``)."""
        origin = f" ({world})" if world else ""
        _check_divides(names.pp, pp, world_size, f"must divide the world size {world_size}{origin}")
        if pp > 1:  # the other sizes split each stage's share of the world
            origin = f" (= {world_size} / {names.pp}={pp}{', ' + world if world else ''})"
            world_size //= pp
        _check_divides(names.tp, tp, world_size, f"must divide the world size {world_size}{origin}")
        if cp > 1:
            _check_divides(
                names.cp,
                cp,
                world_size // tp,
                f"must divide the world size {world_size}{origin} / {names.tp}={tp}",
            )
        dp = _data_parallel(names, dp, tp, cp, world_size, origin)
        _check_divides(
            names.replicate,
            replicate,
            dp,
            f"must divide {names.dp}={dp} (HSDP: replicate x shard = dp)",
            hint=f"{names.replicate}=1 is plain FSDP; {names.replicate}=num_nodes shards within each node",
        )
        if ep > 1:
            _check_divides(
                names.ep,
                ep,
                dp // replicate,
                f"must divide the data-parallel shard size {dp // replicate} "
                f"(= {names.dp}={dp} / {names.replicate}={replicate}): expert parallel borrows its ranks from it",
            )
        return cls(dp_replicate=replicate, dp_shard=dp // replicate, tp=tp, pp=pp, cp=cp, ep=ep)

    def for_world(self, world_size: int) -> ParallelDims:
        """These sizes as given (a fresh copy: each strategy builds its mesh on its own), after
        checking that the world the processes formed is the one they were decided for."""
        if self.world_size != world_size:
            cp = f"{self.cp}x" if self.cp_enabled else ""
            cp_factor = f" * cp({self.cp})" if self.cp_enabled else ""
            raise ConfigError(
                "dims",
                f"{self.pp}x{self.dp_replicate}x{self.dp_shard}x{cp}{self.tp}",
                f"pp({self.pp}) * replicate({self.dp_replicate}) * shard({self.dp_shard}){cp_factor} "
                f"* tp({self.tp}) != world size {world_size}",
                hint="decide the sizes for the world the processes form",
            )
        return ParallelDims(
            dp_replicate=self.dp_replicate,
            dp_shard=self.dp_shard,
            tp=self.tp,
            pp=self.pp,
            cp=self.cp,
            ep=self.ep,
        )

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    def sizes(self) -> dict[str, int]:
        """Each named dimension's size (:data:`DIMENSIONS` order)."""
        return dict(
            zip(DIMENSIONS, (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp), strict=True)
        )

    def mesh_sizes(self) -> dict[str, int]:
        """The built mesh's dimensions: :meth:`sizes`, with the shard dimension as (expert shard,
        ep) under expert parallel, ep inside cp: (expert shard, cp) is then one block of the mesh,
        ahead of ep, which the experts' 2-D (expert shard x cp, ep) layout needs (torch's DTensor
        flattens a layout's dimensions only in the root mesh's order)."""
        sizes = self.sizes()
        if not self.ep_enabled:
            return sizes
        return {
            PP: self.pp,
            DP_REPLICATE: self.dp_replicate,
            EXPERT_SHARD: self.dp_shard // self.ep,
            CP: self.cp,
            EP: self.ep,
            TP: self.tp,
        }

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def fsdp_enabled(self) -> bool:
        """Parameters are sharded (more than one rank per shard group)."""
        return self.dp_shard * self.cp > 1

    @property
    def hsdp_enabled(self) -> bool:
        return self.dp_replicate > 1

    # ------------------------------------------------------------------ the mesh (on a rank)

    def build_mesh(self, device_type: str) -> Any:
        """The 5-D mesh (pp, replicate, shard, cp, tp), built once; sizes of 1 are kept so that
        every dimension can be asked for by name."""
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            from fsdp_cli.compat.torch_internals import flatten_mesh

            sizes = self.mesh_sizes()
            mesh = init_device_mesh(device_type, tuple(sizes.values()), mesh_dim_names=tuple(sizes))
            # Flattened once and kept: slicing a flattened dimension out of the root mesh is
            # deprecated in torch.
            shard_dims = (EXPERT_SHARD, EP) if self.ep_enabled else (DP_SHARD,)
            if self.ep_enabled:
                self._shard_mesh = flatten_mesh(mesh[shard_dims], DP_SHARD)
            self._data_parallel_mesh = flatten_mesh(mesh[(DP_REPLICATE, *shard_dims)], DATA_PARALLEL)
            if self.cp_enabled:
                shard_cp = (EXPERT_SHARD, CP, EP) if self.ep_enabled else (DP_SHARD, CP)
                self._shard_cp_mesh = flatten_mesh(mesh[shard_cp], SHARD_CP)
            if self.cp_enabled and self.ep_enabled:
                self._expert_shard_cp_mesh = flatten_mesh(mesh[(EXPERT_SHARD, CP)], EXPERT_SHARD_CP)
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
        """What ``fully_shard`` shards over: (replicate, shard) for HSDP, else the shard dimension
        (shard x cp, flattened, under context parallel)."""
        shard = SHARD_CP if self.cp_enabled else DP_SHARD
        if not self.cp_enabled and not self.ep_enabled:
            return self.mesh[DP_REPLICATE, DP_SHARD] if self.hsdp_enabled else self.mesh[DP_SHARD]
        if not self.hsdp_enabled:
            return self._shard_cp_mesh if self.cp_enabled else self._shard_mesh
        from fsdp_cli.compat.torch_internals import slice_beside_flattened

        return slice_beside_flattened(self.mesh, (DP_REPLICATE, shard))

    @property
    def ep_mesh(self) -> Any:
        """The ranks one MoE layer's experts are split over (they exchange tokens all-to-all)."""
        return self.mesh[EP]

    @property
    def expert_fsdp_mesh(self) -> Any:
        """What ``fully_shard`` shards the experts over (each already split over ep): the rest of
        the data-parallel ranks (replicate x expert shard under HSDP), and the cp ranks under
        context parallel (expert shard x cp, flattened)."""
        if not self.cp_enabled:
            return self.mesh[DP_REPLICATE, EXPERT_SHARD] if self.hsdp_enabled else self.mesh[EXPERT_SHARD]
        if not self.hsdp_enabled:
            return self._expert_shard_cp_mesh
        from fsdp_cli.compat.torch_internals import slice_beside_flattened

        return slice_beside_flattened(self.mesh, (DP_REPLICATE, EXPERT_SHARD_CP))

    @property
    def tp_mesh(self) -> Any:
        return self.mesh[TP]

    @property
    def cp_mesh(self) -> Any:
        """The ranks that split each sequence of one batch (same data, same tp position)."""
        return self.mesh[CP]

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


def _data_parallel(names: SizeNames, dp: int | None, tp: int, cp: int, world_size: int, origin: str) -> int:
    """``dp`` (None: what the other sizes leave of ``world_size``), checked to fill it exactly."""
    dp = world_size // (tp * cp) if dp is None else dp
    if dp * tp * cp != world_size:
        by, given = (f" * {names.cp}({cp})", f", {names.cp}={cp}") if cp > 1 else ("", "")
        raise ConfigError(
            names.dp,
            dp,
            f"{names.dp}({dp}) * {names.tp}({tp}){by} != world size {world_size}{origin}",
            allowed=f"{names.dp}={world_size // (tp * cp)} for {names.tp}={tp}{given}",
            hint=f"leave {names.dp}=auto to derive it from the world size",
        )
    return dp


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
