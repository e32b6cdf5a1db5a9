"""Windows of ``seq_len + 1`` tokens from flat token files, memory-mapped (never read whole).

The files are one stream, in sorted order. It holds ``n = (tokens - 1) // seq_len`` windows
starting every ``seq_len`` tokens (consecutive windows share one token: the last target of one is
the first input of the next). Item ``i`` is window ``perm_e(i mod n)`` of epoch ``e = i // n``,
where ``perm_e`` is an affine permutation of ``0..n-1`` fixed by (seed, epoch): every window is
seen once per epoch, and an item depends only on its index, so the step-aligned sampler gives the
same batches on every layout and after a resume.
"""

from __future__ import annotations

import math
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from fsdp_cli.data.files import ITEM_SIZES


class TokenWindows(Dataset):
    """Arguments:
    files: the token files, in stream order.
    dtype: ``uint16`` or ``uint32``.
    seq_len: tokens per training sequence (each item holds ``seq_len + 1``).
    seed: fixes the order of windows in each epoch.
    """

    def __init__(self, files: list[Path], *, dtype: str, seq_len: int, seed: int) -> None:
        self.files = [str(f) for f in files]
        self.dtype = dtype
        self.seq_len = seq_len
        self.seed = seed
        sizes = [Path(f).stat().st_size // ITEM_SIZES[dtype] for f in self.files]
        self.starts = np.cumsum([0, *sizes])  # first stream position of each file, then the total
        self.windows = (int(self.starts[-1]) - 1) // seq_len
        if self.windows < 1:
            raise ValueError(
                f"{len(self.files)} token file(s) hold fewer than seq_len + 1 = {seq_len + 1} tokens"
            )
        self._maps: list[np.memmap] | None = None

    def __len__(self) -> int:
        return 2**62  # the sampler runs for as many steps as training needs

    @property
    def epoch_size(self) -> int:
        """Items in one epoch: every window once."""
        return self.windows

    def __getstate__(self) -> dict[str, Any]:
        # DataLoader workers open their own maps; pickling a memmap would copy the whole file.
        return {**self.__dict__, "_maps": None}

    def window(self, index: int) -> int:
        """Which window item ``index`` is."""
        epoch, position = divmod(index, self.windows)
        return affine_permutation(position, self.windows, key=(self.seed, epoch))

    def __getitem__(self, index: int) -> torch.Tensor:
        start = self.window(index) * self.seq_len
        return torch.from_numpy(self.read(start, start + self.seq_len + 1).astype(np.int64))

    def read(self, start: int, stop: int) -> np.ndarray:
        """Stream positions ``[start, stop)``, across file boundaries where the window spans them."""
        if self._maps is None:
            self._maps = [np.memmap(f, dtype=self.dtype, mode="r") for f in self.files]
        first = int(np.searchsorted(self.starts, start, side="right")) - 1
        pieces = []
        while start < stop:
            offset = start - int(self.starts[first])
            take = min(stop - start, len(self._maps[first]) - offset)
            pieces.append(self._maps[first][offset : offset + take])
            start += take
            first += 1
        return np.concatenate(pieces) if len(pieces) > 1 else np.array(pieces[0])


def affine_permutation(position: int, n: int, *, key: tuple[int, int]) -> int:
    """``(a * position + b) mod n`` with ``a`` coprime to ``n``: a bijection of ``0..n-1`` chosen by ``key``."""
    if n == 1:
        return 0
    mix = zlib.crc32(f"{key[0]}:{key[1]}".encode())
    a = 1 + (mix * 2654435761) % (n - 1)
    while math.gcd(a, n) != 1:
        a += 1
    b = (mix * 40503) % n
    return (a * position + b) % n
