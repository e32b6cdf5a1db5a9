"""The loss of ``data=chat`` batches, for fsdp-train's own module and for a LightningModule of
yours trained on them (``model=custom model._target_=my_pkg.MyModule data=chat ...``).

A chat batch is a dict (:mod:`fsdp_cli.data.chat_dataset`): ``input_ids`` and ``labels``
``[micro_batch, seq_len]`` (the labels already the next tokens, -100 outside the assistant's
turns and at padding), ``position_ids`` with ``data.packing=true`` (restarting at 0 at each
packed example: pass them to the model so that its attention keeps the examples apart), and
``step_supervised`` / ``step_sequences``, the supervised labels and the sequences of the whole
global batch the micro-batch belongs to (every rank knows them from the data, no collective).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE = -100
"""The label cross-entropy skips (PyTorch's and transformers' ``ignore_index``)."""


def token_weight(batch: dict[str, torch.Tensor], dtype: torch.dtype, *, slices: int = 1) -> torch.Tensor:
    """What a micro-batch's summed token losses are multiplied by so that the step trains on the
    mean over the global batch's supervised tokens: ``step_sequences / (step_supervised x
    micro_batch)`` (Lightning then divides by the accumulation and the strategy averages over the
    data-parallel ranks); ``slices``: context-parallel ranks each summing a slice of the sequences."""
    micro = batch["input_ids"].shape[0]
    return slices * batch["step_sequences"][0].to(dtype) / (batch["step_supervised"][0] * micro)


def chat_loss(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The training loss of a ``data=chat`` batch, for ``training_step`` to return: the
    cross-entropy of ``logits [micro_batch, seq_len, vocab]`` against ``batch["labels"]``, summed
    (in fp32 at least) and weighted by :func:`token_weight`. Returned by every rank, its gradient
    is that of the mean over the supervised tokens of the whole global batch, on any layout and
    micro-batching, as one process computes it; a plain per-micro-batch mean would weigh one rank's
    few supervised tokens as much as another's many. metrics.jsonl logs that global mean."""
    wide = logits.float() if logits.dtype in (torch.bfloat16, torch.float16) else logits
    labels = batch["labels"].flatten()
    total = F.cross_entropy(wide.flatten(0, 1), labels, ignore_index=IGNORE, reduction="sum")
    return total * token_weight(batch, total.dtype)
