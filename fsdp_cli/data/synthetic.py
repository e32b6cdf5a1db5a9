"""Synthetic token streams that a model can learn, generated on the fly and deterministically.

Sequence ``i`` depends only on ``(seed, i)``: it starts at a random token and each next token is
the previous one plus a random step of 1..4 (mod vocabulary). The loss starts at ln(vocab) and
falls towards ln(4), so the default run shows learning without any data on disk.

With ``num_sequences`` the stream becomes a dataset of that many sequences: item
``e * num_sequences + i`` is sequence ``perm_e(i)``, an order fixed by (seed, epoch ``e``), so each
epoch visits every sequence once.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from fsdp_cli.data.tokens import affine_permutation

STEPS = 4


class SyntheticTokens(Dataset):
    def __init__(
        self, *, vocab_size: int, seq_len: int, seed: int, size: int = 2**62, num_sequences: int | None = None
    ) -> None:
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.seed = seed
        self.size = size
        self.num_sequences = num_sequences

    @property
    def epoch_size(self) -> int | None:
        """Items in one epoch: ``num_sequences``; None for the endless stream."""
        return self.num_sequences

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> torch.Tensor:
        if self.num_sequences is not None:
            epoch, position = divmod(index, self.num_sequences)
            index = affine_permutation(position, self.num_sequences, key=(self.seed, epoch))
        gen = torch.Generator().manual_seed((self.seed * 1_000_003 + index) % (2**63))
        start = torch.randint(self.vocab_size, (1,), generator=gen)
        steps = torch.randint(1, STEPS + 1, (self.seq_len,), generator=gen)
        return torch.cat((start, start + steps.cumsum(0))) % self.vocab_size
