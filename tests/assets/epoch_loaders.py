"""A LightningModule whose own DataLoader resumes mid-epoch the way Lightning asks loaders to:
``state_dict`` / ``load_state_dict`` (the interface torchdata's StatefulDataLoader implements)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader

from tests.assets.own_loaders import VOCAB, Arithmetic, next_token_loss


class ResumableDataLoader(DataLoader):
    """Counts the batches it has served in the current pass; after ``load_state_dict`` the next
    pass skips that many (the same ones: the sampler's order depends on the epoch only)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.served = 0
        self.skip = 0

    def __iter__(self) -> Iterator[Any]:
        skip, self.skip = self.skip, 0
        self.served = skip
        for index, batch in enumerate(super().__iter__()):
            if index >= skip:
                self.served += 1
                yield batch

    def state_dict(self) -> dict[str, int]:
        return {"served": self.served}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.skip = state_dict["served"]


class ResumableLoaderLM(L.LightningModule):
    """12 shuffled samples in batches of 2: an epoch is 3 steps on 2 data-parallel ranks."""

    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, hidden)
        self.mix = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.embed(input_ids))))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return next_token_loss(self, batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.trainer.model.parameters(), lr=3e-2)

    def train_dataloader(self) -> DataLoader:
        return ResumableDataLoader(Arithmetic(12), batch_size=2, shuffle=True)
