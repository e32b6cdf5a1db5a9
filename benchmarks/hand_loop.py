"""A hand-written FSDP2 training loop: the baseline fsdp-train is measured against.

Same model (the built-in Llama), same parallelization (fully_shard per block, then the root, with
the same mixed-precision policy), same data and sampler, same AdamW and gradient clipping as
``fsdp-train strategy=fsdp2``; no Lightning. Started by ``compare_loop.py`` through torchrun.

    torchrun --standalone --nproc-per-node N benchmarks/hand_loop.py OUT.json KEY=VALUE...
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from fsdp_cli.config.schema import LlamaConfig
from fsdp_cli.data.sampler import StepBatchSampler
from fsdp_cli.data.synthetic import SyntheticTokens
from fsdp_cli.models.llama import Llama


def main(out: str, opts: dict[str, str]) -> None:
    steps, warmup = int(opts["steps"]), int(opts["warmup"])
    batch, seq = int(opts["global_batch_size"]), int(opts["seq_len"])
    bf16 = opts.get("precision", "32-true") == "bf16-mixed"
    gpu = torch.cuda.is_available()
    dist.init_process_group("nccl" if gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    torch.manual_seed(1234)
    cfg = _model(opts["model"])
    with torch.device("meta"):
        model = Llama(cfg, seed=1234)
    mesh = init_device_mesh(device.type, (world,))
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if bf16
        else MixedPrecisionPolicy()
    )
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=i < len(blocks) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    model.to_empty(device=device)
    model.init_weights(buffer_device=device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)

    data = SyntheticTokens(vocab_size=cfg.vocab_size, seq_len=seq, seed=1234)
    sampler = iter(
        StepBatchSampler(
            global_batch_size=batch, micro_batch_size=batch // world, dp_rank=rank, dp_size=world
        )
    )
    times, log_every, t_last = [], 10, None
    for step in range(1, steps + 1):
        tokens = torch.stack([data[i] for i in next(sampler)]).to(device, non_blocking=True)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()], foreach=True)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        torch.nn.utils.clip_grads_with_norm_(list(model.parameters()), 1.0, norm, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % log_every == 0 or step == warmup:
            value = loss.detach().clone()
            dist.all_reduce(value)  # the same per-log-step sync fsdp-train does
            value.item()
            now = time.perf_counter()
            if t_last is not None and step > warmup:
                times.append((now - t_last) / log_every)
            t_last = now
    # The same measure fsdp-train reports: CUDA allocator peak on GPU, max RSS on CPU.
    peak = (
        torch.cuda.max_memory_allocated()
        if gpu
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )
    if rank == 0:
        step_time = statistics.median(times)
        json.dump(
            {"step_time_s": step_time, "tokens_per_s": batch * seq / step_time, "peak_memory_bytes": peak},
            open(out, "w"),
        )
    dist.destroy_process_group()


def _model(name: str) -> LlamaConfig:
    """The same model config file fsdp-train's ``model=NAME`` composes."""
    from importlib.resources import files

    import yaml

    fields = yaml.safe_load(files("fsdp_cli.configs").joinpath("model", f"{name}.yaml").read_text())
    fields.pop("defaults", None)
    return LlamaConfig(**fields)


if __name__ == "__main__":
    main(sys.argv[1], dict(arg.split("=", 1) for arg in sys.argv[2:]))
