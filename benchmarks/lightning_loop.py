"""The same training as ``hand_loop.py``, written the way a Lightning user writes it: a
LightningModule and ``L.Trainer``, no fsdp_cli in the loop. It separates what Lightning's own
loop costs per step (hooks, closures, progress tracking) from what fsdp-train adds on top.

* ``strategy=fsdp2``: Lightning's ``ModelParallelStrategy``, ``fully_shard`` per block then the root
  in ``configure_model`` (the last block keeps its parameters after forward, as the other sides);
* ``strategy=fsdp``: Lightning's ``FSDPStrategy`` with the block class as its wrap policy
  (FULL_SHARD, use_orig_params, BACKWARD_PRE prefetch, limit_all_gathers);
* ``strategy=ddp``: Lightning's ``DDPStrategy`` (25 MB buckets, gradients as bucket views).

Same model, data, sampler, AdamW and clipping at 1.0 (by the global norm, in
``configure_gradient_clipping``); every ``log_every`` steps the loss is averaged over the ranks
and read on the host, timed between those points as the hand loop is. Started by
``compare_loop.py --lightning`` through torchrun, like the hand loop::

    torchrun --standalone --nproc-per-node N benchmarks/lightning_loop.py OUT.json KEY=VALUE...
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `benchmarks.*` from a checkout

from benchmarks.cpu_clock import CpuWindow
from benchmarks.hand_loop import build_model, clip, materialize
from benchmarks.step_parts import Phases, write_report
from fsdp_cli.data.sampler import StepBatchSampler
from fsdp_cli.data.synthetic import SyntheticTokens


class Module(L.LightningModule):
    def __init__(self, opts: dict[str, str]) -> None:
        super().__init__()
        self.opts = opts
        self.model, self.block_cls, self.vocab = build_model(opts)
        if opts["strategy"] != "fsdp2":  # FSDP1 and DDP take a real model
            materialize(self.model, torch.device("cpu"))

    def configure_model(self) -> None:
        if self.opts["strategy"] != "fsdp2" or getattr(self, "_sharded", False):
            return
        from torch.distributed.fsdp import fully_shard

        blocks = [m for m in self.model.modules() if isinstance(m, self.block_cls)]
        for i, block in enumerate(blocks):
            fully_shard(block, reshard_after_forward=i < len(blocks) - 1)
        fully_shard(self.model)
        materialize(self.model, self.device)
        self._sharded = True

    def training_step(self, tokens: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self.model(tokens[:, :-1])
        return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())

    def configure_gradient_clipping(self, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        # By the global norm, as the hand loop does (ModelParallelStrategy has no clipping of its own).
        clip(
            self.trainer.strategy.model if self.opts["strategy"] == "fsdp" else self.model,
            self.opts["strategy"],
        )

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)


class StepTimer(L.Callback):
    """Every ``log_every`` steps: the loss averaged over the ranks, read on the host, and the time."""

    def __init__(self, log_every: int, warmup: int, phases: Phases | None = None) -> None:
        self.log_every, self.warmup, self.phases = log_every, warmup, phases
        self.times: list[float] = []
        self.t_last: float | None = None
        self.cpu = CpuWindow(warmup)
        self.measured: dict[str, Any] = {}

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, outputs: Any, batch: Any, idx: int) -> None:
        step = trainer.global_step
        if step % self.log_every == 0:
            began = time.perf_counter_ns()
            value = outputs["loss"].detach().clone()
            dist.all_reduce(value)
            (value / dist.get_world_size()).item()
            if self.phases is not None:
                self.phases.add("loss_reduction", time.perf_counter_ns() - began)
            now = time.perf_counter()
            if self.t_last is not None and step > self.warmup:
                self.times.append((now - self.t_last) / self.log_every)
            self.t_last = now
        self.cpu.step_done(step)  # after the step's loss is read, as on the other sides

    def on_train_end(self, trainer: L.Trainer, module: Any) -> None:
        self.measured = self.cpu.over_ranks()


class CpuClock(L.Callback):
    """fsdp-train's side of the CPU measure (``compare_loop.py`` adds it through the ``callbacks``
    config group): :class:`~benchmarks.cpu_clock.CpuWindow` over optimizer steps; rank 0 writes
    ``out`` (JSON)."""

    def __init__(self, warmup: int, out: str) -> None:
        self.window = CpuWindow(warmup)
        self.out = Path(out)
        self._seen = -1

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step != self._seen:  # once per optimizer step, not per micro-batch
            self._seen = trainer.global_step
            self.window.step_done(trainer.global_step)

    def on_train_end(self, trainer: L.Trainer, module: Any) -> None:
        measured = self.window.over_ranks()
        if trainer.is_global_zero:
            self.out.write_text(json.dumps(measured))


class StepParts(L.Callback):
    """A Lightning side's :class:`~benchmarks.step_parts.Phases` (rank 0 writes ``out``): the
    strategy's ``training_step`` (the wrapped model's forward and the loss), the module's
    ``backward`` and ``optimizer_zero_grad``, clipping (fsdp-train's clipping callback, or the
    module's ``configure_gradient_clipping``), fsdp-train's loss reduction, and the optimizer's
    ``step`` less the closure Lightning hands it."""

    def __init__(self, start: int, stop: int, out: str) -> None:
        self.phases = Phases(start, stop)
        self.out = Path(out)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        timed = self.phases.timed
        # DDP's and FSDP's own work around the forward comes with it, as in the hand loop's
        # ``model(tokens)``; so does Lightning's redirection through the wrapper (microseconds).
        trainer.strategy.training_step = timed("forward_loss", trainer.strategy.training_step)
        pl_module.backward = timed("backward", pl_module.backward)
        pl_module.optimizer_zero_grad = timed("zero_grad", pl_module.optimizer_zero_grad)
        if type(pl_module).configure_gradient_clipping is not L.LightningModule.configure_gradient_clipping:
            pl_module.configure_gradient_clipping = timed("clip", pl_module.configure_gradient_clipping)
        for callback in trainer.callbacks:
            if type(callback).__name__ == "GradientClipping":  # fsdp-train's
                callback.on_before_optimizer_step = timed("clip", callback.on_before_optimizer_step)
        import fsdp_cli.callbacks.nonfinite as nonfinite

        # fsdp-train's loss reduction on a logged step: the sum over the ranks, and the gather that
        # follows only when a value is not finite (private names, wrapped for this measurement).
        nonfinite._sum_over_ranks = timed("loss_reduction", nonfinite._sum_over_ranks)  # noqa: SLF001
        nonfinite._gather_rows = timed("loss_reduction", nonfinite._gather_rows)  # noqa: SLF001

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for optimizer in trainer.optimizers:  # the torch optimizers Lightning's plugins step
            optimizer.step = self.phases.timed("optimizer_with_closure", self._closure_timed(optimizer.step))
        # The data: Lightning's fetcher (its ``__next__`` takes the DataLoader's next batch; a
        # private attribute and a class-level wrap, for this measurement's process only) and the
        # move to the device. Framework time, reported apart (``data``) as the hand loop's is.
        fetcher = type(trainer.fit_loop._data_fetcher)  # noqa: SLF001
        fetcher.__next__ = self.phases.timed("data", fetcher.__next__)
        trainer.strategy.batch_to_device = self.phases.timed("data", trainer.strategy.batch_to_device)

    def _closure_timed(self, step: Any) -> Any:
        def with_timed_closure(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("closure") is not None:
                kwargs["closure"] = self.phases.timed("closure", kwargs["closure"])
            return step(*args, **kwargs)

        return with_timed_closure

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.phases.step_begins(trainer.global_step)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero:
            write_report(self.phases, self.out)


def main(out: str, opts: dict[str, str]) -> None:
    steps, strategy = int(opts["steps"]), opts["strategy"]
    torch.manual_seed(1234)
    module = Module(opts)
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    batch, seq = int(opts["global_batch_size"]), int(opts["seq_len"])
    sampler = StepBatchSampler(
        global_batch_size=batch, micro_batch_size=batch // world, dp_rank=rank, dp_size=world
    )
    data = DataLoader(SyntheticTokens(vocab_size=module.vocab, seq_len=seq, seed=1234), batch_sampler=sampler)
    parts = StepParts(int(opts["warmup"]), steps - 1, opts["parts"]) if "parts" in opts else None
    timer = StepTimer(int(opts["log_every"]), int(opts["warmup"]), parts.phases if parts else None)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=lightning_strategy(strategy, module.block_cls, world),
        max_steps=steps,
        gradient_clip_val=1.0,
        callbacks=[timer] if parts is None else [timer, parts],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,  # the step sampler already splits by rank
    )
    trainer.fit(module, data)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if trainer.global_rank == 0:
        Path(out).write_text(
            json.dumps(
                {
                    "step_time_s": statistics.median(timer.times),
                    "samples": timer.times,
                    "peak_memory_bytes": peak,
                    **timer.measured,
                }
            )
        )


def lightning_strategy(name: str, block_cls: type, world: int) -> Any:
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy

    if name == "fsdp2":
        return ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    if name == "ddp":
        from fsdp_cli.compat.torch_internals import ddp_buffer_sync
        from fsdp_cli.models.llama import TransformerBlock

        # As the hand loop: no buffer broadcast per forward for the built-in model (RoPE tables).
        return DDPStrategy(gradient_as_bucket_view=True, **ddp_buffer_sync(block_cls is not TransformerBlock))
    from torch.distributed.fsdp import BackwardPrefetch

    return FSDPStrategy(
        auto_wrap_policy={block_cls},
        sharding_strategy="FULL_SHARD",
        use_orig_params=True,
        limit_all_gathers=True,
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
    )


if __name__ == "__main__":
    main(sys.argv[1], dict(arg.split("=", 1) for arg in sys.argv[2:]))
