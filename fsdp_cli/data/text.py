"""Byte-level language modelling on local text files (vocabulary 256, no tokenizer).

With no path, the Python standard library sources installed on this machine are the corpus:
a real loss curve with no download. The bytes are windowed as token files are
(:class:`fsdp_cli.data.tokens.TokenWindows`): ``n = (bytes - 1) // seq_len`` windows starting every
``seq_len`` bytes, each epoch visiting every window once in an order fixed by (seed, epoch).
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from fsdp_cli.data.files import HELD_OUT_FRACTION, text_files
from fsdp_cli.data.tokens import affine_permutation


def read_corpus(path: str | None, max_bytes: int) -> torch.Tensor:
    """Concatenated bytes of the files (in sorted order, so every rank reads the same corpus)."""
    chunks, total = [], 0
    for file in text_files(path):
        data = file.read_bytes()[: max_bytes - total]
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if total == 0:
        raise FileNotFoundError(f"data.path={path!r}: no text found")
    return torch.from_numpy(np.frombuffer(b"".join(chunks), dtype=np.uint8).copy())


class ByteWindows(Dataset):
    """Item ``i`` is window ``perm_e(i mod n)`` of epoch ``e = i // n``: ``seq_len + 1`` bytes
    starting at a multiple of ``seq_len`` (consecutive windows share one byte, as token windows do)."""

    def __init__(self, corpus: torch.Tensor, *, seq_len: int, seed: int) -> None:
        if len(corpus) <= seq_len + 1:
            raise ValueError(f"the corpus ({len(corpus)} bytes) is shorter than data.seq_len + 1")
        self.corpus = corpus
        self.seq_len = seq_len
        self.seed = seed
        self.windows = (len(corpus) - 1) // seq_len

    def __len__(self) -> int:
        return 2**62

    @property
    def epoch_size(self) -> int:
        """Items in one epoch: every window once."""
        return self.windows

    def __getitem__(self, index: int) -> torch.Tensor:
        epoch, position = divmod(index, self.windows)
        start = affine_permutation(position, self.windows, key=(self.seed, epoch)) * self.seq_len
        return self.corpus[start : start + self.seq_len + 1].long()


def split_corpus(corpus: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cut = int(len(corpus) * (1 - HELD_OUT_FRACTION))
    return corpus[:cut], corpus[cut:]
