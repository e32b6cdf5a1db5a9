"""Activation checkpointing per block: recompute a block's activations in backward instead of storing them."""

from __future__ import annotations

from torch import nn

from fsdp_cli.parallel.options import ActivationCheckpointing


def apply_ac(
    model: nn.Module, blocks: list[nn.Module], mode: ActivationCheckpointing, every_n: int = 2
) -> int:
    """Wrap ``blocks`` (all for ``full``, every ``every_n``-th for ``selective``); return how many were wrapped.

    The wrapper takes the block's place in its parent. State-dict keys gain a
    ``_checkpoint_wrapped_module`` segment that torch.distributed.checkpoint's state-dict helpers
    strip, so checkpoints stay interchangeable between runs with and without checkpointing.
    """
    from fsdp_cli.compat.torch_internals import checkpoint_wrapper

    if mode is ActivationCheckpointing.none:
        return 0
    chosen = blocks if mode is ActivationCheckpointing.full else blocks[every_n - 1 :: every_n]
    targets = {id(b) for b in chosen}
    wrapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in targets:
                # preserve_rng_state=False: blocks have no dropout, so replaying the RNG is wasted work.
                setattr(parent, name, checkpoint_wrapper(child, preserve_rng_state=False))
                wrapped += 1
    return wrapped
