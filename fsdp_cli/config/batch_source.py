"""Where a LightningModule's batches come from, checked against the classes before any rank starts.

A pre-launch check (:data:`fsdp_cli.resolve.PRE_LAUNCH_CHECKS`), like the callbacks' classes
(:mod:`fsdp_cli.config.callback_classes`): it imports the targets' modules (and so Lightning and
torch, a few seconds paid only by ``model=custom`` runs that leave the data group at its default,
and by ``data=datamodule``). Nothing is constructed here: a DataModule's constructor may read or
download data, which the ranks do through its hooks.

* ``data=datamodule``: ``data._target_`` is a ``LightningDataModule`` taking the ``data.*`` arguments.
* ``model=custom`` with the default data group: a LightningModule class that defines no
  ``train_dataloader`` has no batches (the default data group would be taken for a causal LM's),
  and is told what it needs. (A factory is asked in the rank, once it has built the module.)
"""

from __future__ import annotations

import inspect
import sys
from typing import TYPE_CHECKING

from fsdp_cli.config.callback_classes import check_arguments, locate
from fsdp_cli.config.model_kinds import kind_of
from fsdp_cli.config.schema import CustomModelConfig, DataModuleConfig
from fsdp_cli.errors import ConfigError

if TYPE_CHECKING:
    from fsdp_cli.config.resolved import ResolvedRun


def check_batch_source(run: ResolvedRun) -> None:
    cfg = run.cfg
    if isinstance(cfg.data, DataModuleConfig):
        check_datamodule_class(cfg.data)
    elif kind_of(cfg.model).target_decides and not cfg.explicit_data:
        check_module_has_batches(cfg.model)


def check_datamodule_class(data: DataModuleConfig) -> None:
    """The target exists, is a LightningDataModule (or a factory) and takes its arguments."""
    from lightning.pytorch import LightningDataModule

    target = locate("data", data.target)
    if inspect.isclass(target) and not issubclass(target, LightningDataModule):
        raise ConfigError(
            "data._target_",
            data.target,
            f"{target.__name__} is not a LightningDataModule",
            allowed="a subclass of lightning.pytorch.LightningDataModule, or a factory returning one",
            hint="a LightningModule's own loaders need no data=: drop data=datamodule",
        )
    if not callable(target):
        raise ConfigError("data._target_", data.target, "is not a class or a function")
    check_arguments("data", target, {"_target_": data.target, **data.kwargs})


def check_module_has_batches(model: CustomModelConfig) -> None:
    target = locate("model", model.target)
    # A LightningModule's module imported Lightning; a plain nn.Module's need not (nor do we).
    lightning = sys.modules.get("lightning.pytorch")
    if lightning is None or not inspect.isclass(target):
        return  # (a factory is asked in the rank, once it has built the module)
    base = lightning.LightningModule
    if issubclass(target, base) and target.train_dataloader is base.train_dataloader:
        raise no_batches(target.__qualname__, model.target)


def no_batches(name: str, target: str) -> ConfigError:
    """A LightningModule with neither ``train_dataloader`` nor a DataModule, and no data group
    chosen for it: what it needs."""
    return ConfigError(
        "model._target_",
        target,
        f"{name} defines no train_dataloader() and no LightningDataModule gives it batches",
        allowed="a train_dataloader() in the module, or data=datamodule data._target_=pkg.MyDataModule",
        hint="a module written for token batches [B, T+1] takes fsdp-train's data: data=synthetic +model.vocab_size=N",
    )
