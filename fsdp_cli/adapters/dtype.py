"""fp32 adapters over a base stored in 16 bits (``peft.adapter_dtype=float32`` under ``bf16-true``).

The modules kept in fp32 are the *trainable leaves*: leaf modules whose own parameters all train
(each ``lora_A``/``lora_B``, ``peft.trainable``'s norms and head), and the LoRA pairs beside a
mixture of experts' fused tensors. They are the units FSDP1 wraps
apart (:func:`fsdp_cli.strategies.fsdp1.trainable_apart_policy`), so each FSDP1 flat parameter
still holds one dtype; FSDP2 (torch >= 2.5) and DDP take mixed dtypes as they are. A trainable
bias of a frozen layer (``peft.bias``) stays in the base's dtype with its layer.

Three steps keep them fp32: :func:`widen` right after peft injects the adapters (on the meta
device it costs nothing, and the adapters are then initialised in fp32), the precision plugin's
:func:`convert_all_but_trainable_leaves` instead of Lightning's ``module.to(bf16)``, and, for
``peft.trainable``'s modules, hooks that compute in fp32 and hand back the base's dtype (LoRA
layers do that themselves: peft casts the adapter's input to its weight's dtype).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fsdp_cli.compat.torch_internals import apply_to_tensors

NARROW = (torch.bfloat16, torch.float16)


def trainable_leaves(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Leaf modules with parameters, all of which train."""
    out = []
    for name, module in model.named_modules():
        own = list(module.parameters(recurse=False))
        if own and not any(True for _ in module.children()) and all(p.requires_grad for p in own):
            out.append((name, module))
    return out


def expert_pairs(model: nn.Module) -> list[nn.Parameter]:
    """The LoRA pairs beside fused experts (:mod:`fsdp_cli.adapters.experts`): trainable tensors of
    a frozen experts module, kept in fp32 like the trainable leaves."""
    out = []
    for module in model.modules():
        adapters = getattr(module, "expert_adapters", None)
        if adapters is not None:
            out += [getattr(module, name) for name in adapters.parameter_names()]
    return out


def widen(model: nn.Module) -> None:
    """Store the trainable leaves in fp32 where they were created 16-bit (under ``bf16-true``
    Lightning builds the model with a bf16 default dtype; a Hugging Face model is built in fp32
    and only its base is converted later). Leaves outside LoRA layers compute in fp32 and hand
    back the dtype their input had, whichever that turns out to be."""
    for pair in expert_pairs(model):
        if pair.dtype in NARROW:
            pair.data = pair.data.to(torch.float32)
    for name, module in trainable_leaves(model):
        if any(p.dtype in NARROW for p in module.parameters(recurse=False)):
            module.to(torch.float32)  # (64-true's float64 stays)
        if ".lora_A." not in f"{name}." and ".lora_B." not in f"{name}.":
            _compute_in_own_dtype(module)


def _compute_in_own_dtype(module: nn.Module) -> None:
    """The module's floating inputs cast to its own dtype (fp32 here; as peft casts an adapter's
    input), its output back to its input's dtype, so that the 16-bit layers around it see what
    they would without it (no-ops where the whole model has one dtype)."""
    given: list[torch.dtype] = []  # a stack: a forward recomputed inside another stays paired

    def cast_in(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        dtypes = [a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
        own = next(module.parameters()).dtype
        given.append(dtypes[0] if dtypes else own)
        return tuple(_cast(a, own) for a in args)

    def cast_out(_: nn.Module, __: Any, output: Any) -> Any:
        return _cast(output, given.pop())

    module.register_forward_pre_hook(cast_in)
    module.register_forward_hook(cast_out)


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(dtype)
    return value


def convert_all_but_trainable_leaves(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """What Lightning's ``*-true`` precision plugins do (``module.to(dtype)``: floating parameters
    and buffers), except to the trainable leaves' parameters, which stay as :func:`widen` made
    them, and to a QLoRA base's NF4 weights (they keep the dtype they dequantize to)."""
    from fsdp_cli.parallel.nf4 import is_quantized

    keep = {id(p) for _, m in trainable_leaves(module) for p in m.parameters(recurse=False)}
    keep |= {id(p) for p in module.parameters() if is_quantized(p)}  # (.to(dtype) would dequantize it)
    keep |= {id(p) for p in expert_pairs(module)}

    def convert(t: torch.Tensor) -> torch.Tensor:
        return t if id(t) in keep or not t.is_floating_point() else t.to(dtype)

    return apply_to_tensors(module, convert)
