"""A LightningModule written for Lightning's ModelParallelStrategy: it parallelizes itself in
``configure_model`` from ``self.device_mesh`` (tensor parallel, then FSDP2), as Lightning's docs show."""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn


class FeedForwardLM(L.LightningModule):
    def __init__(self, vocab_size: int = 256, hidden: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, hidden)
        self.w1 = nn.Linear(hidden, 4 * hidden, bias=False)
        self.w2 = nn.Linear(4 * hidden, hidden, bias=False)
        self.head = nn.Linear(hidden, vocab_size, bias=False)

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        tp_mesh = self.device_mesh["tensor_parallel"]
        if tp_mesh.size() > 1:
            parallelize_module(self, tp_mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
        fully_shard(self, mesh=self.device_mesh["data_parallel"])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        h = h + self.w2(F.gelu(self.w1(h)))
        return self.head(h)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self(batch[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)
