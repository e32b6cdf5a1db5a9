"""Test driver (run under torchrun by tests/test_pipeline.py): every schedule torch ships, on one
process group, against one process.

Each rank builds the model kinds' pipelined stages with the library's code
(:mod:`fsdp_cli.pipeline.driver`) and trains them for a few steps with every schedule; rank 0
also trains the whole model in one process on the whole batch. Prints one JSON line per
(model, schedule): the per-step losses of both and the largest relative difference.

    torchrun --nproc-per-node 4 tests/pipeline_sweep.py --pp 2 --dp 2 --tp 1 --models llama,hf,module
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fsdp_cli.models.args import LlamaArgs
from fsdp_cli.parallel.dims import ParallelDims
from fsdp_cli.parallel.grad_norm import clip_grad_norm
from fsdp_cli.parallel.parallelize import ParallelizeOptions
from fsdp_cli.pipeline.cut_check import check_sequential_cut
from fsdp_cli.pipeline.driver import PipelineDriver, layout_of, parallelize_stages
from fsdp_cli.pipeline.options import PipelineOptions
from fsdp_cli.pipeline.schedules import SCHEDULES
from fsdp_cli.pipeline.stages import block_count, split_of

VOCAB, SEQ, BATCH = 64, 8, 8


class Block(nn.Module):
    """A plain residual MLP block (the plain ``nn.Module`` kind)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class PlainModel(nn.Module):
    """Embedding, a ModuleList of blocks, a head, and learned positions added to the embedding in
    forward (nanoGPT's shape): cut by torch's tracer at its block list."""

    def __init__(self, dim: int = 16, n_blocks: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.pos = nn.Embedding(SEQ, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(n_blocks))
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def tp_plan(self, *, sequence_parallel: bool) -> dict[str, object]:
        """Each block's layer split by columns and gathered again (its output whole on every rank)."""
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel

        return {
            f"blocks.{i}.fc": ColwiseParallel(output_layouts=Replicate()) for i in range(len(self.blocks))
        }

    def init_weights(self, buffer_device: object = None) -> None:
        from fsdp_cli.models.init import seeded_normal_

        for name, param in self.named_parameters():
            seeded_normal_(param, std=0.2, seed=0, name=name)


def llama() -> nn.Module:
    from fsdp_cli.models.llama import Llama

    args = LlamaArgs(dim=16, n_layers=8, n_heads=2, vocab_size=VOCAB, max_seq_len=SEQ, tie_embeddings=False)
    return Llama(args, seed=0)


def moe() -> nn.Module:
    """The built-in Llama with 4 routed experts, top-2, no balance loss: at pp x dp its experts
    split over the data-parallel ranks (ep = dp), tokens exchanged all-to-all inside the stages."""
    from fsdp_cli.models.llama import Llama

    args = LlamaArgs(dim=16, n_layers=4, n_heads=2, vocab_size=VOCAB, max_seq_len=SEQ, tie_embeddings=False)
    args = dataclasses.replace(args, n_experts=4, experts_per_token=2, moe_hidden_dim=16, aux_loss_coef=0.0)
    return Llama(args, seed=0)


def hf(folder: str) -> nn.Module:
    from fsdp_cli.models.args import HFModelArgs
    from fsdp_cli.models.hf import build_hf_model

    return build_hf_model(HFModelArgs(path=folder, pretrained=False), seed=0)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def batches(steps: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen) for _ in range(steps)]


def packed_positions(steps: int) -> list[torch.Tensor]:
    """Per step, each row's positions restarting at 0 where a packed document starts (two or three
    documents a row, boundaries drawn per row)."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        rows = []
        for _ in range(BATCH):
            starts = sorted({0, *torch.randint(1, SEQ, (2,), generator=gen).tolist()})
            bounds = [*starts, SEQ]
            rows.append(torch.cat([torch.arange(b - a) for a, b in zip(bounds, bounds[1:])]))
        out.append(torch.stack(rows))
    return out


def step_kwargs(packed: bool, steps: int) -> list[dict[str, torch.Tensor]]:
    """The keyword tensors of each step: packed documents' ``position_ids`` (or none)."""
    return [{"position_ids": p} for p in packed_positions(steps)] if packed else [{}] * steps


