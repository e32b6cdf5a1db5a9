"""``peft=lora`` checked against the rest of the run before launch: the package installed, a
strategy and model kind that take adapters, no tensor or pipeline parallel, FSDP1's one layout
that cannot save frozen parameters, and what a quantized (QLoRA) base needs. (The adapter options themselves are
:class:`fsdp_cli.adapters.options.AdapterOptions`; the layers they target are found on the meta
model later, :func:`fsdp_cli.resolve.adapter_targets_check`.)
"""

from __future__ import annotations

import importlib.util

from fsdp_cli.adapters.options import QuantizeBase
from fsdp_cli.config.resolved import ResolvedRun
from fsdp_cli.errors import ConfigError
from fsdp_cli.extras import install_hint

ADAPTER_STRATEGIES = ("fsdp2", "fsdp", "ddp")
QUANTIZED_KINDS = ("llama", "hf")
"""The model kinds whose weights fsdp-train fills (and so can quantize as it fills them)."""
"""The strategies ``peft=lora`` runs under (the adapted model is parallelized like any other)."""


def check_adapters(run: ResolvedRun) -> None:
    """``peft=lora``: peft installed, a strategy and model kind that take adapters (the layers it
    wraps are found on the meta model later: :func:`fsdp_cli.resolve.adapter_targets_check`;
    tensor and pipeline parallel are refused by :mod:`fsdp_cli.config.composition`'s table)."""
    cfg = run.cfg
    if not cfg.peft.enabled:
        if cfg.peft.quantize_base is not QuantizeBase.none:
            raise ConfigError(
                "peft.quantize_base",
                cfg.peft.quantize_base.value,
                "quantizes the base that adapters train over; peft=none trains every weight",
                hint="peft=qlora (LoRA over an NF4 base), or peft.quantize_base=none",
            )
        return
    method = cfg.peft.name.value
    if importlib.util.find_spec("peft") is None:
        raise ConfigError("peft", method, "needs the peft package", hint=install_hint("peft"))
    check_quantized_base(run)
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


def check_quantized_base(run: ResolvedRun) -> None:
    """``peft.quantize_base=nf4`` (QLoRA): torchao installed; the base weights come from the
    model's own (quantized as they are read or drawn): no checkpoint of a full fine-tune to start
    from, no base in the checkpoints. The strategy and the parallel dimensions are the composition table's
    (qlora's row; FSDP2 refuses float64 anyway)."""
    cfg = run.cfg
    value = cfg.peft.quantize_base.value
    if cfg.peft.quantize_base is QuantizeBase.none:
        return
    key = "peft.quantize_base"
    _check_quantized_kind(run)
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError(
            key, value, "needs the torchao package (its NF4 tensor)", hint=install_hint("qlora")
        )
    if cfg.peft.save_base:
        raise ConfigError(
            "peft.save_base",
            True,
            "a 4-bit base is rebuilt from the model's own weights; checkpoints hold the adapters",
            allowed="false with peft.quantize_base=nf4",
        )
    if cfg.start_from:
        raise ConfigError(
            key,
            value,
            f"the base is quantized from the model's own weights, not from a full fine-tune's checkpoint ({cfg.start_from})",
            hint="export that run (fsdp-ckpt convert --to hf) and give it as model.path",
        )


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


def _check_quantized_kind(run: ResolvedRun) -> None:
    if run.model_kind.name not in QUANTIZED_KINDS:
        raise ConfigError(
            "peft.quantize_base",
            run.cfg.peft.quantize_base.value,
            f"fsdp-train quantizes the weights it fills itself, and model kind {run.model_kind.name} fills its own",
            allowed="the built-in model (model=tiny, llama_*) or model=hf",
            hint="peft=lora for this model",
        )
