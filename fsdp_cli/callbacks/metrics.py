"""The Lightning callback behind ``metrics.jsonl`` (the console shows its rows through the progress display).

On a logging step it averages the step's loss over all ranks (one collective, no barrier: the
non-finite guard's all_gather, which also checks every value since the last log, see
:mod:`fsdp_cli.callbacks.nonfinite`; tensor-parallel ranks hold equal copies, so this is the mean
over data-parallel ranks) and times the steps since the previous log. Between logging steps it
does nothing that synchronises: each step's loss stays a device scalar. The console line is the
progress display's (:mod:`fsdp_cli.callbacks.progress`); throughput fields come from
:mod:`fsdp_cli.callbacks.throughput`.

Throughput is ``tokens_per_s`` for token batches of a known size; for a LightningModule's own
DataLoaders it is ``samples_per_s`` (this rank's samples times the data-parallel ranks). After
each validation a row ``{"step", "val_loss", ...}`` holds the validation metrics the module logged.

Each row's numbers also go where Lightning callbacks look for metrics, ``trainer.callback_metrics``
(logged from this callback's hook, as any callback may), so ``EarlyStopping(monitor="loss")`` or
``ModelCheckpoint(monitor="loss")`` from the config's ``callbacks`` see exactly metrics.jsonl's
values; ``val_loss`` is there because the module logs it.
"""

from __future__ import annotations

import json
import math
import resource
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities.data import extract_batch_size

from fsdp_cli.compat.lightning_internals import share_callback_metrics
from fsdp_cli.rundir.files import METRICS_FILE, write_atomically
from fsdp_cli.rundir.summary import dumps_strict


