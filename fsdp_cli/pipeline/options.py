"""The pipeline's settings, as plain (torch-free) options owned by this layer.

The CLI's ``pipeline`` group is :class:`PipelineOptions` and the top-level ``pp`` is its size,
so ``FSDP2Strategy(pipeline_parallel_size=..., pipeline=PipelineOptions(...))`` and YAML reach
the same fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from fsdp_cli.ranges import at_least


class CutPolicy(Enum):
    balanced = "balanced"
    """The same number of blocks on every stage (the first stages take the remainder)."""
    light_ends = "light_ends"
    """The first and last stages one block lighter each, for the embedding and the head."""
    explicit = "explicit"
    """At the block boundaries listed in ``pipeline.cuts``."""


@dataclass
class PipelineOptions:
    """How the model is cut into stages and which schedule drives them."""

    schedule: str = "1F1B"
    """A schedule torch ships, by its name: GPipe, 1F1B, Interleaved1F1B, LoopedBFS,
    InterleavedZeroBubble, ZBVZeroBubble, DualPipeV (case-insensitive)."""
    microbatches: int | None = field(default=None, metadata=at_least(1))
    """Micro-batches per step; each rank's batch is split into this many. null: pp x
    stages_per_rank (the fewest that fill the pipeline)."""
    stages_per_rank: int | None = field(default=None, metadata=at_least(1))
    """Stages each rank holds. null: 1 for single-stage schedules (GPipe, 1F1B), 2 for the
    looped, interleaved and V-shaped ones."""
    cut: CutPolicy = CutPolicy.balanced
    """balanced, light_ends or explicit: where the model's block list is cut into stages."""
    cuts: list[int] = field(default_factory=list, metadata=at_least(1))
    """With ``cut=explicit``: the block index each stage after the first starts at
    (pp x stages_per_rank - 1 increasing numbers)."""
