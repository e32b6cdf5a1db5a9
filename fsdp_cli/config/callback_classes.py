"""The ``callbacks`` entries, and a ``model=custom`` target's arguments, checked against the
classes they name, before any rank starts.

A pre-launch check (:data:`fsdp_cli.resolve.PRE_LAUNCH_CHECKS`): it imports each target's
module, so it runs on the resolve path only, never for ``--cfg job`` or the config errors of
:mod:`fsdp_cli.config.validate` (which found the module without importing it). Importing a
Lightning callback imports lightning and torch into the launching process: a few seconds, paid
once and only by runs that configure callbacks. Nothing is constructed here (a callback's
constructor may open files or connect somewhere); the ranks build them
(:func:`fsdp_cli.builders.callbacks.build_user_callbacks`), and a constructor that still refuses
its arguments there is the same one-line error from the rank.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from fsdp_cli.config.model_kinds import kind_of
from fsdp_cli.config.schema import LoggerName, TrainConfig
from fsdp_cli.errors import ConfigError

if TYPE_CHECKING:
    from fsdp_cli.config.resolved import ResolvedRun

NEEDS_A_LOGGER = ("LearningRateMonitor", "DeviceStatsMonitor")
"""Lightning callbacks that refuse to start without a logger (they only write to one)."""


def check_callback_classes(run: ResolvedRun) -> None:
    """Each entry's target exists, is a Lightning ``Callback`` (or a factory), and takes its arguments."""
    for name, entry in run.cfg.callbacks.items():
        if entry is not None:
            _check_entry(run.cfg, f"callbacks.{name}", entry)


def check_model_arguments(run: ResolvedRun) -> None:
    """``model=custom``: the ``+model.NAME`` keys bind to the target's signature (a ``**kwargs``
    target takes any), checked here as a callbacks entry is, so a misspelled argument is one line
    before launch instead of a traceback from every rank. The target is imported, never called:
    building the model is the ranks' work. (Its module and name were found without importing it
    by the model registry's ``check_custom_target``.)"""
    cfg = run.cfg
    if not kind_of(cfg.model).target_decides:
        return
    target = locate("model", cfg.model.target)
    if not callable(target):
        raise ConfigError("model._target_", cfg.model.target, "is not a class or a function")
    check_arguments("model", target, {"_target_": cfg.model.target, **cfg.model.kwargs})
    if cfg.pp > 1:
        check_pipeline_hooks(target, cfg.pp)
    if cfg.cp > 1:
        check_context_parallel_hook(target, cfg.cp)
    if run.entry.user_parallelizes:
        check_parallelizes_itself(target, cfg.model.target)


def check_parallelizes_itself(target: Any, name: str) -> None:
    """``strategy=model_parallel``: Lightning's ModelParallelStrategy leaves parallelizing to a
    LightningModule's ``configure_model()``; a plain module class would train unsharded and
    unsynchronized. (A function target is told apart by what it returns, in the rank.)"""
    import lightning as L

    if inspect.isclass(target) and not issubclass(target, L.LightningModule):
        raise ConfigError(
            "strategy",
            "model_parallel",
            f"not with a plain nn.Module (model._target_={name}): Lightning's ModelParallelStrategy "
            "leaves parallelizing to a LightningModule's configure_model(), and nothing would shard or "
            "synchronize a plain module",
            allowed="strategy=model_parallel with a LightningModule that defines configure_model()",
            hint="use strategy=fsdp2 for a plain nn.Module: it parallelizes the model for you",
        )


def check_context_parallel_hook(target: Any, cp: int) -> None:
    """``model=custom`` under ``cp > 1``: a LightningModule class that declares
    ``context_parallel`` (docs/context-parallel.md): it splits its batches and its attention
    exchanges the slices. A plain module cannot: fsdp-train's steps would give it whole sequences."""
    import lightning as L

    if (
        inspect.isclass(target)
        and issubclass(target, L.LightningModule)
        and hasattr(target, "context_parallel")
    ):
        return
    what = "a LightningModule" if inspect.isclass(target) and issubclass(target, L.LightningModule) else "it"
    raise ConfigError(
        "cp",
        cp,
        f"model=custom {getattr(target, '__qualname__', target)}: {what} declares no context_parallel, so its "
        "attention cannot be reached to exchange the sequence's slices",
        allowed="cp=1, or a LightningModule that declares context_parallel",
        hint="docs/context-parallel.md shows the hook",
    )


