"""LightningDataModule over the synthetic, text or token-file datasets with the step-aligned sampler.

Without ``trainer.max_epochs`` the training loader is endless (Lightning sees one infinite epoch and
``max_steps`` ends the run, as always). With it, the loader has the length of one epoch of the
dataset (:mod:`fsdp_cli.data.sampler`: whole global batches), and Lightning counts epochs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from fsdp_cli.data.files import TOKEN_SUFFIXES, matching_files
from fsdp_cli.data.sampler import StepBatchSampler
from fsdp_cli.data.synthetic import SyntheticTokens
from fsdp_cli.data.text import ByteWindows, read_corpus, split_corpus
from fsdp_cli.data.tokens import TokenWindows
from fsdp_cli.errors import ConfigError

VAL_SEED_OFFSET = 7_777_777


def _windows(key: str, corpus: torch.Tensor, seq_len: int, seed: int) -> ByteWindows:
    if len(corpus) <= seq_len + 1:
        raise ConfigError(
            key,
            f"{len(corpus)} bytes",
            f"too little text for data.seq_len={seq_len}",
            hint="point data.path at more text or lower data.seq_len",
        )
    return ByteWindows(corpus, seq_len=seq_len, seed=seed)


def token_windows(data: Any, key: str, seed: int) -> TokenWindows:
    """``data.<key>`` of ``data=tokens`` (its files) or ``data=jsonl`` (the tokenized cache)."""
    if data.name == "jsonl":
        from fsdp_cli.data.jsonl import cached_tokens

        file, dtype = cached_tokens(data, key)
        return TokenWindows([file], dtype=dtype, seq_len=data.seq_len, seed=seed)
    files = matching_files(getattr(data, key), TOKEN_SUFFIXES)
    return TokenWindows(files, dtype=data.dtype.value, seq_len=data.seq_len, seed=seed)


def chat_sequences(data: Any, key: str, seed: int) -> Dataset:
    """``data.<key>`` of ``data=chat``: the cached conversations laid into sequences."""
    from fsdp_cli.data.chat import cached_corpus
    from fsdp_cli.data.chat_dataset import ChatSequences

    corpus = cached_corpus(data, key)
    return ChatSequences(corpus, corpus.layout(data), seq_len=data.seq_len, seed=seed, packing=data.packing)


class TokenDataModule(L.LightningDataModule):
    """Batches of token ids ``[micro_batch, seq_len + 1]`` for each data-parallel rank.

    The rank's data-parallel coordinate comes from the strategy (``distributed_sampler_kwargs``),
    so it is right for DDP, FSDP1, FSDP2, HSDP and tensor parallel alike.
    """

    validates = False

    def __init__(self, data: Any, *, seed: int, dp_size: int, epochs: bool = False) -> None:
        super().__init__()
        self.data = data
        self.seed = seed
        self.dp_size = dp_size
        self.epochs = epochs
        """Training loaders one epoch long (``trainer.max_epochs`` is set)."""
        self.micro_batch_size = data.micro_batch_size or data.global_batch_size // dp_size
        self._train: Dataset | None = None
        self._val: Dataset | None = None

    @property
    def accumulation(self) -> int:
        return self.data.global_batch_size // self.dp_size // self.micro_batch_size

    def setup(self, stage: str) -> None:
        if self._train is not None:
            return
        data = self.data
        if data.name == "text":
            train, val = split_corpus(read_corpus(data.path, data.max_bytes))
            self._train = _windows("data.path", train, data.seq_len, self.seed)
            if self.validates:
                self._val = _windows("data.path (held-out part)", val, data.seq_len, self.seed)
        elif data.name == "chat":
            self._train = chat_sequences(data, "path", self.seed)
            if self.validates:
                self._val = chat_sequences(data, "val_path", self.seed + VAL_SEED_OFFSET)
        elif data.name in ("tokens", "jsonl"):
            self._train = token_windows(data, "path", self.seed)
            if self.validates:
                self._val = token_windows(data, "val_path", self.seed + VAL_SEED_OFFSET)
        else:
            self._train = SyntheticTokens(
                vocab_size=data.vocab_size,
                seq_len=data.seq_len,
                seed=self.seed,
                num_sequences=data.num_sequences,
            )
            self._val = SyntheticTokens(
                vocab_size=data.vocab_size, seq_len=data.seq_len, seed=self.seed + VAL_SEED_OFFSET
            )

    def _loader(
        self,
        dataset: Dataset,
        start_step: int,
        *,
        current_step: Callable[[], int] | None = None,
        epoch_size: int | None = None,
    ) -> DataLoader:
        kwargs = self.trainer.strategy.distributed_sampler_kwargs if self.trainer is not None else None
        rank, size = (kwargs["rank"], kwargs["num_replicas"]) if kwargs else (0, 1)
        if size != self.dp_size:
            raise RuntimeError(f"strategy reports {size} data-parallel ranks, config says dp={self.dp_size}")
        sampler = StepBatchSampler(
            global_batch_size=self.data.global_batch_size,
            micro_batch_size=self.micro_batch_size,
            dp_rank=rank,
            dp_size=size,
            start_step=start_step,
            epoch_size=epoch_size,
            current_step=current_step,
        )
        if hasattr(dataset, "group_by_steps"):  # data=chat weighs each item by its global batch
            dataset.group_by_steps(self.data.global_batch_size, epoch_size)
        on_gpu = self.trainer is not None and self.trainer.strategy.root_device.type == "cuda"
        return StepDataLoader(
            dataset,
            batch_sampler=sampler,
            num_workers=self.data.num_workers,
            collate_fn=getattr(dataset, "collate", torch.stack),
            pin_memory=on_gpu,
            persistent_workers=self.data.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        assert self._train is not None
        # Each pass starts at the trainer's step: on resume it is already restored (the next unseen
        # batch, mid-epoch too), at a new epoch it is that epoch's first step.
        trainer = self.trainer
        step = trainer.global_step if trainer is not None else 0
        current = (lambda: trainer.global_step) if trainer is not None else None
        epoch_size = self._epoch_size(self._train) if self.epochs else None
        return self._loader(self._train, start_step=step, current_step=current, epoch_size=epoch_size)

    def _epoch_size(self, dataset: Dataset) -> int:
        """Items in one epoch of ``dataset``; at least one global batch, else a one-line error."""
        size = dataset.epoch_size  # type: ignore[attr-defined]
        data = self.data
        if size is None or size < data.global_batch_size:
            synthetic = data.name == "synthetic"
            raise ConfigError(
                "data.num_sequences" if synthetic else "data.path",
                size if synthetic else data.path,
                f"an epoch holds {size} sequences of data.seq_len + 1 = {data.seq_len + 1} tokens, fewer than "
                f"one global batch (data.global_batch_size={data.global_batch_size})",
                hint="more data, a smaller data.global_batch_size or data.seq_len, or trainer.max_steps without max_epochs",
            )
        return int(size)


class StepDataLoader(DataLoader):
    """A DataLoader whose position is the trainer's optimizer step (:class:`StepBatchSampler`).

    Lightning asks a loader that resumes mid-epoch to say so through ``state_dict`` /
    ``load_state_dict`` (else it warns that such a resume is unreliable). This one resumes exactly
    at any step by construction, so it has nothing to save and nothing to restore.
    """

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to restore: the restored global step is the position."""


class ValidatedTokenDataModule(TokenDataModule):
    """Adds held-out batches (only when validation is configured, so Lightning sees no unused loader)."""

    validates = True

    def val_dataloader(self) -> DataLoader:
        assert self._val is not None
        return self._loader(self._val, start_step=0)
