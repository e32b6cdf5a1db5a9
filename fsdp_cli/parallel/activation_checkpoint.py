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


def in_place_of(model: nn.Module, units: list[nn.Module]) -> list[nn.Module]:
    """Each of ``units``, or the checkpoint wrapper that took its place: what ``fully_shard`` goes on.

    FSDP's hooks must run outside the checkpointed region (torchtitan's order too). With
    ``fully_shard`` on the block inside the wrapper, its pre-forward hook casts the block's
    floating-point inputs to ``param_dtype`` (the Llama's float32 rope table to bf16) in forward,
    but torch 2.11's hook skips that cast in the recompute (torch 2.13's does not), so the
    recomputed tensors came out float32 where forward saved bf16 and checkpoint raised
    ``CheckpointError``. On the wrapper, the cast happens once, before checkpoint saves the
    inputs, and the recompute replays the block on those.
    """
    from fsdp_cli.compat.torch_internals import CheckpointWrapper

    # A wrapper's one child is the module it wraps.
    wrapper_of = {id(next(m.children())): m for m in model.modules() if isinstance(m, CheckpointWrapper)}
    return [wrapper_of.get(id(unit), unit) for unit in units]
