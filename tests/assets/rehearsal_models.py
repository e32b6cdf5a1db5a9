"""User models with a tensor-parallel plan that a layout can break in ways the memory plan cannot
see (it knows nothing of heads or module names): what ``fsdp-plan --rehearse`` must refuse."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel


class HeadsBlock(nn.Module):
    """Multi-head mixing over the hidden size, written like attention: ``-1`` heads of ``head_dim``."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.head_dim = hidden // heads
        self.proj_in = nn.Linear(hidden, hidden, bias=False)
        self.proj_out = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.proj_in(x).view(b, t, -1, self.head_dim)  # needs whole heads on every tp rank
        h = torch.softmax(h, dim=-1).flatten(2)
        return x + self.proj_out(h)


class HeadsLM(nn.Module):
    """``heads`` heads: a tensor-parallel size that does not divide them cannot split them."""

    def __init__(self, vocab_size: int = 256, hidden: int = 48, heads: int = 3, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, hidden)
        self.blocks = nn.ModuleList(HeadsBlock(hidden, heads) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)

    def tp_plan(self, *, sequence_parallel: bool) -> dict[str, Any]:
        plan: dict[str, Any] = {}
        for i in range(len(self.blocks)):
            plan[f"blocks.{i}.proj_in"] = ColwiseParallel()
            plan[f"blocks.{i}.proj_out"] = RowwiseParallel()
        return plan


class MisnamedPlanLM(HeadsLM):
    """A plan naming a module the model does not have (``proj_inn``)."""

    def tp_plan(self, *, sequence_parallel: bool) -> dict[str, Any]:
        plan = super().tp_plan(sequence_parallel=sequence_parallel)
        plan["blocks.1.proj_inn"] = plan.pop("blocks.1.proj_in")
        return plan


class ValueDependentLM(HeadsLM):
    """Its forward reads a tensor's value (``.item()``): fake tensors have none."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.max().item() >= self.embed.num_embeddings:
            raise ValueError("token id outside the vocabulary")
        return super().forward(input_ids)