class MetricsCallback(L.Callback):
    def __init__(
        self,
        run_dir: Path,
        *,
        log_every_n_steps: int,
        tokens_per_step: int | None,
        max_steps: int,
        clipping: Any | None = None,
        throughput: Any | None = None,
        nonfinite: Any | None = None,
    ) -> None:
        self.path = Path(run_dir) / METRICS_FILE
        self.log_every = log_every_n_steps
        self.tokens_per_step = tokens_per_step
        self.max_steps = max_steps
        self.rows: list[dict[str, Any]] = []
        self.val_rows: list[dict[str, Any]] = []
        self.peak_memory_bytes: list[int] = []
        self._samples = 0  # this rank's samples since the last logged step (module loaders only)
        self._seen_step = 0
        self._t_last = 0.0
        self._step_last = 0
        self._file: Any | None = None
        self.clipping = clipping  # GradientClipping, whose norm is logged
        self.throughput = throughput  # Throughput: tflops_per_s and mfu from tokens/s
        self.nonfinite = nonfinite  # NonFiniteGuard: its check is the logging step's loss reduction
        # The micro-batch losses of the current step, summed on the device (no sync).
        self._loss_sum: torch.Tensor | None = None
        self._loss_count = 0
        self._supervised: torch.Tensor | None = None  # data=chat: supervised labels of the last step
        self._shared: set[str] = set()  # the row names this callback put in callback_metrics

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.max_steps = planned_steps(trainer) or self.max_steps  # max_epochs may end the run first
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        self._seen_step = self._step_last = trainer.global_step
        self._t_last = time.perf_counter()
        if trainer.is_global_zero:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._keep_rows_up_to(trainer.global_step)
            self._file = open(self.path, "a")

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.tokens_per_step is None:
            self._samples += extract_batch_size(batch)
        if isinstance(batch, dict) and "step_supervised" in batch:  # data=chat: the step's counted tokens
            self._supervised = batch["step_supervised"][0]
        step = trainer.global_step
        logged = self._logs(step + 1 if step == self._seen_step else step)
        if logged or self.nonfinite is not None:  # the guard checks every step's loss
            self._add_loss(outputs, trainer.accumulate_grad_batches)
        if step == self._seen_step:  # still accumulating gradients
            return
        self._seen_step = step
        mean_loss = self._step_loss(trainer, step, logged)
        if mean_loss is not None:
            row = self._row(trainer, step, mean_loss)
            extra = getattr(pl_module, "step_metrics", None)
            if callable(extra):
                row.update(extra())
            self._write(trainer, row)
            self._share(trainer, row)

    def _step_loss(self, trainer: L.Trainer, step: int, logged: bool) -> float | None:
        """The step's loss averaged over the ranks, on a logged step (None on the others)."""
        loss = self._take_loss()
        if self.nonfinite is not None:
            self.nonfinite.record_loss(step, loss)
        if not logged:
            return None
        if self.nonfinite is not None:
            return self.nonfinite.check(step)  # the same single collective, plus the check
        if loss is None:
            loss = torch.tensor(float("nan"), device=trainer.strategy.root_device)
        return _mean_over_ranks(loss.double()).item()

    def _row(self, trainer: L.Trainer, step: int, mean_loss: float) -> dict[str, Any]:
        now = time.perf_counter()
        steps = step - self._step_last
        step_time = (now - self._t_last) / steps
        self._t_last, self._step_last = now, step
        row = {
            "step": step,
            "loss": mean_loss,
            "lr": trainer.optimizers[0].param_groups[0]["lr"] if trainer.optimizers else None,
            "step_time_s": step_time,
            **self._throughput(trainer, step_time, steps),
        }
        if self.throughput is not None and "tokens_per_s" in row:
            row.update(self.throughput.fields(row["tokens_per_s"]))
        if self._supervised is not None:
            # tokens_per_s and MFU count every processed token (padding included); this the loss's.
            row["supervised_tokens"] = int(self._supervised)
        grad_norm = self.clipping.grad_norm if self.clipping is not None else None
        if grad_norm is not None:
            row["grad_norm"] = float(grad_norm)
        return row

    def _write(self, trainer: L.Trainer, row: dict[str, Any]) -> None:
        self.rows.append(row)
        if self._file is not None:
            self._file.write(dumps_strict(row) + "\n")
            self._file.flush()
        if trainer.logger is not None:
            # Loggers take numbers only; a field this run cannot measure (e.g. MFU without a
            # known peak) is null in metrics.jsonl and left out here.
            numbers = {k: v for k, v in row.items() if k != "step" and v is not None}
            trainer.logger.log_metrics(numbers, step=row["step"])

    def _share(self, trainer: L.Trainer, row: dict[str, Any]) -> None:
        """The row's numbers into ``trainer.callback_metrics`` for callbacks that monitor them (not
        to the loggers again: :meth:`_write` sent them). A name the module logs itself is its own."""
        present = trainer.callback_metrics
        keys = [
            key
            for key, value in row.items()
            if key != "step" and value is not None and (key not in present or key in self._shared)
        ]
        if not keys:
            return
        self._shared.update(keys)
        # float64, as in metrics.jsonl: a monitored value (and a file name that shows it) is
        # exactly the row's; a plain float would become float32. One tensor, one scalar view per
        # key: two aten ops on every logged step instead of one per key.
        values = torch.tensor([float(row[key]) for key in keys], dtype=torch.float64).unbind()
        share_callback_metrics(trainer, dict(zip(keys, values)))

    def _throughput(self, trainer: L.Trainer, step_time: float, steps: int) -> dict[str, float]:
        if self.tokens_per_step is not None:
            return {"tokens_per_s": self.tokens_per_step / step_time}
        # Every data-parallel rank gets batches of the same size from its DistributedSampler.
        kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
        samples, self._samples = self._samples * int(kwargs.get("num_replicas", 1)), 0
        return {"samples_per_s": samples / (step_time * steps)}

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """A row of the validation metrics the module logged (``val_loss``, ``val_*``, ``val/*``)."""
        if trainer.sanity_checking:
            return
        logged = {
            k: float(v)
            for k, v in trainer.callback_metrics.items()
            if k.startswith(("val_", "val/")) and v.numel() == 1
        }
        if not logged:
            return
        row = {"step": trainer.global_step, **logged}
        self.val_rows.append(row)
        if self._file is not None:
            self._file.write(dumps_strict(row) + "\n")
            self._file.flush()
            shown = "  ".join(f"{k} {v:.4f}" for k, v in logged.items())
            print(f"step {trainer.global_step:>6}  {shown}", flush=True)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.close()
        self.peak_memory_bytes = gather_peak_memory(trainer, cuda=trainer.strategy.root_device.type == "cuda")

    def _logs(self, step: int) -> bool:
        """Whether optimizer step ``step`` gets a row."""
        return step % self.log_every == 0 or step == self.max_steps

    def _add_loss(self, outputs: Any, accumulation: int) -> None:
        # Lightning hands on_train_batch_end the loss already divided by the accumulation factor.
        loss = _loss_of(outputs)
        if loss is not None:
            loss = loss * accumulation if accumulation != 1 else loss  # (no op on every step for nothing)
            self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
            self._loss_count += 1

    def _take_loss(self) -> torch.Tensor | None:
        if self._loss_sum is None:
            return None
        mean = self._loss_sum / self._loss_count if self._loss_count != 1 else self._loss_sum
        self._loss_sum, self._loss_count = None, 0
        return mean

    def _keep_rows_up_to(self, step: int) -> None:
        """On resume, drop rows of steps after the checkpoint: they are about to be trained again.
        The file is replaced atomically (a crash meanwhile leaves the old one whole), and a row
        that is not whole (a crash in the middle of writing it) is dropped with a note."""
        if not self.path.exists():
            return
        text = self.path.read_text(errors="replace")
        kept, notes = rows_up_to(text, step)
        for note in notes:
            print(f"note: {self.path}: {note}", file=sys.stderr, flush=True)
        new = "".join(line + "\n" for line in kept)
        if new != text:
            write_atomically(self.path, new)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def rows_up_to(text: str, step: int) -> tuple[list[str], list[str]]:
    """The rows of a ``metrics.jsonl`` text at or before ``step`` (validation rows too), and a
    note for each line dropped because it is not a whole row: the torn last line a crash leaves,
    or a damaged one. Such lines never stop a resume."""
    kept, notes = [], []
    lines = text.splitlines()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            row_step = row["step"]
            if not isinstance(row_step, int):
                raise TypeError(row_step)
        except (ValueError, TypeError, KeyError):
            torn = number == len(lines) and not text.endswith("\n")
            what = "a torn last row (the run stopped while writing it)" if torn else "not a metrics row"
            notes.append(f"line {number} is {what}; dropped: {line[:80]!r}")
            continue
        if row_step <= step:
            kept.append(line)
    return kept, notes


