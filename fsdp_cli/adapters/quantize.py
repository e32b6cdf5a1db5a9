"""QLoRA's frozen base: the weights LoRA wraps held in 4-bit NormalFloat (:mod:`fsdp_cli.parallel.nf4`).

``peft.quantize_base=nf4`` (``peft=qlora``) replaces the weight of each layer that gets adapters
(``base_layer.weight``) by an NF4 tensor right after the adapters are injected, on the meta
device: FSDP2 then shards it like any parameter, and the strategies fill it quantized whole. The
adapters, norms and embeddings keep their dtype (fp32 adapters under ``peft.adapter_dtype=float32``).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from fsdp_cli.parallel.nf4 import BLOCK, SCALER_BLOCK, is_quantized, nf4_module


def base_layers(model: nn.Module) -> Iterator[tuple[str, nn.Linear]]:
    """The linear layers that LoRA wraps (each LoRA layer's ``base_layer``)."""
    from peft.tuners.lora import LoraLayer

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            base = module.get_base_layer()
            if isinstance(base, nn.Linear):
                yield f"{name}.base_layer", base


def check_quantized_shapes(model: nn.Module, layers: list[str], *, shards: int) -> None:
    """Each of ``layers`` (canonical names) splits into NF4 blocks on each of ``shards`` ranks;
    else one line naming the layer (before launch, on the meta model)."""
    from fsdp_cli.errors import ConfigError
    from fsdp_cli.parallel.names import canonical_name
    from fsdp_cli.parallel.nf4 import shape_problem

    modules = {canonical_name(n): m for n, m in model.named_modules()}
    for layer in layers:
        problem = shape_problem(tuple(modules[layer].weight.shape), shards)
        if problem:
            raise ConfigError(
                "peft.quantize_base",
                "nf4",
                f"{layer}.weight cannot be held in NF4: {problem}",
                hint="leave that layer out of peft.targets (it then stays frozen in its dtype, without adapters), or a dp size that divides it",
            )


@torch.no_grad()
def quantize_base(model: nn.Module, dtype: torch.dtype | None = None) -> int:
    """Replace each LoRA layer's base weight by its NF4 form, standing for the weight in ``dtype``
    (default: its own); on the meta device the form alone, filled later by
    :func:`fsdp_cli.parallel.nf4.write_full`. Returns how many."""
    _, to_nf4 = nf4_module()
    count = 0
    for _, layer in base_layers(model):
        weight = layer.weight.detach()
        if not is_quantized(weight):
            weight = weight if dtype is None else weight.to(dtype)
            layer.weight = nn.Parameter(to_nf4(weight, BLOCK, SCALER_BLOCK), requires_grad=False)
            count += 1
    return count
