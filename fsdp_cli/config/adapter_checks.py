"""``peft=lora`` checked against the rest of the run before launch: the package installed, a
strategy and model kind that take adapters, no tensor or pipeline parallel, and FSDP1's one layout
that cannot save frozen parameters. (The adapter options themselves are
:class:`fsdp_cli.adapters.options.AdapterOptions`; the layers they target are found on the meta
model later, :func:`fsdp_cli.resolve.adapter_targets_check`.)
"""

from __future__ import annotations

import importlib.util

from fsdp_cli.config.resolved import ResolvedRun
from fsdp_cli.errors import ConfigError
from fsdp_cli.extras import install_hint

ADAPTER_STRATEGIES = ("fsdp2", "fsdp", "ddp")
"""The strategies ``peft=lora`` runs under (the adapted model is parallelized like any other)."""


def check_adapters(run: ResolvedRun) -> None:
    """``peft=lora``: peft installed, a strategy and model kind that take adapters (the layers it
    wraps are found on the meta model later: :func:`fsdp_cli.resolve.adapter_targets_check`;
    tensor and pipeline parallel are refused by :mod:`fsdp_cli.config.composition`'s table)."""
    cfg = run.cfg
    if not cfg.peft.enabled:
        return
    method = cfg.peft.name.value
    if importlib.util.find_spec("peft") is None:
        raise ConfigError("peft", method, "needs the peft package", hint=install_hint("peft"))
    if run.entry.name not in ADAPTER_STRATEGIES:
        raise ConfigError(
            "strategy",
            run.entry.name,
            f"peft={method} needs fsdp-train to build and parallelize the model",
            allowed=", ".join(ADAPTER_STRATEGIES),
            hint="a LightningModule that parallelizes itself can add adapters in its own configure_model",
        )
    if run.model_kind.adapter_targets(cfg.model) is None:
        raise ConfigError("peft", method, f"model kind {run.model_kind.name} does not take adapters")
    _check_fsdp1_unsharded_adapters(run)


def _check_fsdp1_unsharded_adapters(run: ResolvedRun) -> None:
    """torch's FSDP1 cannot save a model with frozen parameters when nothing is sharded and it
    keeps the original parameters (its full state-dict hook finds the frozen ones missing)."""
    strategy = run.cfg.strategy
    if run.entry.name != "fsdp" or not strategy.use_orig_params:
        return
    if run.layout.shard == 1 or strategy.sharding_strategy.value == "NO_SHARD":
        raise ConfigError(
            "strategy.use_orig_params",
            True,
            f"peft={run.cfg.peft.name.value} under unsharded FSDP1 (shard group of {run.layout.shard}, "
            f"{strategy.sharding_strategy.value}): torch cannot save its frozen parameters",
            allowed="false here",
            hint="strategy.use_orig_params=false, strategy=fsdp2, or strategy=ddp",
        )