def planned_steps(trainer: L.Trainer) -> int | None:
    """The optimizer steps this fit takes at most (call from ``on_train_start`` on): ``max_steps``,
    or fewer when ``max_epochs`` of a sized loader ends it first (Lightning's own estimate); None
    when no limit is known (``max_steps=-1`` and a loader without a length)."""
    total = trainer.estimated_stepping_batches
    return int(total) if math.isfinite(total) and total > 0 else None


def peak_memory_bytes(cuda: bool) -> int:
    """This process's peak: CUDA allocator peak on GPU, max resident set size on CPU."""
    if cuda:
        return int(torch.cuda.max_memory_allocated())
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def gather_peak_memory(trainer: L.Trainer, cuda: bool) -> list[int]:
    mine = peak_memory_bytes(cuda)
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return [mine]
    everyone: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, mine)
    return [int(v) for v in everyone]


def _mean_over_ranks(value: torch.Tensor) -> torch.Tensor:
    """One all-reduce; Lightning's ``strategy.reduce`` would add a barrier before it."""
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    value = value.clone()
    dist.all_reduce(value)  # gloo has no AVG: sum, then divide
    return value / dist.get_world_size()


def _loss_of(outputs: Any) -> torch.Tensor | None:
    """The loss of what ``training_step`` returned, as Lightning reads it: a tensor, a dict's
    ``"loss"``, or None (a skipped step; under manual optimization, whatever it returned). A
    DTensor loss (computed under ``loss_parallel``) becomes the plain tensor it stands for, so
    that the collectives below see an ordinary tensor."""
    if isinstance(outputs, dict):
        outputs = outputs.get("loss")
    if not isinstance(outputs, torch.Tensor) or outputs.numel() != 1:
        return None  # (manual optimization may return anything; only a scalar is a loss)
    loss = outputs.detach()
    full_tensor = getattr(loss, "full_tensor", None)  # a DTensor: replicated (or reduced) over its mesh
    return full_tensor() if callable(full_tensor) else loss