def check_pipeline_hooks(target: Any, pp: int) -> None:
    """A LightningModule class trained under ``pp > 1`` says how a pipeline feeds it and takes its
    loss: refused here, before launch, as every rank would refuse it after (FSDP2Strategy)."""
    import lightning as L

    from fsdp_cli.pipeline.hooks import refuse_missing_hooks

    if inspect.isclass(target) and issubclass(target, L.LightningModule):
        refuse_missing_hooks(
            target, pp, allowed="pp=1, or a LightningModule with pipeline_inputs and pipeline_loss"
        )


def locate(key: str, path: str) -> Any:
    """The object a dotted ``_target_`` names; a one-line :class:`ConfigError` when it is not there."""
    module_name, _, attr = path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001 - any failure to import is the user's to fix
        raise ConfigError(
            f"{key}._target_", path, f"importing {module_name} failed: {type(err).__name__}: {err}"
        ) from None
    if not hasattr(module, attr):
        public = sorted(n for n in dir(module) if n[:1].isupper())
        raise ConfigError(
            f"{key}._target_",
            path,
            f"module {module_name} has no attribute {attr!r}",
            allowed=", ".join(public[:12]) + (", ..." if len(public) > 12 else "") if public else None,
        )
    return getattr(module, attr)


def _check_entry(cfg: TrainConfig, key: str, entry: Mapping[str, Any]) -> None:
    from lightning.pytorch import Callback

    path = str(entry["_target_"])
    target = locate(key, path)
    if inspect.isclass(target) and not issubclass(target, Callback):
        raise ConfigError(
            f"{key}._target_",
            path,
            f"{target.__name__} is not a Lightning Callback",
            allowed="a subclass of lightning.pytorch.Callback, or a factory returning one",
        )
    if not callable(target):
        raise ConfigError(f"{key}._target_", path, "is not a class or a function")
    check_arguments(key, target, entry)
    needs_logger = inspect.isclass(target) and any(c.__name__ in NEEDS_A_LOGGER for c in target.__mro__)
    if needs_logger and cfg.logger.name is LoggerName.none:
        raise ConfigError(
            f"{key}._target_",
            path,
            f"{target.__name__} writes to a logger, and logger=none",
            allowed="logger=csv, tensorboard, mlflow or wandb",
            hint="add logger=csv (metrics.csv in the run directory)",
        )


def check_arguments(key: str, target: Any, entry: Mapping[str, Any]) -> None:
    """The entry's arguments bind to the target's signature (Hydra's ``_args_``/``_partial_`` too):
    an unknown keyword first (the likelier typo), then a missing required one."""
    kwargs = {k: v for k, v in entry.items() if not (k.startswith("_") and k.endswith("_"))}
    args = list(entry.get("_args_") or [])
    path = str(entry["_target_"])
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):  # a builtin without one: the rank will tell
        return
    params = signature.parameters
    names = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        for name, value in kwargs.items():
            if name not in names:
                close = difflib.get_close_matches(name, names, n=1)
                raise ConfigError(
                    f"{key}.{name}",
                    value,
                    f"{path} takes no argument {name!r}",
                    allowed=", ".join(names) if names else "no arguments",
                    hint=f"did you mean {key}.{close[0]}?" if close else None,
                )
    try:
        if entry.get("_partial_"):
            signature.bind_partial(*args, **kwargs)
        else:
            signature.bind(*args, **kwargs)
    except TypeError as err:
        missing = re.findall(r"'(\w+)'", str(err))
        raise ConfigError(
            key,
            path,
            str(err),
            allowed=", ".join(names) if names else "no arguments",
            hint=f"+{key}.{missing[0]}=VALUE" if "missing" in str(err) and missing else None,
        ) from None
