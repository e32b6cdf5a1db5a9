"""Model builder: the ``model`` group -> the LightningModule to fit."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import lightning as L
import torch
from torch import nn

from fsdp_cli.config.manual_optimization import refuse_with_manual_optimization
from fsdp_cli.config.resolved import ResolvedRun
from fsdp_cli.config.schema import CustomModelConfig, HFModelConfig, LlamaConfig, TrainConfig
from fsdp_cli.dotted import import_object
from fsdp_cli.errors import ConfigError
from fsdp_cli.models.causal_lm import CausalLMModule


def build_module(run: ResolvedRun | TrainConfig) -> L.LightningModule:
    """A LightningModule from ``model._target_`` as is; anything else wrapped in :class:`CausalLMModule`."""
    run = ResolvedRun.of(run)
    cfg = run.cfg
    if isinstance(cfg.model, CustomModelConfig):
        built = _build_custom(cfg.model)
        if isinstance(built, L.LightningModule):
            if not built.automatic_optimization:  # what its source did not tell before launch
                refuse_with_manual_optimization(run)
            return built
        if run.entry.user_parallelizes:
            raise ConfigError(
                "model._target_",
                cfg.model.target,
                "strategy=model_parallel needs a LightningModule with configure_model()",
                hint="use strategy=fsdp2 for a plain nn.Module: it parallelizes the model for you",
            )
        factory: Callable[[], nn.Module] = built
    elif isinstance(cfg.model, HFModelConfig):
        factory = _hf_factory(run, cfg.model)
    else:
        factory = _llama_factory(run, cfg.model)
    return CausalLMModule(factory, optim=cfg.optim, max_steps=cfg.trainer.max_steps)


def _llama_factory(run: ResolvedRun, model: LlamaConfig) -> Callable[[], nn.Module]:
    from fsdp_cli.models.llama import Llama

    cfg = run.cfg
    # A strategy that parallelizes the built-in model creates it on the meta device and each rank
    # materialises only its shard; the initialisation is layout-independent, so the weights equal
    # a normal init. (FSDP1 wraps a real model; a user's parallelize_fn gets a real one too.)
    meta = run.entry.builds_on_meta(cfg.strategy)

    def factory() -> nn.Module:
        if meta:
            with torch.device("meta"):
                return Llama(model, seed=cfg.seed)
        return Llama(model, seed=cfg.seed)

    return factory


def _hf_factory(run: ResolvedRun, model: HFModelConfig) -> Callable[[], nn.Module]:
    from fsdp_cli.models.hf import build_hf_model, require_tp_plan

    cfg = run.cfg
    # FSDP2 fills the weights after sharding the meta model, FSDP1 one unit at a time while it
    # wraps; DDP keeps a whole copy on every rank, filled here.
    sharded = run.entry.fills_after_sharding

    def factory() -> nn.Module:
        built = build_hf_model(model, seed=cfg.seed)
        if cfg.tp > 1:
            require_tp_plan(built.hf, cfg.tp)
        # Built under torch.device("meta") (Trainer.init_module(empty_init=True), a rehearsal): stays there.
        if not sharded and torch.get_default_device().type != "meta":
            built.materialize("cpu")
        return built

    return factory


def _build_custom(model: CustomModelConfig) -> L.LightningModule | Callable[[], nn.Module]:
    target = import_object(model.target, "model._target_")
    kwargs = dict(model.kwargs)
    if inspect.isclass(target) and issubclass(target, L.LightningModule):
        return target(**kwargs)
    if inspect.isclass(target) and issubclass(target, nn.Module):
        # Built later, inside configure_model (under the strategy's init context).
        return lambda: target(**kwargs)
    built = target(**kwargs)
    if isinstance(built, L.LightningModule):
        return built
    if not isinstance(built, nn.Module):
        raise ConfigError(
            "model._target_",
            model.target,
            f"returned {type(built).__name__}, not an nn.Module or LightningModule",
        )
    return lambda: built
