"""Full (one-file) checkpoints of a pipeline-parallel model: every stage's state brought to global
rank 0 under the whole model's names, and a full file's state cut back to the stages a rank holds.

Why this way. A pp=1 full save assembles each sharded tensor in turn (``full_tensor``) and keeps
it on rank 0 only, on CPU (:mod:`fsdp_cli.checkpoint.distributed`), as Lightning's FSDP2 /
ModelParallel full-state path does. Under pp, rank 0 holds only its own stages, so the same is
done at every pipeline position: each stage's tensors are assembled over that stage's own data and
tensor-parallel ranks and kept by the stage's *writer*, the rank at data and tensor-parallel
position 0, which sits in global rank 0's pipeline group. The writers then bring them to rank 0
over that group, one pipeline rank after the other and one tensor at a time (the layout first, as
a small object; then ``send`` / ``recv`` of each tensor, on the process group's device): a writer
holds one tensor of its stage at a time, rank 0 the whole model on CPU, as at pp=1, and rank 0
writes the one file through the same atomic CheckpointIO. (Each writer writing a part file and
rank 0 merging them would read every part back into rank 0 anyway, and leave parts to clean up
after a failure.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from fsdp_cli.checkpoint.optimizer_layout import is_numbered, named_by_index


@dataclass(frozen=True)
class _Slot:
    """A tensor of a later stage still to be received: what rank 0 allocates for it."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def gather_stages(tree: dict[str, Any], *, group: Any, writer: bool, device: torch.device) -> dict[str, Any]:
    """``tree`` (a state dict of this rank's stages, its DTensors sharded over the stage's ranks)
    as the whole pipeline's, CPU tensors, on global rank 0; ``{}`` on every other rank. Every rank
    calls it (the assembling is collective within each stage). ``group``: this rank's pipeline
    group; ``writer``: this rank keeps its stage's tensors (data and tensor-parallel position 0)."""
    if dist.get_rank(group) != 0:
        _send(tree, group=group, writer=writer, device=device)
        return {}
    whole = _mapped(tree, lambda t: _kept(_assembled(t), writer))
    if not writer:
        return {}
    for source in range(1, dist.get_world_size(group)):
        _merge(whole, _receive(group, source, device))
    return whole


def _send(tree: dict[str, Any], *, group: Any, writer: bool, device: torch.device) -> None:
    """A later pipeline rank's part: its layout, then each tensor as soon as it is assembled."""
    if writer:
        layout = _mapped(tree, lambda t: _Slot(tuple(t.shape), t.dtype))
        dist.send_object_list([layout], group=group, group_dst=0, device=_object_device(device))

    def send_one(tensor: torch.Tensor) -> None:
        whole = _assembled(tensor)  # (collective over the stage's ranks: the writer's peers too)
        if writer:
            dist.send(whole.detach().to(device).contiguous(), group=group, group_dst=0)

    _mapped(tree, send_one)


def _receive(group: Any, source: int, device: torch.device) -> dict[str, Any]:
    box: list[Any] = [None]
    dist.recv_object_list(box, group=group, group_src=source, device=_object_device(device))

    def receive_one(slot: _Slot) -> torch.Tensor:
        buffer = torch.empty(slot.shape, dtype=slot.dtype, device=device)
        dist.recv(buffer, group=group, group_src=source)
        return buffer.to("cpu")

    return _mapped(box[0], receive_one, leaf=_Slot)


def _kept(tensor: torch.Tensor, writer: bool) -> torch.Tensor | None:
    """A copy on CPU for the writer (assembled on every rank of the stage: a collective)."""
    return tensor.detach().to("cpu", copy=True) if writer else None


def _object_device(device: torch.device) -> torch.device | None:
    """Where torch stages a pickled object for the group's backend (None: its own choice)."""
    return device if device.type != "cpu" else None


def _assembled(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _mapped(tree: Any, fn: Callable[[Any], Any], leaf: type = torch.Tensor) -> Any:
    """``tree`` with ``fn`` applied to each ``leaf``, in the same order on every rank (dicts in
    their insertion order, then lists)."""
    if isinstance(tree, dict):
        return {k: _mapped(v, fn, leaf) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_mapped(v, fn, leaf) for v in tree]
    return fn(tree) if isinstance(tree, leaf) else tree


def _merge(into: dict[str, Any], other: Mapping[str, Any]) -> None:
    """``other``'s entries added to ``into`` (the stages' names are disjoint; dicts merge deeper)."""
    for key, value in other.items():
        if isinstance(into.get(key), dict) and isinstance(value, dict):
            _merge(into[key], value)
        else:
            into[key] = value


# ---------------------------------------------------------------- loading a full file into stages


def unexpected_keys(saved: Iterable[str], own: Iterable[str], group: Any) -> list[str]:
    """The keys of a full file that no stage of this pipeline holds (every rank calls it)."""
    held: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(held, sorted(own), group=group)
    everywhere = {key for keys in held for key in keys}
    return sorted(set(saved) - everywhere)


def stage_optimizer_state(
    state: Mapping[str, Any], whole_names: list[str], current_groups: list[list[str]]
) -> dict[str, Any]:
    """A full file's optimizer state (numbered over the whole model, as a pp=1 full save numbers
    it, or named) restricted to the parameters of this rank's stages (``current_groups``: the
    names in each of its optimizer's param groups), keyed by name."""
    named = named_by_index(state, whole_names) if is_numbered(state) else dict(state)
    own = {name for group in current_groups for name in group}
    groups = [{**g, "params": [n for n in g["params"] if n in own]} for g in named["param_groups"]]
    return {"state": {n: v for n, v in named["state"].items() if n in own}, "param_groups": groups}
