"""A LightningModule that says how a pipeline runs it (the hooks of docs/strategies.md)."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from tests.assets.custom_models import TinyLM

VOCAB, SEQ = 64, 16


class PipelinedLM(L.LightningModule):
    """TinyLM (embedding, 4 residual blocks, head) trained on fixed random tokens; its model is
    cut by its block list, its batches and loss come from the two pipeline hooks."""

    def __init__(self) -> None:
        super().__init__()
        self.model: nn.Module | None = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = TinyLM(vocab_size=VOCAB, hidden=16, layers=4)
            self.model.init_weights = self._init_weights  # layout-independent: by name and seed

    def _init_weights(self, buffer_device: Any = None) -> None:
        from fsdp_cli.models.init import seeded_normal_

        for name, param in self.model.named_parameters():
            seeded_normal_(param, std=0.2, seed=0, name=name)

    def pipeline_inputs(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        (tokens,) = batch
        return tokens[:, :-1], tokens[:, 1:]

    def pipeline_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = self.pipeline_inputs(batch)
        return self.pipeline_loss(self.model(inputs), targets)

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = self.pipeline_inputs(batch)
        loss = self.pipeline_loss(self.model(inputs), targets)
        self.log("val_loss", loss, sync_dist=True)  # (under pp the strategy logs it)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> Any:
        tokens = torch.randint(0, VOCAB, (64, SEQ + 1), generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=8)

    def val_dataloader(self) -> Any:
        tokens = torch.randint(0, VOCAB, (16, SEQ + 1), generator=torch.Generator().manual_seed(1))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=8)
