"""Where a block list is cut into stages (torch-free): block index ranges, one per stage."""

from __future__ import annotations

from fsdp_cli.pipeline.options import CutPolicy


def stage_blocks(n_blocks: int, n_stages: int, policy: CutPolicy, cuts: list[int] = ()) -> list[range]:
    """The blocks of each stage, in stage order. The caller has checked the sizes
    (:func:`cut_problem`)."""
    if policy is CutPolicy.explicit:
        starts = [0, *cuts]
    else:
        starts = _even_starts(n_blocks, n_stages, light_ends=policy is CutPolicy.light_ends)
    ends = [*starts[1:], n_blocks]
    return [range(s, e) for s, e in zip(starts, ends, strict=True)]


def _even_starts(n_blocks: int, n_stages: int, *, light_ends: bool) -> list[int]:
    """Stage sizes as even as they go; with ``light_ends`` the two end stages count as holding
    one block more (the embedding, the head) when there are blocks enough to give."""
    extra = 2 if light_ends and n_blocks >= n_stages + 2 and n_stages > 1 else 0
    weights = n_blocks + extra
    sizes = [weights // n_stages + (1 if s < weights % n_stages else 0) for s in range(n_stages)]
    if extra:
        sizes[0] -= 1
        sizes[-1] -= 1
    starts, at = [], 0
    for size in sizes:
        starts.append(at)
        at += size
    return starts


def cut_problem(n_blocks: int, n_stages: int, policy: CutPolicy, cuts: list[int] = ()) -> str | None:
    """Why the blocks cannot be cut so (None: they can); worded for a one-line error."""
    if n_blocks < n_stages:
        return f"the model has {n_blocks} blocks, fewer than pp x stages_per_rank = {n_stages} stages"
    if policy is not CutPolicy.explicit:
        return None
    if len(cuts) != n_stages - 1:
        return f"{n_stages} stages need {n_stages - 1} cut points, got {len(cuts)}"
    bounds = [0, *cuts, n_blocks]
    if any(a >= b for a, b in zip(bounds, bounds[1:], strict=False)):
        return f"cut points must increase strictly within 1..{n_blocks - 1} (every stage holds a block)"
    return None
