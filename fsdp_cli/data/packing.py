"""Which examples make up each training sequence of ``data=chat``: packed or one each, never split.

An example of ``n`` tokens is ``n - 1`` (input, label) pairs: the label of pair ``j`` is token
``j + 1``, supervised when that token is the assistant's. Pairs of one example are never spread
over two sequences; an example with more pairs than ``seq_len`` keeps ``seq_len`` of them (its
start with ``truncation_side=right``, its end with ``left``) and is counted; one left without a
supervised label is dropped, and counted too. With packing, examples are laid next-fit in their
order into sequences of ``seq_len`` pairs; without, each sequence holds one example, padded.

Torch-free: the launching process computes the same layout to print the statistics once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Layout:
    """The sequences of one corpus at one ``seq_len`` (compressed rows: sequence ``s`` holds
    ``examples[starts[s]:starts[s + 1]]``)."""

    examples: np.ndarray
    starts: np.ndarray
    first_pair: np.ndarray
    """Per example: its first kept pair (non-zero when its start was truncated away)."""
    pairs: np.ndarray
    """Per example: its kept pairs."""
    supervised: np.ndarray
    """Per sequence: its supervised labels."""
    truncated: int
    dropped: int

    @property
    def sequences(self) -> int:
        return len(self.starts) - 1


def supervised_prefix(supervised: np.ndarray) -> np.ndarray:
    """Cumulative count of supervised tokens: tokens ``[a, b)`` hold ``prefix[b] - prefix[a]``."""
    return np.concatenate(([0], np.cumsum(supervised, dtype=np.int64)))


def plan_sequences(
    offsets: np.ndarray, prefix: np.ndarray, *, seq_len: int, packing: bool, keep_end: bool
) -> Layout:
    """The :class:`Layout` of examples ``offsets`` (token boundaries) with ``prefix``
    (:func:`supervised_prefix`)."""
    total = np.maximum(np.diff(offsets) - 1, 0)  # (an example of no token has no pair)
    pairs = np.minimum(total, seq_len)
    first = np.where(keep_end, total - pairs, 0)
    # Labels of kept pairs are tokens [offset + 1 + first, offset + 1 + first + pairs).
    label_start = offsets[:-1] + 1 + first
    counts = prefix[label_start + pairs] - prefix[label_start]
    kept = np.flatnonzero(counts > 0)
    starts, sizes = [0], 0
    for position, example in enumerate(kept):
        if position > 0 and (not packing or sizes + pairs[example] > seq_len):
            starts.append(position)
            sizes = 0
        sizes += int(pairs[example])
    if len(kept):
        starts.append(len(kept))
    bounds = np.asarray(starts, dtype=np.int64)
    per_sequence = np.add.reduceat(counts[kept], bounds[:-1]) if len(kept) else np.zeros(0, np.int64)
    return Layout(
        examples=kept,
        starts=bounds,
        first_pair=first,
        pairs=pairs,
        supervised=per_sequence,
        truncated=int(np.count_nonzero(total > seq_len)),
        dropped=int(len(total) - len(kept)),
    )
