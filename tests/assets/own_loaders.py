"""LightningModules that bring their own DataLoaders, as modules written for Lightning do."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.demos.boring_classes import BoringModel
from torch import nn
from torch.distributed.fsdp.wrap import wrap
from torch.utils.data import DataLoader, Dataset

from tests.assets.custom_models import TinyBlock
from tests.assets.model_parallel_module import FeedForwardLM

VOCAB = 64


class RecordingBoringModel(BoringModel):
    """Lightning's BoringModel, unchanged, except that it logs its loss with ``self.log`` and
    writes which samples this rank trained on to ``<run dir>/seen_rank<R>.json``."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[float] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> dict[str, torch.Tensor]:
        self.seen.extend(batch.sum(dim=1).tolist())  # a fingerprint of each sample
        out = super().training_step(batch, batch_idx)
        self.log("train_mse", out["loss"])
        return out

    def on_train_end(self) -> None:
        path = Path(self.trainer.default_root_dir) / f"seen_rank{self.global_rank}.json"
        path.write_text(json.dumps(self.seen))


class Arithmetic(Dataset):
    """Item i: ``seq_len + 1`` tokens counting up by a step fixed by i (learnable, deterministic)."""

    def __init__(self, length: int, seq_len: int = 16) -> None:
        self.length, self.seq_len = length, seq_len

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        return (index * 5 + (1 + index % 3) * torch.arange(self.seq_len + 1)) % VOCAB


def next_token_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())


class WrappedLoaderLM(L.LightningModule):
    """Manual ``wrap()`` of each block in ``configure_model`` (lightning_fairscale style) and its
    own loaders: 8 training samples in batches of 2, so an epoch is 2 steps on 2 ranks."""

    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, hidden)
        self.blocks = nn.ModuleList(TinyBlock(hidden) for _ in range(2))
        self.head = nn.Linear(hidden, VOCAB)

    def configure_model(self) -> None:
        for i, block in enumerate(self.blocks):
            self.blocks[i] = wrap(block)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return next_token_loss(self, batch)

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", next_token_loss(self, batch), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.trainer.model.parameters(), lr=3e-3)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Arithmetic(8), batch_size=2, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(Arithmetic(4), batch_size=2)


class ParallelLoaderLM(FeedForwardLM):
    """Lightning's ModelParallelStrategy pattern (``configure_model`` applies tensor parallel and
    FSDP2 itself), with its own loader: 8 samples in batches of 2, an epoch of 2 steps on 2
    data-parallel ranks. ``num_workers``: read through worker processes, as Lightning's
    tensor-parallel example does (``num_workers=4``)."""

    def __init__(self, num_workers: int = 0) -> None:
        super().__init__(vocab_size=VOCAB, hidden=32)
        self.num_workers = num_workers

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Arithmetic(8), batch_size=2, shuffle=True, num_workers=self.num_workers)
