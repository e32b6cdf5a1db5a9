"""A weight the first and the last stage share (tied embeddings) kept one weight across ranks.

The first stage holds it as the embedding, the last as the head: each rank of the pair holds a
copy (the same values: loaded from one checkpoint tensor, or drawn from one seed), and after each
step's backward the two gradients are summed between them, so both copies take the same update
and stay equal, as Megatron keeps a tied embedding under pipeline parallel. The global gradient
norm counts the weight once (the last stage's copy is left out of it: :func:`count_elsewhere`).
Checkpoints hold each copy under its own name (as a one-process model's ``state_dict`` holds a
tied weight under both), so a save reads back at any layout.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fsdp_cli.parallel.grad_norm import count_elsewhere


class TiedWeight:
    """This rank's copy of the tied weight (None on the ranks between) and the group of the two
    ranks holding a copy."""

    def __init__(
        self,
        param: nn.Parameter | None,
        group: Any,
        *,
        counted_elsewhere: bool = False,
        aliases: dict[str, str] | None = None,
    ) -> None:
        self.param, self.group = param, group
        self.counted_elsewhere = counted_elsewhere
        """This copy is the last stage's: the global norm counts the first stage's."""
        self.aliases = aliases or {}
        """On the last stage's rank: {this copy's name: the first copy's} (names of the module the
        optimizer's state is keyed by): its optimizer state is saved once, under the first name."""

    @classmethod
    def of(
        cls, model: nn.Module, names: tuple[str, str], pp_mesh: Any, last_pp_rank: int, prefix: str = ""
    ) -> TiedWeight:
        """The copy this rank holds of ``names`` (first stage's, last stage's) inside ``model`` (cut
        and parallelized), and the group of its pipeline's rank 0 (first stage) and
        ``last_pp_rank``; made only on those two ranks (the others never call into it).
        ``prefix``: ``model``'s name in the module whose parameter names key the optimizer state."""
        import torch.distributed as dist

        ranks = [int(r) for r in pp_mesh.mesh.flatten().tolist()]
        pair = [ranks[0], ranks[last_pp_rank]]
        local = pp_mesh.get_local_rank()
        if local not in (0, last_pp_rank):
            return cls(None, None)
        param = _parameter(model, names[0] if local == 0 else names[1])
        group = dist.new_group(pair, use_local_synchronization=True)
        last = local == last_pp_rank
        aliases = {prefix + names[1]: prefix + names[0]} if last else {}
        return cls(param, group, counted_elsewhere=last, aliases=aliases)

    def sum_gradients(self) -> None:
        """Both copies' gradients become their sum (each copy saw the part of the loss its stage
        computes). A copy without a gradient (frozen: LoRA) is left alone."""
        import torch.distributed as dist

        if self.param is None or not self.param.requires_grad or self.param.grad is None:
            return
        if self.counted_elsewhere:
            # Marked now, not when the stages were cut: materializing a model from the meta device
            # swaps its parameters' contents (``torch.utils.swap_tensors``; the object stays).
            count_elsewhere(self.param)
        grad = self.param.grad
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        if local.device.type == "cpu" and dist.get_backend(self.group) != "gloo":
            moved = local.to(torch.accelerator.current_accelerator())
            dist.all_reduce(moved, group=self.group)
            local.copy_(moved)
        else:
            dist.all_reduce(local, group=self.group)


def _parameter(model: nn.Module, name: str) -> nn.Parameter:
    try:
        return model.get_parameter(name)
    except AttributeError:
        raise RuntimeError(f"the tied weight {name} is not on the stage that holds it") from None
