"""Clipping by the global gradient norm of sharded and tensor-parallel parameters.

``torch.nn.utils.clip_grad_norm_`` totals DTensor gradients of one mesh, but not gradients that
live on different meshes (tensor-parallel weights on the (dp, tp) mesh, other parameters on the
dp mesh only), and an FSDP1 root holds flat sharded gradients only it can total.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

_COUNTED_ELSEWHERE: set[int] = set()
"""``id`` of each parameter whose gradient another rank's copy already counts in the global norm
(a tied weight's copy on the last pipeline stage): clipped, not counted twice. Empty, as nearly
always, the norm looks at no parameter's identity."""


def count_elsewhere(param: nn.Parameter) -> None:
    """Leave ``param``'s gradient out of the global norm this rank adds (it still gets clipped)."""
    _COUNTED_ELSEWHERE.add(id(param))


def clip_grad_norm(
    wrapped: nn.Module | None, parameters: Any, max_norm: float, *, across: Any = None
) -> torch.Tensor:
    """Clip ``parameters``' gradients by their global norm across all shards; returns that norm
    (before clipping). ``wrapped``: the strategy's model (an FSDP1 root totals its own).
    ``across``: a process group whose ranks hold other parameters (pipeline stages): their
    squared norms are summed in."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

    if isinstance(wrapped, FSDP1):
        # FSDP1 holds flat sharded gradients: only the root knows how to total them.
        return wrapped.clip_grad_norm_(max_norm).detach()
    params = [p for p in parameters if p.grad is not None]
    # DTensor cannot mix meshes: total each mesh's gradients separately, then together.
    groups = list(_by_mesh(params).values())
    norms = []
    for group in groups:
        counted = [p.grad for p in group if not _COUNTED_ELSEWHERE or id(p) not in _COUNTED_ELSEWHERE]
        if not counted:
            continue
        norm = torch.nn.utils.get_total_norm(counted, foreach=True)
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    total = torch.linalg.vector_norm(torch.stack([n.float() for n in norms])) if norms else torch.zeros(())
    if across is not None:
        squared = total.square()
        torch.distributed.all_reduce(squared, group=across)
        total = squared.sqrt()
    for group in groups:
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=True)
    return total.detach()


def _by_mesh(params: list[nn.Parameter]) -> dict[Any, list[nn.Parameter]]:
    groups: dict[Any, list[nn.Parameter]] = {}
    for p in params:
        groups.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    return groups
