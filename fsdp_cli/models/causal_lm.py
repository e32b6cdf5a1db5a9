"""The LightningModule that trains any ``nn.Module`` as a causal language model.

``forward(input_ids[B, T])`` must return logits ``[B, T, V]`` (or an object with ``.logits``).
The module builds the model in ``configure_model`` (so strategies may create it on the meta
device and shard it) and computes next-token cross-entropy.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from fsdp_cli.models.args import OptimizerArgs, Scheduler
from fsdp_cli.models.llama import at_least_fp32
from fsdp_cli.models.losses import token_weight
from fsdp_cli.parallel.context_parallel import ContextParallel


class CausalLMModule(L.LightningModule):
    """Next-token prediction on batches of token ids ``[B, T + 1]``.

    Arguments:
        model_factory: builds the ``nn.Module`` (called once, inside ``configure_model``).
        optim: AdamW and learning-rate schedule settings.
        max_steps: the schedule's horizon (or where ``max_epochs`` ends training, when that comes first).
    """

    context_parallel: ContextParallel | None = None
    """Set under context parallel (cp > 1): the steps give the model this rank's slice of each
    sequence (shifted before the split) and weigh the loss so that the cp ranks' gradients, which
    FSDP2 averages like data-parallel ones, are the whole sequence's."""

    def __init__(
        self,
        model_factory: Callable[[], nn.Module],
        optim: OptimizerArgs,
        max_steps: int,
    ) -> None:
        super().__init__()
        self.model_factory = model_factory
        self.model: nn.Module | None = None
        self.optim = optim
        self.max_steps = max_steps
        self.num_parameters: int | None = None
        self._val_sums: torch.Tensor | None = None  # labelled validation: (loss sum, supervised labels)
        self._after_step: Callable[[], None] | None = None  # the model's update after an optimizer step

    def __setattr__(self, name: str, value: Any) -> None:
        # Lightning names the hook it is in (a str, or None) before and after every hook it calls:
        # 46 times a step. nn.Module's __setattr__ first checks the value against Parameter, Module
        # and Buffer (1.3 us here); this plain attribute needs none of it (0.1 us).
        if name == "_current_fx_name":
            object.__setattr__(self, name, value)
            return
        super().__setattr__(name, value)

    def configure_model(self) -> None:
        if self.model is None:
            self.model = self.model_factory()
            # Looked up once: a model without it would raise inside nn.Module's lookup every step.
            self._after_step = getattr(self.model, "update_balance_bias", None)
            # Counted before any sharding (meta tensors have sizes too).
            self.num_parameters = sum(p.numel() for p in self.model.parameters())

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        assert self.model is not None, "configure_model() has not run"
        # Positions only for packed sequences: a plain module taking input_ids alone trains unpacked.
        out = (
            self.model(input_ids)
            if position_ids is None
            else self.model(input_ids, position_ids=position_ids)
        )
        # A tensor is the common case: no failing attribute lookup per step for it.
        return out if isinstance(out, torch.Tensor) else out.logits

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        if self.context_parallel is not None:  # equal slices: the mean of their means is the batch's
            inputs, targets, _ = self.context_parallel.split_batch(batch)
        else:
            inputs, targets = self.pipeline_inputs(batch)
        return self._with_auxiliary(self.pipeline_loss(self(inputs), targets))

    def _with_auxiliary(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` plus what the model's last forward adds to training (a mixture of experts'
        load-balancing loss, times its coefficient: ``pop_auxiliary_loss()``; metrics.jsonl shows
        it apart, :meth:`step_metrics`)."""
        pop = getattr(self.model, "pop_auxiliary_loss", None)
        auxiliary = pop() if pop is not None else None
        return loss if auxiliary is None else loss + auxiliary.to(loss.dtype)

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        """Lightning's step, then what the model updates after one: a mixture of experts' routing
        bias (auxiliary-loss-free balancing, ``update_balance_bias()``)."""
        super().optimizer_step(*args, **kwargs)
        if self._after_step is not None:
            self._after_step()

    def step_metrics(self) -> dict[str, float]:
        """What metrics.jsonl adds to a logged step's row (read only then: a host sync): a mixture
        of experts' load-balancing loss and its experts' load, over every rank's tokens."""
        balance = getattr(self.model, "balance", None)
        if balance is None:
            return {}
        return {"moe_aux_loss": float(balance.loss), **balance.loads()}

    # The pipeline hooks (pp > 1: the strategy runs the step through a schedule, which feeds the
    # inputs to the first stage and hands the last stage's output to the loss, micro-batch by
    # micro-batch); the steps above use the same two, so a pipeline computes the same loss.

    def pipeline_inputs(self, batch: torch.Tensor | dict[str, torch.Tensor]) -> Any:
        """A batch of ``[B, T + 1]`` token ids -> (inputs, next-token targets); a labelled batch
        (``data=chat``) -> a :class:`~fsdp_cli.pipeline.batch.PipelineBatch` (:meth:`_labelled_pipeline_batch`)."""
        if isinstance(batch, dict):
            return self._labelled_pipeline_batch(batch)
        return batch[:, :-1], batch[:, 1:]

    def _labelled_pipeline_batch(self, batch: dict[str, torch.Tensor]) -> Any:
        """Input ids to the first stage, labels to the loss, packed positions to every stage; the
        loss of a micro-batch of ``m`` rows is :meth:`training_step`'s for ``m`` rows, so that the
        schedule's mean over micro-batches is the whole batch's token-weighted loss (in validation:
        the batch's summed token losses, for :meth:`pipeline_validation`)."""
        from fsdp_cli.pipeline.batch import PipelineBatch

        rows, training = batch["input_ids"].shape[0], self.training

        def loss(logits: Any, labels: torch.Tensor) -> torch.Tensor:
            logits = logits if isinstance(logits, torch.Tensor) else logits.logits
            total = F.cross_entropy(at_least_fp32(logits).flatten(0, 1), labels.flatten(), reduction="sum")
            micro = labels.shape[0]
            if not training:
                return total * (rows / micro)
            return total * (
                batch["step_sequences"][0].to(total.dtype) / (batch["step_supervised"][0] * micro)
            )

        positions = batch.get("position_ids")
        kwargs = {} if positions is None else {"position_ids": positions}
        return PipelineBatch(inputs=batch["input_ids"], targets=batch["labels"], kwargs=kwargs, loss=loss)

    def pipeline_validation(
        self, batch: torch.Tensor | dict[str, torch.Tensor], loss: torch.Tensor
    ) -> torch.Tensor:
        """A validation batch the pipeline ran (``loss``: its loss, on every rank): a labelled
        batch's summed token losses join the run's sums (``val_loss`` is the mean over the
        supervised tokens, as at pp=1); a batch of token ids logs its mean loss."""
        if not isinstance(batch, dict):
            self.log("val_loss", loss, sync_dist=True, prog_bar=True)
            return loss
        return self._add_val_sums(loss.detach().double(), (batch["labels"] != -100).sum().double())

    def pipeline_loss(self, logits: Any, targets: torch.Tensor) -> torch.Tensor:
        """Next-token cross-entropy of one (micro-)batch's logits."""
        logits = logits if isinstance(logits, torch.Tensor) else logits.logits
        # Cross-entropy in fp32 at least (fp64 under 64-true): bf16 log-softmax over a large
        # vocabulary is lossy.
        wide = at_least_fp32(logits)
        return F.cross_entropy(wide.flatten(0, 1), targets.flatten())

    def _token_loss_sum(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Summed cross-entropy of the supervised labels of a labelled batch (``data=chat``: -100 elsewhere)."""
        logits = self(batch["input_ids"], position_ids=batch.get("position_ids"))
        labels = batch["labels"]
        return F.cross_entropy(at_least_fp32(logits).flatten(0, 1), labels.flatten(), reduction="sum")

    def training_step(self, batch: torch.Tensor | dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if isinstance(batch, dict):
            # Token-weighted: the weight (sequences / supervised labels of the global batch, from the data) makes
            # the step's gradient that of the mean over the global batch's supervised tokens once
            # Lightning divides by the accumulation and the strategy averages over the dp ranks.
            # (Integers in the batch: a true-precision plugin would round a float weight to bf16.)
            # Under context parallel each rank sums its slice's tokens and the average over the cp
            # ranks is undone (x cp): the slices' sums add up to the sequence's.
            loss = self._token_loss_sum(self._slice(batch))
            cp = 1 if self.context_parallel is None else self.context_parallel.size
            return self._with_auxiliary(loss * token_weight(batch, loss.dtype, slices=cp))
        return self._loss(batch)

    def _slice(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's slice of a labelled batch under context parallel; else the batch."""
        cp = self.context_parallel
        return batch if cp is None else cp.split_labelled(batch)

    def validation_step(self, batch: torch.Tensor | dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if isinstance(batch, dict):
            return self._add_val_tokens(batch)
        loss = self._loss(batch)
        self.log("val_loss", loss, sync_dist=True, prog_bar=True)
        return loss

    def _add_val_tokens(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Labelled validation: sums of token losses and of supervised labels, over the whole run
        (:meth:`on_validation_epoch_end` divides), so ``val_loss`` is the mean over its tokens,
        packed or not."""
        batch = self._slice(batch)  # (each rank counts its slice's labels: the sums are over all ranks)
        total = self._token_loss_sum(batch).detach().double()
        return self._add_val_sums(total, (batch["labels"] != -100).sum().double())

    def _add_val_sums(self, total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        sums = torch.stack((total, count))
        self._val_sums = sums if self._val_sums is None else self._val_sums + sums
        return total / count.clamp(min=1)

    def on_validation_epoch_start(self) -> None:
        self._val_sums = None

    def on_validation_epoch_end(self) -> None:
        sums = self._val_sums
        if sums is None:
            return
        total, count = self.trainer.strategy.reduce(sums, reduce_op="sum")
        # (Equal on every rank already: sync_dist only tells Lightning so.)
        self.log("val_loss", (total / count).float(), prog_bar=True, sync_dist=True)
        self._val_sums = None

    def configure_optimizers(self) -> Any:
        opt = self.optim
        # Only what trains: frozen parameters (a LoRA run's base) get no optimizer state.
        trainable = [p for p in self.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(
            trainable, lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps, weight_decay=opt.weight_decay
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=_schedule(opt, self._horizon))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _horizon(self) -> int:
        """The last step of training: ``max_steps``, or where ``trainer.max_epochs`` ends it first.
        Asked at the first decaying step, when Lightning knows the epoch length (asking it in
        ``configure_optimizers`` would build the DataLoader before a resumed step is restored)."""
        if self._trainer is None:
            return self.max_steps
        total = self._trainer.estimated_stepping_batches
        return int(total) if math.isfinite(total) and total > 0 else self.max_steps


def _schedule(opt: OptimizerArgs, horizon: Callable[[], int]) -> Callable[[int], float]:
    warmup, floor = opt.warmup_steps, opt.min_lr_ratio
    decay_steps: list[int] = []  # the horizon, once known

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if opt.scheduler is Scheduler.constant or step == warmup:
            return 1.0
        if not decay_steps:
            decay_steps.append(max(1, horizon() - warmup))
        progress = min(1.0, (step - warmup) / decay_steps[0])
        if opt.scheduler is Scheduler.cosine:
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
        if opt.scheduler is Scheduler.linear:
            return floor + (1 - floor) * (1 - progress)
        return 1.0

    return factor
