"""The training sequences of ``data=chat`` as a Dataset: ids, labels, positions and the step's weight.

Item ``i`` is sequence ``perm_e(i mod n)`` of epoch ``e = i // n`` (as :mod:`fsdp_cli.data.tokens`
orders windows), so an item depends only on its index: the step-aligned sampler gives the same
batches on every layout and resumes exactly mid-epoch, packed or not. Each item is a dict:

* ``input_ids``, ``labels`` ``[seq_len]``: the (input, label) pairs of its examples one after the
  other, then padding; labels are -100 except where the predicted token is the assistant's;
* ``position_ids`` ``[seq_len]`` (with packing only): restarting at 0 at each example (and at the
  padding), which is how the models find the documents their attention keeps apart;
* ``step_supervised`` and ``step_sequences``: the supervised labels and the sequences of the whole
  global batch the item belongs to (integers: a true-precision plugin rounds float inputs). The
  module's loss is the sum of its micro-batch's token losses times ``step_sequences /
  (step_supervised * micro_batch)``, which after Lightning's
  division by the accumulation and the data-parallel gradient average is exactly the mean over
  the global batch's supervised tokens, on every layout and micro-batching. Every rank computes
  the step's count from the data, without a collective.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset, default_collate

from fsdp_cli.data.chat import ChatCorpus
from fsdp_cli.data.packing import Layout
from fsdp_cli.data.sampler import step_first_item
from fsdp_cli.data.tokens import affine_permutation

IGNORE = -100
"""The label cross-entropy skips (PyTorch's and transformers' ``ignore_index``)."""


class ChatSequences(Dataset):
    """Arguments:
    corpus: the tokenized examples (:mod:`fsdp_cli.data.chat`).
    layout: which examples make up each sequence (:func:`fsdp_cli.data.packing.plan_sequences`).
    seq_len: pairs per sequence.
    seed: fixes the order of sequences in each epoch.
    packing: emit ``position_ids`` restarting at each example.
    pad_id: the input id of padding (never a label).
    """

    collate = staticmethod(default_collate)

    def __init__(
        self, corpus: ChatCorpus, layout: Layout, *, seq_len: int, seed: int, packing: bool, pad_id: int = 0
    ) -> None:
        self.corpus, self.layout = corpus, layout
        self.seq_len, self.seed, self.packing, self.pad_id = seq_len, seed, packing, pad_id
        self.global_batch_size = 1
        self.steps_epoch_size: int | None = None
        self._step_counts: dict[int, int] = {}

    def group_by_steps(self, global_batch_size: int, epoch_size: int | None) -> None:
        """How the sampler groups items into global batches (the weight's denominator)."""
        self.global_batch_size, self.steps_epoch_size = global_batch_size, epoch_size
        self._step_counts.clear()

    def __len__(self) -> int:
        return 2**62  # the sampler runs for as many steps as training needs

    @property
    def epoch_size(self) -> int:
        return self.layout.sequences

    def sequence(self, index: int) -> int:
        """Which sequence item ``index`` is."""
        epoch, position = divmod(index, self.epoch_size)
        return affine_permutation(position, self.epoch_size, key=(self.seed, epoch))

    def step_supervised(self, index: int) -> int:
        """Supervised labels in the global batch of item ``index`` (all ranks, all micro-batches)."""
        first = step_first_item(
            index, global_batch_size=self.global_batch_size, epoch_size=self.steps_epoch_size
        )
        if first not in self._step_counts:
            items = range(first, first + self.global_batch_size)
            self._step_counts = {first: int(sum(self.layout.supervised[self.sequence(i)] for i in items))}
        return self._step_counts[first]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids, labels, positions = self.pairs(self.sequence(index))
        count = self.step_supervised(index)
        item = {
            "input_ids": torch.from_numpy(ids),
            "labels": torch.from_numpy(labels),
            "step_supervised": torch.tensor(count, dtype=torch.int64),
            "step_sequences": torch.tensor(self.global_batch_size, dtype=torch.int64),
        }
        if self.packing:
            item["position_ids"] = torch.from_numpy(positions)
        return item

    def pairs(self, sequence: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(input ids, labels, positions) of one sequence, padded to ``seq_len``."""
        layout, corpus = self.layout, self.corpus
        ids, labels, positions = [], [], []
        for example in layout.examples[layout.starts[sequence] : layout.starts[sequence + 1]]:
            start = int(corpus.offsets[example]) + int(layout.first_pair[example])
            stop = start + int(layout.pairs[example])
            ids.append(np.asarray(corpus.tokens[start:stop], dtype=np.int64))
            target = np.asarray(corpus.tokens[start + 1 : stop + 1], dtype=np.int64)
            labels.append(np.where(corpus.supervised[start + 1 : stop + 1] > 0, target, IGNORE))
            positions.append(np.arange(stop - start, dtype=np.int64))
        pad = self.seq_len - sum(len(p) for p in ids)
        ids.append(np.full(pad, self.pad_id, dtype=np.int64))
        labels.append(np.full(pad, IGNORE, dtype=np.int64))
        positions.append(np.arange(pad, dtype=np.int64))  # padding is a document of its own
        return np.concatenate(ids), np.concatenate(labels), np.concatenate(positions)
