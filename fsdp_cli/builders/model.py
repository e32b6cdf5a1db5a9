"""Model builder: the ``model`` group -> the LightningModule to fit."""

from __future__ import annotations

from collections.abc import Callable

import lightning as L
from torch import nn

from fsdp_cli.config.manual_optimization import refuse_with_manual_optimization
from fsdp_cli.config.resolved import ResolvedRun
from fsdp_cli.errors import ConfigError
from fsdp_cli.models.causal_lm import CausalLMModule


def build_module(run: ResolvedRun) -> L.LightningModule:
    """A LightningModule from ``model._target_`` as is; anything else wrapped in :class:`CausalLMModule`
    (what each model kind builds: its registry entry, :mod:`fsdp_cli.config.model_kinds`)."""
    cfg = run.cfg
    built = run.model_kind.build(run)
    if isinstance(built, L.LightningModule):
        if not built.automatic_optimization:  # what its source did not tell before launch
            refuse_with_manual_optimization(run)
        return built
    if run.model_kind.target_decides and run.entry.user_parallelizes:
        raise ConfigError(
            "model._target_",
            cfg.model.target,
            "strategy=model_parallel needs a LightningModule with configure_model()",
            hint="use strategy=fsdp2 for a plain nn.Module: it parallelizes the model for you",
        )
    factory: Callable[[], nn.Module] = adapted(built, run) if cfg.peft.enabled else built
    return CausalLMModule(factory, optim=cfg.optim, max_steps=cfg.trainer.max_steps)


def adapted(factory: Callable[[], nn.Module], run: ResolvedRun) -> Callable[[], nn.Module]:
    """The factory's model with LoRA injected (before the strategy parallelizes it)."""
    from fsdp_cli.adapters.lora import apply_lora

    def build() -> nn.Module:
        model = factory()
        apply_lora(model, run.cfg.peft, seed=run.cfg.seed, base_dtype=run.precision.param)
        return model

    return build
