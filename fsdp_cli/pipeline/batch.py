"""What a LightningModule's ``pipeline_inputs(batch)`` hands the schedule.

The common answer is a pair ``(inputs, targets)``: the first stage takes the inputs, the loss the
last stage's output and the targets, micro-batch by micro-batch. A batch that needs more returns
a :class:`PipelineBatch`: tensors every stage takes by keyword (the ``position_ids`` of packed
sequences: each stage's attention needs the document boundaries and rotary positions), and a loss
of its own for this batch (a labelled batch's token-weighted loss). Both are split into
micro-batches along the first dimension, as the inputs are.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class PipelineBatch:
    """One batch as the pipeline runs it."""

    inputs: torch.Tensor
    """The first stage's input (token ids ``[B, T]``)."""
    targets: torch.Tensor
    """What the loss compares the last stage's output with (``[B, ...]``)."""
    kwargs: dict[str, torch.Tensor] = field(default_factory=dict)
    """Tensors ``[B, ...]`` every stage's forward takes by keyword."""
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    """The loss of one micro-batch's (output, targets) for this batch; None: the module's
    ``pipeline_loss``. The step's loss is the mean over the micro-batches."""


def as_pipeline_batch(answer: Any) -> PipelineBatch:
    """``pipeline_inputs``'s answer as a :class:`PipelineBatch` (a pair becomes inputs and targets)."""
    if isinstance(answer, PipelineBatch):
        return answer
    inputs, targets = answer
    return PipelineBatch(inputs=inputs, targets=targets)
