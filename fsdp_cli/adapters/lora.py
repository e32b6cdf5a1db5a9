"""LoRA with Hugging Face ``peft``, injected into the model before it is parallelized.

``peft.inject_adapter_in_model`` replaces each target ``nn.Linear`` by a LoRA layer holding the
original as ``base_layer`` and two small linears ``lora_A`` / ``lora_B``, and freezes everything
else (``requires_grad=False``): no gradient, no optimizer state, no change. FSDP2, FSDP1 and DDP
then shard or replicate the adapted model like any other.

A model built on the meta device (FSDP2, FSDP1's unit-by-unit fill) gets its adapters on the meta
device too, and they are initialised after the base, wherever the strategy materialises it: the
model's ``init_weights`` is chained with :func:`init_adapters`. The adapters' init is ``peft``'s
``gaussian`` one (``lora_A ~ N(0, 1/r)``, ``lora_B = 0``, so the adapted model starts equal to the
base) drawn layout-independently (:func:`fsdp_cli.models.init.seeded_normal_`): every layout
starts from the same adapters.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from fsdp_cli.adapters.dtype import widen
from fsdp_cli.adapters.experts import AdaptedExperts, add_expert_adapters, init_expert_adapters
from fsdp_cli.adapters.options import AdapterDtype, AdapterOptions, QuantizeBase
from fsdp_cli.adapters.quantize import quantize_base
from fsdp_cli.adapters.targets import adapted_experts, adapter_layers, trainable_modules
from fsdp_cli.adapters.tensor_parallel import ADAPTER, lora_tp_plan
from fsdp_cli.models.init import seeded_normal_
from fsdp_cli.parallel.names import canonical_name


def lora_config(options: AdapterOptions, layers: list[str]) -> Any:
    """``peft.LoraConfig`` for ``options``, targeting exactly ``layers`` (full module names)."""
    from peft import LoraConfig

    return LoraConfig(
        r=options.r,
        lora_alpha=options.alpha,
        lora_dropout=options.dropout,
        target_modules=layers,
        bias=options.bias.value,
        init_lora_weights="gaussian",
    )


def apply_lora(
    model: nn.Module, options: AdapterOptions, *, seed: int, base_dtype: str | None = None
) -> list[str]:
    """Inject LoRA into ``model`` in place, freeze the rest, initialise the adapters (now, or
    after the strategy materialises a meta model) and, for QLoRA, hold the wrapped layers' weights
    in NF4 (:mod:`fsdp_cli.adapters.quantize`); returns the adapted layers' names."""
    from peft import inject_adapter_in_model

    layers = adapter_layers(model, options)
    experts = adapted_experts(model, options)
    on_meta = any(p.is_meta for p in model.parameters())
    if layers:
        inject_adapter_in_model(lora_config(options, layers), model, low_cpu_mem_usage=on_meta)
    else:  # (the experts alone: peft freezes the rest where it injects)
        model.requires_grad_(False)
    if experts:
        add_expert_adapters(experts, options.r, options.alpha)
        model.route_experts(AdaptedExperts)  # type: ignore[operator]
    for name in trainable_modules(model, options):
        model.get_submodule(_module_path(model, name)).requires_grad_(True)
    if options.adapter_dtype is AdapterDtype.float32:
        widen(model)  # before the init below: adapters drawn and stored in fp32 over a 16-bit base
    chain_tp_plan(model)
    if on_meta:
        chain_init(model, seed)
    else:
        init_adapters(model, seed)
    if options.quantize_base is QuantizeBase.nf4:
        # (on meta: filled quantized whole by the init chained above; NF4 of the dtype the
        # precision stores parameters in, ``base_dtype``: what a forward dequantizes)
        quantize_base(model, dtype=getattr(torch, base_dtype) if base_dtype else None)
    return layers


def _module_path(model: nn.Module, canonical: str) -> str:
    """The module's real path (``base_layer`` and wrappers included) for its canonical name."""
    for name, _ in model.named_modules():
        if canonical_name(name) == canonical:
            return name
    return canonical


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int, modules: Sequence[nn.Module] | None = None) -> None:
    """``lora_A ~ N(0, 1/r)`` (seeded by name, layout-independent), ``lora_B = 0``, for the LoRA
    layers among ``modules`` (default: all of ``model``)."""
    from peft.tuners.lora import LoraLayer

    init_expert_adapters(model, seed, modules)
    wanted = None if modules is None else {id(m) for m in modules}
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer) or ADAPTER not in module.lora_A:
            continue
        a, b = module.lora_A[ADAPTER], module.lora_B[ADAPTER]
        if wanted is not None and id(a) not in wanted and id(module) not in wanted:
            continue
        seeded_normal_(a.weight, std=1.0 / module.r[ADAPTER], seed=seed, name=f"{name}.lora_A.weight")
        b.weight.zero_()


def chain_init(model: nn.Module, seed: int) -> None:
    """Give ``model`` an ``init_weights`` that runs its own (or each module's ``reset_parameters``)
    and then :func:`init_adapters`: the strategies call it once the tensors exist."""
    own: Callable[..., Any] | None = getattr(model, "init_weights", None)

    def init_weights(buffer_device: Any = None, modules: Sequence[nn.Module] | None = None) -> None:
        if own is None:
            _reset_each(model if modules is None else modules)
        else:
            params = inspect.signature(own).parameters
            kwargs = {"buffer_device": buffer_device, "modules": modules}
            own(**{k: v for k, v in kwargs.items() if k in params})
        init_adapters(model, seed, modules)

    model.init_weights = init_weights  # type: ignore[method-assign]


def chain_tp_plan(model: nn.Module) -> None:
    """Give ``model`` (if it has a tensor-parallel plan) one that lays out each adapter pair as
    the layer it wraps (:func:`fsdp_cli.adapters.tensor_parallel.lora_tp_plan`)."""
    own: Callable[..., Any] | None = getattr(model, "tp_plan", None)
    if own is None:
        return

    def tp_plan(*, sequence_parallel: bool) -> dict[str, Any]:
        return lora_tp_plan(model, own(sequence_parallel=sequence_parallel))

    model.tp_plan = tp_plan  # type: ignore[method-assign]


@torch.no_grad()
def _reset_each(modules: nn.Module | Sequence[nn.Module]) -> None:
    """What Lightning does for a meta model without ``init_weights``: each module's own init."""
    for module in modules.modules() if isinstance(modules, nn.Module) else modules:
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()


def adapter_parameter_counts(model: nn.Module) -> tuple[int, int]:
    """(trainable, all) parameter counts (global sizes, sharded or not)."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in model.parameters())
