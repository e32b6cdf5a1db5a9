"""A LightningModule written for lightning_fairscale-era manual wrapping: ``wrap()`` in
``configure_model`` (formerly ``configure_sharded_model``). Under FSDP each block becomes a unit
with the strategy's settings; under DDP or one device ``wrap`` is a no-op and the module runs unchanged."""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp.wrap import wrap

from tests.assets.custom_models import TinyBlock


class ManuallyWrappedLM(L.LightningModule):
    """``optimizer_params``: ``trainer_model`` (the documented way), ``self``, or ``captured``
    (parameters collected in ``__init__``, before FSDP replaced them: a mistake to report)."""

    def __init__(
        self,
        vocab_size: int = 256,
        hidden: int = 32,
        layers: int = 2,
        optimizer_params: str = "trainer_model",
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, hidden)
        self.blocks = nn.ModuleList(TinyBlock(hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab_size)
        self.optimizer_params = optimizer_params
        self.captured = list(self.parameters())

    def configure_model(self) -> None:
        for i, block in enumerate(self.blocks):
            self.blocks[i] = wrap(block)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self(batch[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = {
            "trainer_model": lambda: self.trainer.model.parameters(),
            "self": lambda: self.parameters(),
            "captured": lambda: self.captured,
        }[self.optimizer_params]()
        return torch.optim.AdamW(params, lr=3e-3)
