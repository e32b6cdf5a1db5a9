"""Data builder: the ``data`` group -> the LightningDataModule of token batches."""

from __future__ import annotations

from fsdp_cli.config.schema import TrainConfig
from fsdp_cli.data.datamodule import TokenDataModule, ValidatedTokenDataModule


def build_datamodule(cfg: TrainConfig) -> TokenDataModule:
    data_cls = TokenDataModule if cfg.trainer.val_check_interval is None else ValidatedTokenDataModule
    return data_cls(cfg.data, seed=cfg.seed, dp_size=int(cfg.dp))
