"""Data builder: the ``data`` group -> the LightningDataModule that feeds the run: fsdp-train's
token batches, the user's own (``data=datamodule``), or None when the LightningModule brings its
own ``train_dataloader`` (then Lightning uses the module's loaders)."""

from __future__ import annotations

import sys

import lightning as L
from lightning.pytorch.utilities.model_helpers import is_overridden

from fsdp_cli.config.batch_source import no_batches
from fsdp_cli.config.resolved import ResolvedRun
from fsdp_cli.config.schema import DataModuleConfig, TrainConfig
from fsdp_cli.config.validate import data_checks_deferred, validate_data
from fsdp_cli.data.datamodule import TokenDataModule, ValidatedTokenDataModule
from fsdp_cli.dotted import instantiate
from fsdp_cli.errors import ConfigError
from fsdp_cli.launch.environment import global_rank
from fsdp_cli.models.causal_lm import CausalLMModule


def brings_own_loaders(module: L.LightningModule) -> bool:
    """A LightningModule written for Lightning: it defines ``train_dataloader`` itself."""
    return is_overridden("train_dataloader", module, parent=L.LightningModule)


def feeds_tokens(datamodule: L.LightningDataModule | None) -> bool:
    """Whether the run trains on fsdp-train's token batches (else on the user's loaders, the
    module's or a DataModule's, whose batch size fsdp-train does not set)."""
    return isinstance(datamodule, TokenDataModule)


def build_datamodule(run: ResolvedRun, module: L.LightningModule) -> L.LightningDataModule | None:
    """The DataModule for ``module``: the user's for ``data=datamodule``, None when the module's
    own loaders are used, else fsdp-train's token batches.

    Data settings given on the command line for a module with its own loaders are refused (they
    would do nothing); the default data group is ignored with a one-line notice. A LightningModule
    of the user's with neither loaders nor a DataModule is refused in one line, unless the
    command line chose the data group for it.
    """
    cfg = run.cfg
    if isinstance(cfg.data, DataModuleConfig):
        return build_user_datamodule(cfg.data)
    if brings_own_loaders(module):
        _data_group_unused(cfg, module)
        return None
    if not isinstance(module, CausalLMModule) and not cfg.explicit_data:
        raise no_batches(type(module).__qualname__, cfg.model.target)
    if data_checks_deferred(cfg):
        validate_data(run)  # the parent could not know this module trains on the data group
    data_cls = TokenDataModule if cfg.trainer.val_check_interval is None else ValidatedTokenDataModule
    return data_cls(cfg.data, seed=cfg.seed, dp_size=run.layout.dp, epochs=cfg.trainer.max_epochs is not None)


def build_user_datamodule(data: DataModuleConfig) -> L.LightningDataModule:
    """``data._target_(**data.kwargs)``; Lightning calls its hooks from ``trainer.fit``."""
    built = instantiate({"_target_": data.target, **data.kwargs}, "data")
    if not isinstance(built, L.LightningDataModule):
        raise ConfigError(
            "data._target_",
            data.target,
            f"built a {type(built).__name__}, not a LightningDataModule",
            allowed="a lightning.pytorch.LightningDataModule subclass, or a factory returning one",
        )
    return built


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
