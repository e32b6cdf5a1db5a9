"""Data builder: the ``data`` group -> the LightningDataModule of token batches, unless the
LightningModule brings its own ``train_dataloader`` (then Lightning uses the module's loaders)."""

from __future__ import annotations

import sys

import lightning as L
from lightning.pytorch.utilities.model_helpers import is_overridden

from fsdp_cli.config.resolved import ResolvedRun
from fsdp_cli.config.schema import TrainConfig
from fsdp_cli.config.validate import data_checks_deferred, validate_data
from fsdp_cli.data.datamodule import TokenDataModule, ValidatedTokenDataModule
from fsdp_cli.errors import ConfigError
from fsdp_cli.launch.environment import global_rank


def brings_own_loaders(module: L.LightningModule) -> bool:
    """A LightningModule written for Lightning: it defines ``train_dataloader`` itself."""
    return is_overridden("train_dataloader", module, parent=L.LightningModule)


def build_datamodule(run: ResolvedRun, module: L.LightningModule) -> TokenDataModule | None:
    """The token DataModule for ``module``, or None when the module's own loaders are used.

    Data settings given on the command line for such a module are refused (they would do
    nothing); the default data group is ignored with a one-line notice.
    """
    cfg = run.cfg
    if brings_own_loaders(module):
        _data_group_unused(cfg, module)
        return None
    if data_checks_deferred(cfg):
        validate_data(cfg)  # the parent could not know this module trains on the data group
    data_cls = TokenDataModule if cfg.trainer.val_check_interval is None else ValidatedTokenDataModule
    return data_cls(cfg.data, seed=cfg.seed, dp_size=run.layout.dp, epochs=cfg.trainer.max_epochs is not None)


def _data_group_unused(cfg: TrainConfig, module: L.LightningModule) -> None:
    name = type(module).__qualname__
    if cfg.explicit_data:
        raise ConfigError(
            "data",
            cfg.data.name,
            f"{name} defines train_dataloader(), so fsdp-train trains on its own loaders and the data settings would do nothing",
            hint="drop the data=/data.* overrides (the module's DataLoaders set batches), or remove train_dataloader() from the module",
        )
    if global_rank() == 0:
        print(
            f"fsdp-train: note: {name} defines train_dataloader(): training on its own loaders "
            f"(data={cfg.data.name} is not used)",
            file=sys.stderr,
            flush=True,
        )
