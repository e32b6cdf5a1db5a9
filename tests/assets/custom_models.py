"""User models for tests: a plain nn.Module (trained as a causal LM) and a LightningModule."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


class TinyBlock(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.GELU(), nn.Linear(2 * hidden, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class TinyLM(nn.Module):
    """No attention: a bag of residual MLP blocks over token embeddings. Enough to learn bigrams."""

    def __init__(self, vocab_size: int = 256, hidden: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, hidden)
        self.blocks = nn.ModuleList(TinyBlock(hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


@dataclass
class Output:
    logits: torch.Tensor


class TinyLMWithOutput(TinyLM):
    """Returns an object with ``.logits`` (as Hugging Face models do)."""

    def forward(self, input_ids: torch.Tensor) -> Output:  # type: ignore[override]
        return Output(logits=super().forward(input_ids))


def make_tiny_lm(vocab_size: int = 256, hidden: int = 32) -> nn.Module:
    """A factory function rather than a class."""
    return TinyLMWithOutput(vocab_size=vocab_size, hidden=hidden)
