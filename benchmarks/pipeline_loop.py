"""A hand-written pipeline-parallel training loop: the baseline ``fsdp-train pp=...`` is measured
against (``compare_pipeline.py``), and the measured bubble beside the schedule's theoretical one.

Plain ``torch.distributed.pipelining`` (no Lightning): the built-in Llama cut into
``pp x stages_per_rank`` stages of consecutive blocks (``fsdp_cli.pipeline.cuts``, balanced; the
embedding on the first stage, the norm and head on the last), each stage ``fully_shard``-ed over
its data-parallel ranks (per block, then the stage), the mesh pp x dp with pp outermost, driven
by torch's schedule of that name over ``microbatches`` micro-batches; AdamW, gradient clipping at
1.0 by the global norm (over the data-parallel shards and the pipeline stages), the loss averaged
over the data-parallel ranks every ``log_every`` steps and read on the host.

The bubble: every wait of the schedule for its sends and receives (torch's ``_wait_batch_p2p``,
through which every schedule waits for its peers) is timed; a rank's idle fraction is that time
over the wall time of the measured steps. Started through torchrun::

    torchrun --standalone --nproc-per-node 4 benchmarks/pipeline_loop.py OUT.json pp=2 schedule=1F1B KEY=VALUE...
"""

from __future__ import annotations

import json
import math
import resource
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # fsdp_cli from a checkout

from fsdp_cli.data.sampler import StepBatchSampler
from fsdp_cli.data.synthetic import SyntheticTokens
from fsdp_cli.pipeline.cuts import stage_blocks
from fsdp_cli.pipeline.options import CutPolicy
from fsdp_cli.pipeline.schedules import ScheduleFacts, schedule_facts

VOCAB, SEED = 256, 1234


