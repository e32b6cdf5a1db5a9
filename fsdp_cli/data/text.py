"""Byte-level language modelling on local text files (vocabulary 256, no tokenizer).

With no path, the Python standard library sources installed on this machine are the corpus:
a real loss curve with no download.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from fsdp_cli.data.files import HELD_OUT_FRACTION, text_files


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
    """Item i is a window of ``seq_len + 1`` bytes at a position fixed by (seed, i)."""

    def __init__(self, corpus: torch.Tensor, *, seq_len: int, seed: int) -> None:
        if len(corpus) <= seq_len + 1:
            raise ValueError(f"the corpus ({len(corpus)} bytes) is shorter than data.seq_len + 1")
        self.corpus = corpus
        self.seq_len = seq_len
        self.seed = seed
        self.positions = len(corpus) - seq_len - 1

    def __len__(self) -> int:
        return 2**62

    def __getitem__(self, index: int) -> torch.Tensor:
        # A multiplicative hash spreads consecutive items over the corpus.
        start = ((index + 1) * 0x9E3779B97F4A7C15 + self.seed * 0xBF58476D1CE4E5B9) % (2**64) % self.positions
        return self.corpus[start : start + self.seq_len + 1].long()


def split_corpus(corpus: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cut = int(len(corpus) * (1 - HELD_OUT_FRACTION))
    return corpus[:cut], corpus[cut:]
