"""A LightningModule of a user's that takes part in context parallel through the documented hook
(docs/context-parallel.md): the class attribute ``context_parallel``, and its step splitting the
batch with it. Its model is the built-in Llama, whose attention declares the hook too."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from fsdp_cli.models.args import LlamaArgs
from fsdp_cli.models.llama import Llama
from fsdp_cli.parallel.context_parallel import ContextParallel

VOCAB, SEQ = 64, 32


class ContextParallelLM(L.LightningModule):
    """Next-token loss on fixed random tokens, trained with SGD (a gradient scaled by a constant
    shows in its losses, as it would not under AdamW)."""

    context_parallel: ContextParallel | None = None

    def __init__(self) -> None:
        super().__init__()
        self.model: nn.Module | None = None

    def configure_model(self) -> None:
        if self.model is None:
            args = LlamaArgs(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=SEQ)
            self.model = Llama(args, seed=0)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        cp = self.context_parallel
        inputs, targets = (tokens[:, :-1], tokens[:, 1:]) if cp is None else cp.split_batch(tokens)[:2]
        assert self.model is not None
        logits = self.model(inputs)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def train_dataloader(self) -> Any:
        tokens = torch.randint(0, VOCAB, (64, SEQ + 1), generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=8)