def one_process(
    factory: Callable[[], nn.Module], steps: int, packed: bool = False
) -> tuple[list[float], list[float]]:
    """Per step the loss; the first step's gradient norm."""
    with torch.device("meta"):
        model = factory()
    model.to_empty(device="cpu")
    model.init_weights(buffer_device=torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out, norms = [], []
    for batch, kwargs in zip(batches(steps), step_kwargs(packed, steps), strict=True):
        loss = loss_fn(model(batch[:, :-1], **kwargs), batch[:, 1:])
        loss.backward()
        if not norms:  # (the first step's: the same weights on every layout)
            norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])))
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out, norms


def pipelined(
    factory: Callable[[], nn.Module], dims: ParallelDims, schedule: str, steps: int, packed: bool = False
) -> tuple[list[float], list[float]]:
    with torch.device("meta"):
        model = factory()
    split = check_sequential_cut(split_of(model), torch.zeros(1, SEQ, dtype=torch.long, device="meta"))
    pp_rank = dims.pp_mesh.get_local_rank()
    layout = layout_of(PipelineOptions(schedule=schedule), dims, pp_rank, block_count(split))
    stages = parallelize_stages(split, layout, dims, ParallelizeOptions())
    model.to_empty(device="cpu")
    model.init_weights(buffer_device=torch.device("cpu"))
    driver = PipelineDriver(stages, layout, dims, torch.device("cpu"), loss_fn)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dp_rank, dp = dims.data_parallel_mesh.get_local_rank(), dims.dp
    out, norms = [], []
    for batch, kwargs in zip(batches(steps), step_kwargs(packed, steps), strict=True):
        mine = batch.chunk(dp)[dp_rank]
        given = {k: v.chunk(dp)[dp_rank] for k, v in kwargs.items()}
        loss = driver.step(mine[:, :-1], mine[:, 1:], train=True, kwargs=given)
        if not norms:
            pp_group = dims.pp_mesh.get_group()
            norms.append(float(clip_grad_norm(None, model.parameters(), math.inf, across=pp_group)))
        opt.step()
        opt.zero_grad()
        dist.all_reduce(loss, group=dims.data_parallel_mesh.get_group())
        out.append(loss.item() / dp)
    return out, norms


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--models", default="llama")
    parser.add_argument("--schedules", default=",".join(f.name for f in SCHEDULES.values()))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--hf-folder", default=None)
    parser.add_argument(
        "--moe-schedules", default=None, help="the schedules the MoE runs (default: all given)"
    )
    args = parser.parse_args()
    dist.init_process_group("gloo")
    factories = {"llama": llama, "moe": moe, "module": PlainModel, "hf": lambda: hf(args.hf_folder)}
    for name in args.models.split(","):
        # "llama+packed": packed documents, their position_ids given to every stage by keyword.
        kind, packed = name.removesuffix("+packed"), name.endswith("+packed")
        reference, ref_norms = (
            one_process(factories[kind], args.steps, packed) if dist.get_rank() == 0 else ([], [])
        )
        schedules = args.schedules.split(",")
        if kind == "moe" and args.moe_schedules:
            schedules = [s for s in schedules if s in args.moe_schedules.split(",")]
        for schedule in schedules:
            # The MoE's experts split over the data-parallel ranks (ep = dp).
            ep = args.dp if kind == "moe" else 1
            dims = ParallelDims(dp_replicate=1, dp_shard=args.dp, tp=args.tp, pp=args.pp, ep=ep)
            dims.build_mesh("cpu")
            losses, norms = pipelined(factories[kind], dims, schedule, args.steps, packed)
            if dist.get_rank() == 0:
                worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=True))
                row = {
                    "model": name,
                    "schedule": schedule,
                    "losses": losses,
                    "reference": reference,
                    "rel": worst,
                    # The first step's gradient norm (the same weights on both): a gradient
                    # scaled wrong, which AdamW's losses hide, shows here.
                    "norm_rel": abs(norms[0] - ref_norms[0]) / ref_norms[0],
                }
                print(json.dumps(row), flush=True)
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
