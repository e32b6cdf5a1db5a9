"""``data=datamodule``: the class ``data._target_`` names, checked before any rank starts.

A pre-launch check (:data:`fsdp_cli.resolve.PRE_LAUNCH_CHECKS`), like the callbacks' classes
(:mod:`fsdp_cli.config.callback_classes`): it imports the target's module (and so Lightning and
torch, a few seconds paid only by runs that name a DataModule) and checks that it is a
``LightningDataModule`` taking the ``data.*`` arguments. Nothing is constructed here: a
DataModule's constructor may read or download data, which the ranks do through its hooks.
"""

from __future__ import annotations

import inspect

from fsdp_cli.config.callback_classes import check_arguments, locate
from fsdp_cli.config.schema import DataModuleConfig, TrainConfig
from fsdp_cli.errors import ConfigError


def check_datamodule_class(cfg: TrainConfig) -> None:
    """The target exists, is a LightningDataModule (or a factory) and takes its arguments."""
    data = cfg.data
    if not isinstance(data, DataModuleConfig):
        return
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
