"""LoRA under tensor parallel: each adapter pair laid out as the layer it wraps (as NeMo and
Megatron do), so that the adapted layer's output has the base's layout and the adapters'
gradients are whole on every tensor-parallel rank.

``x -> base(x) + B(A(x)) * scale``:

* a column-parallel base (output features split): ``A`` replicated (it reads the whole input,
  gathered as the base gathers it), ``B`` column-parallel with the base's output layout;
* a row-parallel base (input features split): ``A`` row-parallel (its ``r`` outputs summed over
  the ranks: a small all-reduce), ``B`` replicated, its output handed on as the base's (this rank's
  part of the sequence under sequence parallel);
* a replicated base: both replicated.

The model's plan names the wrapped layers (``layers.*.attention.wq``); peft has replaced each by a
LoRA layer whose ``base_layer`` is the original. :func:`lora_tp_plan` rewrites the plan so that
each key naming a LoRA layer names its three parts instead.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from fsdp_cli.parallel.tensor_parallel import ReplicateParallel, plan_key_matches

ADAPTER = "default"
"""peft's adapter name: its parameters are ``...lora_A.default.weight``."""


def lora_tp_plan(model: nn.Module, plan: dict[str, Any]) -> dict[str, Any]:
    """``plan`` with every key that names a LoRA layer of ``model`` replaced by its base layer's and
    its adapters' styles (and a pattern key's other matches named one by one)."""
    from peft.tuners.lora import LoraLayer

    lora = [name for name, m in model.named_modules() if isinstance(m, LoraLayer)]
    if not lora:
        return plan
    names = [name for name, _ in model.named_modules() if name]
    kept: dict[str, Any] = {}
    parts: dict[str, Any] = {}
    for key, style in plan.items():
        hits = [n for n in lora if plan_key_matches(key, n)]
        if not hits:
            kept[key] = style
            continue
        kept.update({n: style for n in names if plan_key_matches(key, n) and n not in hits})
        for name in hits:
            parts.update(adapter_styles(name, style))
    # The parts win over what the plan said of them on its own (a catch-all that replicates every
    # module holding parameters, as model=hf's plan does, names base_layer and the adapters too).
    return {**{k: v for k, v in kept.items() if k not in parts}, **parts}


def adapter_styles(name: str, style: Any) -> dict[str, Any]:
    """The styles of LoRA layer ``name``'s base layer and adapters, for a base split by ``style``."""
    if isinstance(style, ColwiseParallel):
        a: Any = ReplicateParallel(input_layouts=style.input_layouts[0])
        b: Any = ColwiseParallel(
            output_layouts=style.output_layouts[0], use_local_output=style.use_local_output
        )
    elif isinstance(style, RowwiseParallel):
        a = RowwiseParallel(input_layouts=style.input_layouts[0], output_layouts=Replicate())
        b = ReplicateParallel(output_layouts=style.output_layouts[0], use_local_output=style.use_local_output)
    elif isinstance(style, ReplicateParallel):
        a = b = style
    else:
        raise ValueError(
            f"LoRA layer {name}: its base is split by {type(style).__name__}; adapters are laid out "
            "for column-parallel, row-parallel and replicated layers"
        )
    return {f"{name}.base_layer": style, f"{name}.lora_A.{ADAPTER}": a, f"{name}.lora_B.{ADAPTER}": b}