class Stage(nn.Module):
    """Blocks of the Llama, with the embedding on the first stage and the norm and head on the
    last; parameter names stay those of the whole model (``layers.3.attention.wq.weight``)."""

    def __init__(self, model: nn.Module, blocks: range, *, first: bool, last: bool) -> None:
        super().__init__()
        self.tok_embeddings = model.tok_embeddings if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in blocks})
        self.norm = model.norm if last else None
        self.output = model.output if last else None
        self.register_buffer("rope", model.rope, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for layer in self.layers.values():
            h = layer(h, self.rope)
        return self.output(self.norm(h)) if self.output is not None else h


def build_stages(opts: dict[str, str], facts: ScheduleFacts, pp_rank: int, pp: int, v: int) -> list[Stage]:
    """This pipeline rank's stages of the model, on the meta device."""
    from fsdp_cli.config.schema import LlamaConfig
    from fsdp_cli.models.llama import Llama

    dims = {k: int(opts[k]) for k in ("dim", "n_layers", "n_heads")}
    cfg = LlamaConfig(vocab_size=VOCAB, n_kv_heads=int(opts["n_kv_heads"]), max_seq_len=512, **dims)
    with torch.device("meta"):
        model = Llama(cfg, seed=SEED)
    cuts = stage_blocks(cfg.n_layers, pp * v, CutPolicy.balanced)
    indices = facts.rank_stages(pp, v, pp_rank)
    return [Stage(model, cuts[s], first=s == 0, last=s == pp * v - 1) for s in indices]


def shard_and_init(stage: Stage, mesh: Any, opts: dict[str, str], device: torch.device) -> None:
    """fully_shard each block, then the stage; materialise and initialise as the Llama does."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from fsdp_cli.models.init import seeded_normal_
    from fsdp_cli.models.llama import rope_table

    bf16 = opts.get("precision", "32-true") == "bf16-mixed"
    mp = (
        {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
        if bf16
        else {}
    )
    reshard = opts.get("reshard_after_forward", "true") == "true"
    for block in stage.layers.values():
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, **mp)
    fully_shard(stage, mesh=mesh, reshard_after_forward=reshard, **mp)
    stage.to_empty(device=device)
    dim, heads, layers = int(opts["dim"]), int(opts["n_heads"]), int(opts["n_layers"])
    with torch.no_grad():
        stage.rope = rope_table(dim // heads, 512, 10000.0, device=device)
        depth_std = 0.02 / math.sqrt(2 * layers)
        for name, param in stage.named_parameters():
            if param.dim() == 1:
                nn.init.ones_(param)
                continue
            std = depth_std if name.endswith(("wo.weight", "w2.weight")) else 0.02
            seeded_normal_(param, std=std, seed=SEED, name=name)


def timed_waits() -> Callable[[], float]:
    """Time every wait of the schedules for their peers; returns the reader of the total so far."""
    from torch.distributed.pipelining import schedules

    # A benchmark's probe of torch's private helper (not the library's: fsdp_cli/compat fences
    # those); checked here so a torch that renames it stops the benchmark with one line.
    if not hasattr(schedules, "_wait_batch_p2p"):
        raise SystemExit(
            f"torch {torch.__version__}: schedules._wait_batch_p2p is gone; update the bubble timer"
        )
    original, total = schedules._wait_batch_p2p, [0.0]  # noqa: SLF001

    def wait(work: Any) -> Any:
        started = time.perf_counter()
        try:
            return original(work)
        finally:
            total[0] += time.perf_counter() - started

    schedules._wait_batch_p2p = wait  # noqa: SLF001
    return lambda: total[0]


def clip(stages: list[Stage], pp_group: Any) -> None:
    """Clip by the norm over every stage's gradients (their data-parallel shards included)."""
    grads = [p.grad for s in stages for p in s.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, foreach=True)
    squared = (norm.full_tensor() if hasattr(norm, "full_tensor") else norm) ** 2
    dist.all_reduce(squared, group=pp_group)
    params = [p for s in stages for p in s.parameters() if p.grad is not None]
    torch.nn.utils.clip_grads_with_norm_(params, 1.0, squared.sqrt(), foreach=True)


@dataclass
class Pipeline:
    """One rank's part of the pipeline, ready to train."""

    facts: ScheduleFacts
    mesh: Any
    stages: list[Stage]
    indices: list[int]
    schedule: Any
    stages_per_rank: int
    microbatches: int

    @property
    def pp(self) -> int:
        return self.mesh.size(0)

    @property
    def first(self) -> bool:
        return 0 in self.indices

    @property
    def last(self) -> bool:
        return self.pp * self.stages_per_rank - 1 in self.indices


def build(opts: dict[str, str]) -> Pipeline:
    """The mesh (pp x dp, pp outermost), this rank's sharded stages and torch's schedule over them."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    pp, facts = int(opts["pp"]), schedule_facts(opts["schedule"])
    assert facts is not None, f"no such schedule: {opts['schedule']}"
    v = int(opts.get("stages_per_rank") or facts.default_stages_per_rank())
    microbatches = int(opts.get("microbatches") or pp * v)
    mesh = init_device_mesh("cpu", (pp, dist.get_world_size() // pp), mesh_dim_names=("pp", "dp"))
    pp_rank = mesh.get_local_rank("pp")
    stages = build_stages(opts, facts, pp_rank, pp, v)
    for stage in stages:
        shard_and_init(stage, mesh["dp"], opts, torch.device("cpu"))
    indices = facts.rank_stages(pp, v, pp_rank)
    pipeline = [
        PipelineStage(stage, index, pp * v, torch.device("cpu"), group=mesh.get_group("pp"))
        for stage, index in zip(stages, indices, strict=True)
    ]

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().flatten(0, 1), target.flatten())

    cls = get_schedule_class(facts.name)
    single = issubclass(cls, PipelineScheduleSingle)
    schedule = cls(pipeline[0] if single else pipeline, n_microbatches=microbatches, loss_fn=loss_fn)
    return Pipeline(facts, mesh, stages, indices, schedule, v, microbatches)


def train(run: Pipeline, opts: dict[str, str]) -> tuple[list[float], float]:
    """The measured steps' times (per step, between host reads of the loss) and this rank's idle
    fraction (time in the schedule's waits for its peers over the measured steps' time)."""
    steps, warmup, log_every = int(opts["steps"]), int(opts["warmup"]), int(opts["log_every"])
    batch, dp = int(opts["global_batch_size"]), run.mesh.size(1)
    params = [p for s in run.stages for p in s.parameters()]
    optimizer = torch.optim.AdamW(params, lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    data = SyntheticTokens(vocab_size=VOCAB, seq_len=int(opts["seq_len"]), seed=SEED)
    dp_rank = run.mesh.get_local_rank("dp")
    sampler = iter(
        StepBatchSampler(global_batch_size=batch, micro_batch_size=batch // dp, dp_rank=dp_rank, dp_size=dp)
    )
    waited, times, t_last = timed_waits(), [], None
    t_measured, waited_measured = 0.0, 0.0
    for step in range(1, steps + 1):
        tokens = torch.stack([data[i] for i in next(sampler)])
        losses: list[torch.Tensor] = []
        wait_before, started = waited(), time.perf_counter()
        run.schedule.step(
            *((tokens[:, :-1],) if run.first else ()),
            target=tokens[:, 1:] if run.last else None,
            losses=losses if run.last else None,
        )
        clip(run.stages, run.mesh.get_group("pp"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step > warmup:
            t_measured += time.perf_counter() - started
            waited_measured += waited() - wait_before
        if step % log_every == 0:
            value = torch.stack(losses).mean() if run.last else torch.zeros(())
            dist.all_reduce(value, group=run.mesh.get_group("dp"))
            (value / dp).item()
            now = time.perf_counter()
            if t_last is not None and step > warmup:  # warmup is a multiple of log_every
                times.append((now - t_last) / log_every)
            t_last = now
    return times, waited_measured / t_measured if t_measured else float("nan")


def report(out: str, run: Pipeline, times: list[float], idle: float) -> None:
    """Rank 0 writes the step time and each pipeline rank's idle fraction (mean over its dp ranks)."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (run.mesh.get_local_rank("pp"), idle))
    if dist.get_rank() != 0:
        return
    pp, v, m = run.pp, run.stages_per_rank, run.microbatches
    by_stage = {r: statistics.mean(i for p, i in gathered if p == r) for r in range(pp)}
    result = {
        "schedule": run.facts.name,
        "pp": pp,
        "dp": run.mesh.size(1),
        "stages_per_rank": v,
        "microbatches": m,
        "step_time_s": statistics.median(times),
        "samples": times,
        "idle_fraction_by_pp_rank": by_stage,
        "theoretical_bubble": run.facts.bubble_fraction(pp, m, v),
        "peak_memory_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    Path(out).write_text(json.dumps(result))


def main(out: str, opts: dict[str, str]) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(SEED)
    run = build(opts)
    times, idle = train(run, opts)
    report(out, run, times, idle)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], dict(arg.split("=", 1) for arg in sys.argv[2:]))
