"""The adapter settings, as plain (torch-free) options owned by this room.

The CLI's ``peft`` group is :class:`AdapterOptions` (``peft=none``, the default, or ``peft=lora``);
:func:`fsdp_cli.adapters.lora.apply_lora` reads the same fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from fsdp_cli.ranges import at_least, between, positive


class AdapterMethod(Enum):
    none = "none"
    """Full fine-tuning: every parameter trains."""
    lora = "lora"
    """Low-rank adapters (Hugging Face ``peft``'s LoRA) on the target layers; the rest is frozen."""


class LoraBias(Enum):
    """Which biases train beside the adapters (``peft``'s ``LoraConfig.bias``)."""

    none = "none"
    all = "all"
    lora_only = "lora_only"
    """Only the biases of the layers adapters wrap."""


class AdapterDtype(Enum):
    """What the trained parameters are stored in when the precision stores the base in 16 bits."""

    float32 = "float32"
    """fp32 adapters (and ``peft.trainable`` modules) over a bf16/fp16 base (``bf16-true``, ``16-true``)."""
    same = "same"
    """The precision's own dtype for everything: bf16 adapters under ``bf16-true``."""


class QuantizeBase(Enum):
    """How the frozen base weights that adapters wrap are held (QLoRA)."""

    none = "none"
    """In the precision's dtype, like every other parameter."""
    nf4 = "nf4"
    """4-bit NormalFloat (QLoRA; torchao's NF4 tensor, sharded by FSDP2): the weights of the layers
    LoRA wraps take about a quarter of their bf16 memory, and each forward dequantizes one layer."""


ALIASES = ("all", "attention", "mlp")
"""Short names for ``peft.targets``: every linear layer of the blocks, or their attention or MLP part."""
EXPERTS = "experts"
"""``peft.targets`` entry for a mixture of experts' fused experts (``[experts, out, in]`` tensors,
not linear layers): a LoRA pair per expert (:mod:`fsdp_cli.adapters.experts`)."""


@dataclass
class AdapterOptions:
    """What is trained when adapting a model (``peft=lora``) instead of training all of it."""

    name: AdapterMethod = AdapterMethod.none
    """none (full fine-tuning) or lora; set by the option file (``peft=lora``)."""
    r: int = field(default=8, metadata=at_least(1))
    """LoRA rank: each adapted ``d_out x d_in`` layer gains ``r x (d_in + d_out)`` trainable
    parameters; at most the layer's smaller side."""
    alpha: float = field(default=16.0, metadata=positive())
    """LoRA scaling: the adapter's output is multiplied by ``alpha / r``."""
    dropout: float = field(default=0.0, metadata=between(0, 1, high_open=True))
    """Dropout on the adapters' input (``peft``'s ``lora_dropout``)."""
    targets: list[str] = field(default_factory=lambda: ["all"])
    """The linear layers that get adapters: module names as the model spells them (a name matches
    itself and every module path ending in it: ``wq``, ``attention.wq``, ``q_proj``), or an alias:
    ``all`` (every linear layer of the repeated blocks), ``attention``, ``mlp``; and ``experts``:
    a mixture of experts' fused experts, a LoRA pair per expert (``[all, experts]``: both)."""
    bias: LoraBias = LoraBias.none
    """none, all or lora_only: which biases train too."""
    trainable: list[str] = field(default_factory=list)
    """Modules that train in full beside the adapters: names as the model spells them (matched as
    ``targets`` are), or ``norms`` (every normalisation layer) and ``head`` (the output layer)."""
    adapter_dtype: AdapterDtype = AdapterDtype.float32
    """float32 or same: under a precision that stores parameters in 16 bits (``bf16-true``,
    ``16-true``), the trained modules (``lora_A``/``lora_B``, ``peft.trainable``'s) are stored,
    updated and given optimizer state in fp32 (float32, the default) while the frozen base stays
    16-bit; or in the base's dtype (same). Other precisions store everything in fp32 anyway."""
    quantize_base: QuantizeBase = QuantizeBase.none
    """none or nf4 (QLoRA, ``peft=qlora``): the weights of the layers that get adapters held in
    4-bit NormalFloat, quantized as they are loaded, each rank keeping its shard (strategy=fsdp2;
    pip install ".[qlora]"). The adapters, embeddings, norms and head keep their dtype."""
    save_base: bool = False
    """Sharded checkpoints also hold the frozen base weights (default: the trainable parameters
    only, megabytes for an 8B model; the base is rebuilt from the model's own weights on resume)."""

    @property
    def enabled(self) -> bool:
        return self.name is not AdapterMethod.none
