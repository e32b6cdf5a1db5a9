"""The run's console progress on rank 0: one live line on a terminal, plain lines otherwise.

On a terminal (``stdout.isatty()``) a rich progress line is redrawn at every logged step: step/max,
a bar, ETA, loss, tokens/s, memory (and MFU when known). Redirected to a file or a pipe (CI, a
scheduler's log), each logged step prints one plain line with the same figures, which greps and
tails well. The figures are the metrics callback's rows: nothing here synchronises.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import lightning as L

from fsdp_cli.callbacks.metrics import MetricsCallback, peak_memory_bytes, planned_steps


def format_eta(seconds: float | None) -> str:
    if seconds is None:
        return "-:--:--"
    seconds = int(max(0.0, seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _rate(row: dict[str, Any]) -> str:
    """tokens/s for token batches, samples/s for a LightningModule's own loaders."""
    if row.get("tokens_per_s") is not None:
        return f"{row['tokens_per_s']:>10,.0f} tok/s"
    return f"{row.get('samples_per_s') or 0:>10,.1f} samples/s"


def plain_line(row: dict[str, Any], max_steps: int, eta_s: float | None, memory_bytes: int) -> str:
    parts = [
        f"step {row['step']:>6}/{max_steps if max_steps > 0 else '?'}",
        f"loss {row['loss']:8.4f}",
        f"lr {row['lr']:.2e}" if row.get("lr") is not None else "",
        f"{row['step_time_s'] * 1e3:8.1f} ms/step",
        _rate(row),
        f"mfu {row['mfu']:.1%}" if row.get("mfu") is not None else "",
        f"peak mem {memory_bytes / 2**20:,.0f} MiB",
        f"eta {format_eta(eta_s)}",
    ]
    return "  ".join(p for p in parts if p)


class ProgressDisplay(L.Callback):
    """Shows each new metrics row (logged steps only) on rank 0."""

    def __init__(self, metrics: MetricsCallback, max_steps: int, interactive: bool | None = None) -> None:
        self.metrics = metrics
        self.max_steps = max_steps
        self.interactive = sys.stdout.isatty() if interactive is None else interactive
        self._shown = 0
        self._started = 0.0
        self._start_step = 0
        self._live: Any = None
        self._task: Any = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.max_steps = planned_steps(trainer) or self.max_steps  # max_epochs may end the run first
        self._shown = len(self.metrics.rows)
        self._started, self._start_step = time.perf_counter(), trainer.global_step
        if trainer.is_global_zero and self.interactive:
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self._live = Progress(
                TextColumn("step {task.completed:>.0f}/{task.total:.0f}"),
                BarColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[figures]}"),
                transient=False,
            )
            self._task = self._live.add_task(
                "train",
                total=self.max_steps if self.max_steps > 0 else None,
                completed=trainer.global_step,
                figures="",
            )
            self._live.start()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if len(self.metrics.rows) == self._shown or not trainer.is_global_zero:
            return
        self._shown = len(self.metrics.rows)
        row = self.metrics.rows[-1]
        memory = peak_memory_bytes(trainer.strategy.root_device.type == "cuda")
        if self._live is None:
            print(plain_line(row, self.max_steps, self._eta(row["step"]), memory), flush=True)
            return
        figures = f"loss {row['loss']:.4f}  {_rate(row).strip()}  peak mem {memory / 2**20:,.0f} MiB"
        if row.get("mfu") is not None:
            figures += f"  mfu {row['mfu']:.1%}"
        self._live.update(self._task, completed=row["step"], figures=figures)

    def _eta(self, step: int) -> float | None:
        done = step - self._start_step
        if done <= 0 or self.max_steps <= 0:
            return None
        return (time.perf_counter() - self._started) / done * (self.max_steps - step)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.close()

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        self.close()

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
