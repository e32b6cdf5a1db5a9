"""Hand-written training loops: the baselines fsdp-train is measured against.

The same model, parallelization, data and sampler, AdamW, clipping at 1.0 and loss logging as
``fsdp-train`` with the matching settings, in plain PyTorch (no Lightning):

* ``strategy=fsdp2``: ``fully_shard`` per block, then the root (the last block keeps its
  parameters after forward, as fsdp-train does), with the same mixed-precision policy;
* ``strategy=fsdp``: FSDP1 ``FullyShardedDataParallel`` with the block class as its wrap policy
  (FULL_SHARD, use_orig_params, BACKWARD_PRE prefetch, limit_all_gathers: fsdp-train's defaults);
* ``strategy=ddp``: ``DistributedDataParallel`` (25 MB buckets, gradients as bucket views).

Every ``log_every`` steps the loss is averaged over the ranks (one all-reduce) and read on the
host, as fsdp-train's metrics do. ``cp=N`` (``strategy=fsdp2``, N = the world size): context
parallel, every rank on the same batch, each on its slice of the sequence through the model's
own all-to-all attention (``compare_context_parallel.py``). Started by ``compare_loop.py``
through torchrun::

    torchrun --standalone --nproc-per-node N benchmarks/hand_loop.py OUT.json KEY=VALUE...
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `benchmarks.gpt` from a checkout

from benchmarks.cpu_clock import CpuWindow
from benchmarks.step_parts import Phases, write_report
from fsdp_cli.data.sampler import StepBatchSampler
from fsdp_cli.data.synthetic import SyntheticTokens


def build_model(opts: dict[str, str]) -> tuple[nn.Module, type[nn.Module], int]:
    """The model on the meta device, its block class and its vocabulary size."""
    dims = {k: int(opts[k]) for k in ("dim", "n_layers", "n_heads")}
    with torch.device("meta"):
        if opts["model"] == "gpt":
            from benchmarks.gpt import GPT, Block

            return GPT(vocab_size=256, max_seq_len=int(opts["seq_len"]), **dims), Block, 256
        from fsdp_cli.config.schema import LlamaConfig
        from fsdp_cli.models.llama import Llama, TransformerBlock

        seq = max(512, int(opts["seq_len"]))
        cfg = LlamaConfig(vocab_size=256, n_kv_heads=int(opts["n_kv_heads"]), max_seq_len=seq, **dims)
        return Llama(cfg, seed=1234), TransformerBlock, 256


def materialize(model: nn.Module, device: torch.device) -> None:
    model.to_empty(device=device)
    if hasattr(model, "init_weights"):
        model.init_weights(buffer_device=device)
        return
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()


def parallelize(model: nn.Module, block_cls: type, strategy: str, device: torch.device, bf16: bool) -> Any:
    from fsdp_cli.compat.torch_internals import ddp_buffer_sync
    from fsdp_cli.models.llama import Llama

    blocks = [m for m in model.modules() if isinstance(m, block_cls)]
    if strategy == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
        kwargs = {"mp_policy": mp} if mp else {}
        for i, block in enumerate(blocks):
            fully_shard(block, reshard_after_forward=i < len(blocks) - 1, **kwargs)
        fully_shard(model, **kwargs)
        materialize(model, device)
        return model
    materialize(model, device)
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        # fsdp-train's default: no buffer broadcast per forward for the built-in model (RoPE tables).
        return DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            gradient_as_bucket_view=True,
            **ddp_buffer_sync(not isinstance(model, Llama)),
        )
    from torch.distributed.fsdp import BackwardPrefetch, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return FSDP(
        model,
        auto_wrap_policy=ModuleWrapPolicy({block_cls}),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if bf16
        else None,
        device_id=device if device.type == "cpu" else device.index,
        use_orig_params=True,
        limit_all_gathers=True,
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
    )


def clip(model: Any, strategy: str) -> None:
    if strategy == "fsdp":
        model.clip_grad_norm_(1.0)
        return
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    torch.nn.utils.clip_grads_with_norm_(params, 1.0, norm, foreach=True)


def main(out: str, opts: dict[str, str]) -> None:
    steps, warmup, log_every = int(opts["steps"]), int(opts["warmup"]), int(opts["log_every"])
    batch, seq, strategy = int(opts["global_batch_size"]), int(opts["seq_len"]), opts["strategy"]
    bf16 = opts.get("precision", "32-true") == "bf16-mixed"
    gpu = torch.cuda.is_available()
    dist.init_process_group("nccl" if gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    torch.manual_seed(1234)
    model, block_cls, vocab = build_model(opts)
    model = parallelize(model, block_cls, strategy, device, bf16)
    context = None
    if int(opts.get("cp", 1)) > 1:  # cp = the world: one batch, split along the sequence
        from fsdp_cli.parallel.context_parallel import ContextParallel, install

        context = ContextParallel(group=dist.group.WORLD, size=world, rank=rank)
        install(model, context)
    dp_rank, dp_size = (0, 1) if context else (rank, world)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16 and strategy == "ddp")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    data = SyntheticTokens(vocab_size=vocab, seq_len=seq, seed=1234)
    sampler = iter(
        StepBatchSampler(
            global_batch_size=batch, micro_batch_size=batch // dp_size, dp_rank=dp_rank, dp_size=dp_size
        )
    )
    times: list[float] = []
    t_last: float | None = None
    cpu = CpuWindow(warmup)
    parts = Phases(warmup, steps - 1)  # step_parts.py: the same window as the Lightning sides'
    for step in range(1, steps + 1):
        parts.step_begins(step - 1)
        tokens = torch.stack([data[i] for i in next(sampler)]).to(device, non_blocking=True)
        parts.lap("data")
        inputs, targets = (
            (tokens[:, :-1], tokens[:, 1:]) if context is None else context.split_batch(tokens)[:2]
        )
        with autocast:
            logits = model(inputs)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        parts.lap("forward_loss")
        loss.backward()
        parts.lap("backward")
        clip(model, strategy)
        parts.lap("clip")
        optimizer.step()
        parts.lap("optimizer")
        optimizer.zero_grad(set_to_none=True)
        parts.lap("zero_grad")
        if step % log_every == 0:
            value = loss.detach().clone()
            dist.all_reduce(value)
            (value / world).item()
            parts.lap("loss_reduction")
            now = time.perf_counter()
            if t_last is not None and step > warmup:  # warmup is a multiple of log_every
                times.append((now - t_last) / log_every)
            t_last = now
        cpu.step_done(step)
    measured = cpu.over_ranks()
    # The same measure fsdp-train reports: CUDA allocator peak on GPU, max RSS on CPU.
    peak = (
        torch.cuda.max_memory_allocated()
        if gpu
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )
    if rank == 0 and "parts" in opts:
        write_report(parts, Path(opts["parts"]))
    if rank == 0:
        Path(out).write_text(
            json.dumps(
                {
                    "step_time_s": statistics.median(times),
                    "samples": times,
                    "peak_memory_bytes": peak,
                    **measured,
                }
            )
        )
    # Every rank done before any tears down: a gloo DDP rank leaving while its peer still
    # writes once aborted at exit ("terminate called without an active exception").
    dist.barrier()
    del model, optimizer
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], dict(arg.split("=", 1) for arg in sys.argv[2:]))
