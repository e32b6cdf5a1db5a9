"""Module and parameter names as the unwrapped model reports them.

Activation checkpointing, ``torch.compile``, FSDP1 and LoRA insert a segment into the names of what
they wrap; checkpoints, the layout-independent init and the setup report all need the names the
user's model has.
"""

from __future__ import annotations

WRAPPER_SEGMENTS = frozenset(
    {"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module", "base_layer"}
)
"""(``base_layer``: the layer ``peft``'s LoRA wraps keeps its name, so its init and the weights a
folder gives it are those of the model without adapters.)"""


def canonical_name(name: str) -> str:
    """``layers.0._checkpoint_wrapped_module.attention`` -> ``layers.0.attention``."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_SEGMENTS)
