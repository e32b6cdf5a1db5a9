"""Lightning internals: signal handling, FSDP1 activation-checkpointing helpers, strategy state.

The strategies in :mod:`fsdp_cli.strategies` subclass Lightning's and set state Lightning keeps in
private attributes (the device mesh, the FSDP1 checkpointing settings); they do it through these
functions, whose names are checked below against a live instance of each class.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.fabric.strategies import fsdp as _fabric_fsdp
from lightning.fabric.utilities import init as _fabric_init
from lightning.fabric.utilities import optimizer as _fabric_optimizer
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from lightning.pytorch.plugins.io import wrapper as _io_wrapper
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy, Strategy
from lightning.pytorch.trainer.connectors.logger_connector.logger_connector import _LoggerConnector
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector

from fsdp_cli.compat import require

ENTRIES: list[tuple[Any, str]] = [
    (_SignalConnector, "register_signal_handlers"),
    (_TrainingEpochLoop, "_broadcast_sigterm_tensor"),
    (_fabric_fsdp, "_activation_checkpointing_kwargs"),
    (_fabric_fsdp, "_setup_activation_checkpointing"),
    (_fabric_optimizer, "_optimizers_to_device"),
    (_fabric_init, "_materialize_distributed_module"),
    (ModelParallelStrategy, "_setup_distributed"),
    (ModelParallelStrategy(), "_device_mesh"),
    (Strategy, "_reset_optimizers_and_schedulers"),
    (ModelParallelStrategy(), "_forward_redirection"),
    (FSDPStrategy(), "_activation_checkpointing_kwargs"),
    (FSDPStrategy(), "_state_dict_type"),
    (ModelParallelStrategy(), "_save_distributed_checkpoint"),
    (L.LightningModule(), "_device_mesh"),
    (L.Trainer, "_signal_connector"),
    (_io_wrapper, "_WrappingCheckpointIO"),
    (_LoggerConnector(None), "_callback_metrics"),
    (L.Trainer, "_logger_connector"),
]
_TRAINER_INSTANCE_ATTRIBUTES = {"_signal_connector", "_logger_connector"}
for _owner, _name in ENTRIES:
    if _name in _TRAINER_INSTANCE_ATTRIBUTES:
        continue  # instance attributes of a Trainer; their classes are checked above
    require(_owner, _name, "lightning")

activation_checkpointing_kwargs = _fabric_fsdp._activation_checkpointing_kwargs
setup_activation_checkpointing = _fabric_fsdp._setup_activation_checkpointing
optimizers_to_device = _fabric_optimizer._optimizers_to_device
# ModelParallelStrategy's materialization of meta-device modules: ``to_empty`` on the root, then
# ``reset_parameters()`` of every module holding tensors, with a warning naming those without one.
materialize_distributed_module = _fabric_init._materialize_distributed_module


def disable_lightning_sigterm_handling(trainer: L.Trainer) -> None:
    """Turn off Lightning's SIGTERM handling for this trainer: it broadcasts from inside the signal
    handler (a collective at a random point of the other ranks' program, which kills the job) and
    once per training batch (a device sync). Must run before ``fit`` registers the handlers."""
    connector = require(trainer, "_signal_connector", "lightning")
    connector.register_signal_handlers = lambda: None
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = lambda: None


def setup_distributed(strategy: ModelParallelStrategy) -> None:
    """Lightning's own process-group set-up (environment, backend, timeout)."""
    strategy._setup_distributed()


def set_device_mesh(strategy: Strategy, mesh: Any) -> None:
    """Give the strategy and its LightningModule the mesh (``strategy.device_mesh``,
    ``module.device_mesh`` read it)."""
    strategy._device_mesh = mesh
    if strategy.lightning_module is not None:
        strategy.lightning_module._device_mesh = mesh


def is_wrapping_checkpoint_io(io: Any) -> bool:
    """A CheckpointIO plugin around a base one (``AsyncCheckpointIO``), whose base the strategy
    supplies when the user gave none (Lightning's Strategy.checkpoint_io does the same)."""
    return isinstance(io, _io_wrapper._WrappingCheckpointIO)


def lightning_writes_sharded(strategy: Strategy) -> bool | None:
    """Lightning's own format setting, in one spelling: whether the strategy writes sharded
    checkpoints (FSDPStrategy's ``state_dict_type``, ModelParallelStrategy's
    ``save_distributed_checkpoint``); None for a strategy without one (DDP), or with a value
    Lightning itself refuses when it saves (``state_dict_type="invalid"``: left for it to refuse)."""
    if isinstance(strategy, FSDPStrategy):
        kind = strategy._state_dict_type
        return kind == "sharded" if kind in ("sharded", "full") else None
    if isinstance(strategy, ModelParallelStrategy):
        return bool(strategy._save_distributed_checkpoint)
    return None


def unknown_lightning_format(strategy: Strategy) -> bool:
    """FSDPStrategy's ``state_dict_type`` is neither ``sharded`` nor ``full``: Lightning refuses it
    in ``save_checkpoint`` (``Unknown state_dict_type``)."""
    return isinstance(strategy, FSDPStrategy) and strategy._state_dict_type not in ("sharded", "full")


def set_lightning_writes_sharded(strategy: Strategy, sharded: bool) -> None:
    """Keep the Lightning strategy's own format setting equal to ours: its ``save_checkpoint``
    (which ours calls for full files) reads it."""
    if isinstance(strategy, FSDPStrategy):
        strategy._state_dict_type = "sharded" if sharded else "full"
    elif isinstance(strategy, ModelParallelStrategy):
        strategy._save_distributed_checkpoint = sharded


def share_callback_metrics(trainer: L.Trainer, values: dict[str, Any]) -> None:
    """Put ``values`` where ``trainer.callback_metrics`` reads them, as ``LightningModule.log``
    would for values logged ``on_step`` without a logger, but without its machinery: ``log`` copies
    each value's metadata through ``apply_to_collection`` and ``deepcopy`` (about a millisecond per
    value and step on a CPU, a fifth of a small step for a metrics row). ``callback_metrics`` is
    this very dict, refreshed from what the module logs and emptied where Lightning resets it
    (start of fit, sanity check)."""
    trainer._logger_connector._callback_metrics.update(values)


def forward_redirection(strategy: Strategy) -> Any:
    """Lightning's ``_ForwardRedirection`` of this strategy: calls a LightningModule method (a
    step) through a module's ``forward``, so that the module's forward hooks run."""
    return strategy._forward_redirection


def reset_optimizers(strategy: Strategy) -> None:
    strategy._reset_optimizers_and_schedulers()


def set_fsdp1_activation_checkpointing(strategy: FSDPStrategy, classes: set[type] | None) -> None:
    """FSDPStrategy's activation-checkpointing policy, for classes resolved after construction."""
    strategy._activation_checkpointing_kwargs = activation_checkpointing_kwargs(None, classes)


def fsdp1_activation_checkpointing(strategy: FSDPStrategy) -> dict[str, Any]:
    return strategy._activation_checkpointing_kwargs
