"""FSDP2 (``fully_shard``) per unit, then the root; gradient sync switched off while accumulating."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn
from torch.distributed.device_mesh import DeviceMesh


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    units: list[nn.Module],
    *,
    reshard_after_forward: bool | int = True,
    mp_policy: object | None = None,
    offload_policy: object | None = None,
) -> None:
    """``fully_shard`` each unit (children first) and then ``model`` itself.

    A 2-D ``dp_mesh`` (replicate x shard) gives HSDP: parameters are sharded along the second
    dimension and replicated along the first. ``reshard_after_forward`` applies to the units; the
    root keeps torch's default (``None``: gathered from its forward until its backward), unless it
    is an int (reshard to groups of that size) or False.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard

    kwargs = {
        "mesh": dp_mesh,
        "mp_policy": mp_policy or MixedPrecisionPolicy(),
        "offload_policy": offload_policy or OffloadPolicy(),
    }
    kwargs.update(_unsharded_nf4(model, dp_mesh))
    for index, unit in enumerate(units):
        # The last unit runs first in backward, so resharding it after forward would only make
        # backward gather it again straight away.
        last = index == len(units) - 1
        fully_shard(
            unit,
            reshard_after_forward=False if last and reshard_after_forward is True else reshard_after_forward,
            **kwargs,
        )
    # The root's own parameters (an embedding, a head, a LightningModule's layers beside its blocks)
    # are what a step uses around its forward: ``self.head(self(x))`` runs the head after the
    # root's forward has ended. Passing True would reshard them there, and cost an all-gather
    # again at the start of backward; torch's default (None) keeps the root gathered instead.
    root = None if reshard_after_forward is True else reshard_after_forward
    fully_shard(model, reshard_after_forward=root, **kwargs)


def _unsharded_nf4(model: nn.Module, dp_mesh: DeviceMesh) -> dict[str, object]:
    """With nothing to shard (one rank per shard group), QLoRA's NF4 weights stay plain parameters
    of their layers: torch 2.13's one-rank shortcut hands an all-gather extension its first inner
    tensor only, and NF4 has three."""
    from fsdp_cli.parallel.nf4 import is_quantized

    if dp_mesh.size(dp_mesh.ndim - 1) != 1:
        return {}
    quantized = {p for p in model.parameters() if is_quantized(p)}
    return {"ignored_params": quantized} if quantized else {}


def apply_fsdp_to_experts(experts: list[nn.Module], mesh: DeviceMesh, **kwargs: object) -> None:
    """Expert parallel: ``fully_shard`` each experts module (its parameters already split over the
    ep ranks) over ``mesh``, the other data-parallel ranks; before :func:`apply_fsdp`, so that the
    units holding them leave them alone. ``kwargs``: :func:`apply_fsdp`'s settings.

    Along the experts (dim 0) while each shard rank gets one at least; past that (more shard ranks
    than this rank's experts: 128 experts, ep=8, 64 shard ranks) along dim 1, or most ranks would
    hold no expert and a few a whole one each (torchtitan does the same)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard
    from torch.distributed.tensor import Shard

    reshard = kwargs.get("reshard_after_forward", True)
    mp_policy = kwargs.get("mp_policy") or MixedPrecisionPolicy()
    offload_policy = kwargs.get("offload_policy") or OffloadPolicy()
    for module in experts:
        local = next(module.parameters()).to_local().shape[0]  # (this rank's experts)
        dim = expert_shard_dim(local, mesh.shape[-1])
        fully_shard(
            module,
            mesh=mesh,
            reshard_after_forward=reshard,
            mp_policy=mp_policy,
            offload_policy=offload_policy,
            shard_placement_fn=lambda param, dim=dim: Shard(dim),
        )


def expert_shard_dim(local_experts: int, shard_ranks: int) -> int:
    """The dimension FSDP2 shards a rank's fused experts ``[local_experts, ...]`` along."""
    return 0 if shard_ranks <= local_experts else 1


@contextmanager
def gradient_sync_disabled(modules: list[nn.Module]) -> Iterator[None]:
    """Backward passes inside neither reduce-scatter nor (HSDP) all-reduce the gradients of these
    FSDP2 modules: they accumulate unsharded on each rank until a backward pass outside syncs
    them once (``set_requires_gradient_sync``, FSDP2's ``no_sync``)."""
    for module in modules:
        module.set_requires_gradient_sync(False, recurse=False)  # type: ignore[operator]
    try:
        yield
    finally:
        for module in modules:
            module.set_requires_gradient_sync(True, recurse=False)  # type: ignore[operator]


def fsdp2_modules(model: nn.Module) -> list[nn.Module]:
    """Every module ``fully_shard`` was applied to, the root included."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]
