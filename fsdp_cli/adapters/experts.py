"""LoRA on a mixture of experts' fused experts (``peft.targets=[experts]``): each ``[experts, out,
in]`` tensor of an experts module gains one low-rank pair per expert, ``W_e + alpha / r * B_e A_e``.

peft reaches these tensors through its ``target_parameters`` (a ``ParamWrapper`` that
re-parametrizes the module's tensor for each forward), which neither FSDP2 (it swaps the module's
sharded and gathered tensors itself) nor expert parallel (each rank computes on its own rows of
the tensors) can hold. Here the pairs are tensors of the experts module itself, beside the one they
adapt, laid out like it along the experts (``{name}_lora_A [experts, r, in]``,
``{name}_lora_B [experts, out, r]``): :func:`~fsdp_cli.parallel.expert_parallel.split_experts`
splits them over the ep ranks and FSDP2 shards them with the experts, so each rank adapts exactly
the experts it holds. The model's experts implementation runs unchanged on a view whose tensors
are the adapted ones (:meth:`ExpertAdapters.adapted`). A checkpoint holds the pairs under those names;
``fsdp-ckpt convert --to peft`` writes them as peft's ``target_parameters`` adapters
(:func:`fsdp_cli.checkpoint.peft_export.expert_adapter_tensors`), which peft loads onto the
transformers model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fsdp_cli.parallel.expert_parallel import expert_matrices, local_view

SUFFIXES = ("_lora_A", "_lora_B")


@dataclass(frozen=True)
class ExpertAdapters:
    """What :func:`add_expert_adapters` set on one experts module."""

    names: tuple[str, ...]
    """The adapted tensors (``gate_up_proj``, ``down_proj``; the built-in model's ``w13``, ``w2``)."""
    r: int
    scale: float
    """``alpha / r``."""
    transposed: bool
    """The tensors are ``[experts, in, out]`` (transformers' ``is_transposed`` experts: gpt-oss), not ``[experts, out, in]``."""

    def parameter_names(self) -> list[str]:
        """The pairs' names on the experts module (``{name}_lora_A``, ``{name}_lora_B``)."""
        return [name + suffix for name in self.names for suffix in SUFFIXES]

    def adapted(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``tensors`` (the module's own, or this rank's rows of them) with each adapted one
        replaced by ``W + scale * B @ A`` per expert, in W's dtype."""
        out = dict(tensors)
        for name in self.names:
            base = tensors[name]
            delta = torch.bmm(tensors[name + "_lora_B"], tensors[name + "_lora_A"]) * self.scale
            out[name] = base + (delta.transpose(1, 2) if self.transposed else delta).to(base.dtype)
        return out


def in_out(module: nn.Module, name: str) -> tuple[int, int]:
    """(in, out) features of one expert's matrix ``name``."""
    _, first, second = getattr(module, name).shape
    return (first, second) if getattr(module, "is_transposed", False) else (second, first)


def add_expert_adapters(modules: Sequence[nn.Module], r: int, alpha: float) -> None:
    """A trainable LoRA pair per expert beside each adapted tensor of each experts module (on the
    device and in the dtype of the tensor it adapts; drawn by :func:`init_expert_adapters`)."""
    for module in modules:
        names = expert_matrices(module)
        for name in names:
            base = getattr(module, name)
            fan_in, fan_out = in_out(module, name)
            experts = base.shape[0]
            for suffix, shape in (("_lora_A", (experts, r, fan_in)), ("_lora_B", (experts, fan_out, r))):
                tensor = torch.empty(shape, dtype=base.dtype, device=base.device)
                module.register_parameter(name + suffix, nn.Parameter(tensor))
        transposed = bool(getattr(module, "is_transposed", False))
        module.expert_adapters = ExpertAdapters(tuple(names), r, alpha / r, transposed)


@torch.no_grad()
def init_expert_adapters(model: nn.Module, seed: int, modules: Sequence[nn.Module] | None = None) -> None:
    """``A ~ N(0, 1/r)`` (seeded by name, layout-independent), ``B = 0``, for the experts modules
    among ``modules`` (default: all of ``model``), as :func:`~fsdp_cli.adapters.lora.init_adapters`
    draws the linear layers' pairs."""
    from fsdp_cli.models.init import seeded_normal_whole_
    from fsdp_cli.parallel.names import canonical_name

    wanted = None if modules is None else {id(m) for m in modules}
    for name, module in model.named_modules():
        adapters = getattr(module, "expert_adapters", None)
        if adapters is None or (wanted is not None and id(module) not in wanted):
            continue
        for tensor in adapters.names:
            a, b = getattr(module, tensor + "_lora_A"), getattr(module, tensor + "_lora_B")
            key = f"{canonical_name(name)}.{tensor}_lora_A"
            seeded_normal_whole_(a, std=1.0 / adapters.r, seed=seed, name=key)
            b.zero_()


@dataclass(frozen=True, eq=False)
class AdaptedExperts:
    """An experts module's forward on one rank (no expert parallel) with adapters: the model's own
    experts implementation ``compute(experts, hidden, index, weights)`` on a view whose tensors
    are the adapted ones (under expert parallel :class:`~fsdp_cli.parallel.expert_parallel.ExpertParallel`
    does the same on this rank's rows)."""

    compute: Callable[..., torch.Tensor]

    def __call__(
        self, module: nn.Module, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor
    ) -> Any:
        adapted = module.expert_adapters.adapted(dict(module.named_parameters(recurse=False)))
        return self.compute(local_view(module, adapted, module.num_experts), hidden, index, weights)
