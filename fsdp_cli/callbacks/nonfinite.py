"""Non-finite losses and gradient norms: caught, named by step and rank, never trained on or saved.

Between logging steps the guard only keeps each step's loss and gradient norm as device scalars
(no ``.item()``, no collective, so a GPU keeps running ahead of the host). On a logging step it
is the metrics callback's loss all-reduce: one ``all_reduce`` (sum) of this rank's values since
the last log, the single collective and host sync a hand-written loop that logs as often makes.
Every rank reads the mean loss from it, and whether anything was not finite: a sum is finite only
if every rank's value was. Only then (a failing run) does an ``all_gather`` of every rank's values
follow, to name the first bad step and its ranks. All ranks therefore fail together, on the same
step, and none is left waiting in a collective.
A checkpoint save forces the same check first, so nothing trained on a non-finite value is
ever saved over the last good checkpoint.

``trainer.skip_nonfinite_steps=N`` needs the answer before the optimizer steps: it checks the
(all-rank) gradient norm on the host every step, drops that step's gradients so the optimizer
leaves the weights and its moments alone, and fails on the (N+1)-th such step. Under
``precision=16-mixed`` the gradient scaler already skips overflowing steps: only losses count.
"""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import torch
import torch.distributed as dist

from fsdp_cli.errors import RunFailure


class NonFiniteError(RunFailure):
    """A loss or gradient norm that is NaN or infinite."""


class NonFiniteGuard(L.Callback):
    """Arguments:
    skip_budget: ``trainer.skip_nonfinite_steps``.
    clipping: the run's :class:`~fsdp_cli.callbacks.clipping.GradientClipping` (its norm is checked).
    check_grad_norm: False under fp16 loss scaling, where overflowing steps are normal.
    """

    def __init__(
        self, *, skip_budget: int = 0, clipping: Any | None = None, check_grad_norm: bool = True
    ) -> None:
        self.skip_budget = skip_budget
        self.clipping = clipping
        self.check_grad_norm = check_grad_norm
        self.skipped: list[int] = []
        self._steps: list[int] = []
        self._losses: list[torch.Tensor] = []
        self._norm_steps: list[int] = []
        self._norms: list[torch.Tensor] = []

    # ------------------------------------------------------------------ recording (no sync)

    def record_loss(self, step: int, loss: torch.Tensor | None) -> None:
        """The step's loss (mean over its micro-batches), from the metrics callback."""
        if loss is not None:
            self._steps.append(step)
            # float64: a 64-true loss keeps its precision (lower precisions are exact in it).
            self._losses.append(loss.detach().double().reshape(()))

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any
    ) -> None:
        step = trainer.global_step + 1  # the step this update makes
        norm = self._grad_norm(trainer, pl_module)
        if norm is None:
            return
        if self.skip_budget > 0:
            self._skip_if_not_finite(step, norm, optimizer)
        self._norm_steps.append(step)
        self._norms.append(norm.detach().float().reshape(()))

    def _grad_norm(self, trainer: L.Trainer, pl_module: L.LightningModule) -> torch.Tensor | None:
        if not self.check_grad_norm:
            return None
        norm = getattr(self.clipping, "grad_norm", None) if self.clipping is not None else None
        if norm is None and self.skip_budget > 0:
            from fsdp_cli.callbacks.clipping import clip_grad_norm

            # No clipping by norm computed it: an infinite limit measures without changing anything.
            norm = clip_grad_norm(trainer.model, pl_module.parameters(), math.inf)
        return norm

    def _skip_if_not_finite(self, step: int, norm: torch.Tensor, optimizer: Any) -> None:
        if bool(torch.isfinite(norm)):  # the one host sync per step that skipping costs
            return
        if len(self.skipped) >= self.skip_budget:
            raise NonFiniteError(
                f"non-finite gradient norm at step {step}; already skipped {len(self.skipped)} step(s) "
                f"(trainer.skip_nonfinite_steps={self.skip_budget}) at {', '.join(map(str, self.skipped))}"
            )
        self.skipped.append(step)
        # Parameters without a gradient are left alone by torch optimizers: weights and moments unchanged.
        optimizer.zero_grad(set_to_none=True)

    # ------------------------------------------------------------------ checking (one collective)

    @property
    def pending(self) -> bool:
        return bool(self._losses or self._norms)

    def check(self, step: int) -> float:
        """All ranks, together: raise :class:`NonFiniteError` for anything non-finite since the
        last check; return the current step's loss averaged over ranks (NaN if it had none)."""
        steps, norm_steps = self._steps, self._norm_steps
        values = self._losses + self._norms
        self._steps, self._losses, self._norm_steps, self._norms = [], [], [], []
        if not values:
            return math.nan
        device = values[0].device
        k = len(steps)
        # Summed over the ranks, a value is finite only if every rank's was (NaN and the
        # infinities stay what they are in a sum of float64 values of losses and norms).
        sums = _sum_over_ranks(torch.stack([v.to(device, non_blocking=True) for v in values]))
        if not all(map(math.isfinite, sums)):
            # Something was not finite: a second collective names the first bad step and its ranks.
            rows = _gather_rows(torch.stack([v.to(device, non_blocking=True) for v in values]))
            losses, norms = [row[:k] for row in rows], rows[0][k:]  # the norm is the same on every rank
            self._raise_first_bad(step, steps, losses, norm_steps, norms)
        if not steps or steps[-1] != step:
            return math.nan
        return sums[k - 1] / _world_size()

    def _raise_first_bad(
        self,
        step: int,
        steps: list[int],
        losses: list[list[float]],
        norm_steps: list[int],
        norms: list[float],
    ) -> None:
        skipped = set(self.skipped)
        bad_loss = [
            (s, r)
            for i, s in enumerate(steps)
            for r, row in enumerate(losses)
            if s not in skipped and not math.isfinite(row[i])
        ]
        bad_norm = [s for s, v in zip(norm_steps, norms) if s not in skipped and not math.isfinite(v)]
        first = min([s for s, _ in bad_loss] + bad_norm, default=None)
        if first is None:
            return
        ranks = sorted({r for s, r in bad_loss if s == first})
        what = f"loss (rank {','.join(map(str, ranks))})" if ranks else "gradient norm"
        if ranks and first in bad_norm:
            what += " and gradient norm"
        where = "" if first == step else f" (detected at step {step})"
        hint = "" if self.skip_budget else "; trainer.skip_nonfinite_steps=N skips up to N such steps"
        raise NonFiniteError(f"non-finite {what} at step {first}{where}; nothing was saved after it{hint}")

    def check_before_save(self, trainer: L.Trainer) -> None:
        """Called by the checkpoint callback before every save: never save what a non-finite
        value has touched. (At a logging step the metrics callback has just checked.)"""
        if self.pending:
            self.check(trainer.global_step)

    # ------------------------------------------------------------------ state (a budget spans resumes)

    def state_dict(self) -> dict[str, Any]:
        return {"skipped": list(self.skipped)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skipped = [int(s) for s in state.get("skipped", [])]


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _sum_over_ranks(values: torch.Tensor) -> list[float]:
    """``values`` summed over every rank: one collective, one sync (the tensor is summed in place)."""
    if _world_size() > 1:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values.tolist()


def _gather_rows(values: torch.Tensor) -> list[list[float]]:
    """Every rank's ``values`` (the same length everywhere), one row per rank: one collective, one sync."""
    world = _world_size()
    if world == 1:
        return [values.tolist()]
    out = values.new_empty(world * values.numel())
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, values.contiguous())
    return out.view(world, -1).tolist()
