"""Test driver (run under torchrun by tests/test_expert_parallel.py): expert parallel against one
process, per-step losses (the load-balancing loss included) and whole gradients, for tiny
transformers MoE models: Qwen3-MoE in float64 (the ``eager`` experts) read from a folder in the
hub's layout (one tensor per expert), with 4 experts and with 2 (FSDP2 then shards each expert's
rows), Mixtral and OLMoE in float32 (transformers' default experts kernel) from a fresh init.

Every rank trains the model in one process on the whole batch (the reference), then the same model
with the library's code: the mesh of :class:`~fsdp_cli.parallel.dims.ParallelDims` (ep borrowed
from the data-parallel ranks), :func:`~fsdp_cli.parallel.parallelize.parallelize` (the experts
split over ep, FSDP2 over the rest) and this rank's rows of the batch. Prints one JSON line per
(layout, family, way): ``right`` (the library's), ``per_rank_balance`` (the load-balancing
statistics of each rank's tokens alone) and ``unscaled`` (the experts' gradients not divided by
ep): the largest relative difference of the losses and of the gradients against the reference.
The first family runs on every layout, the others on the first; ``--round-trip`` saves the first
layout's trained model with DCP, loads it at ep=1 (every rank data-parallel) and prints whether
every weight came back bit for bit (``round_trip_equal``).

    torchrun --nproc-per-node 4 tests/expert_parallel_check.py --layouts ep2xdp2,ep2xhsdp --folder DIR
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from context_parallel_check import _whole, gap, grad_gap  # (the same comparisons, tests/ on sys.path)

from fsdp_cli.models.args import LlamaArgs
from fsdp_cli.models.llama import Llama
from fsdp_cli.parallel.dims import ParallelDims
from fsdp_cli.parallel.parallelize import ParallelizeOptions, parallelize

VOCAB, SEQ, ROWS = 64, 8, 4
LAYOUTS = {
    "dp2": (1, 2, 1),
    "dp4": (1, 4, 1),
    "ep2": (1, 2, 2),
    "ep2xdp2": (1, 4, 2),
    "ep2xhsdp": (2, 2, 2),
    "ep4": (1, 4, 4),
}
"""(replicate, shard, ep) of each layout."""
FAMILIES = {
    # model type, dtype, experts kernel, experts, experts per token, weights saved (the hub's
    # layout, read by every rank) or a fresh init
    "qwen3_moe": ("qwen3_moe", torch.float64, "eager", 4, 2, True),
    # 2 experts at ep=2 x dp=2: one expert per rank and 2 shard ranks, so FSDP2 shards dim 1
    "qwen3_moe_2": ("qwen3_moe", torch.float64, "eager", 2, 1, True),
    # LoRA (peft=lora's adapters on every linear layer: attention; the experts frozen but the
    # tokens still exchanged for the adapters' gradients)
    "qwen3_moe_lora": ("qwen3_moe", torch.float64, "eager", 4, 2, True),
    "mixtral": ("mixtral", torch.float32, None, 4, 2, False),
    "olmoe": ("olmoe", torch.float32, None, 4, 2, False),
    # fsdp_cli's own Llama with 4 experts (top-2) and a shared expert in every block
    "builtin": ("", torch.float64, None, 4, 2, False),
    # ... balanced without a loss (DeepSeek-V3): a routing bias per expert moved after every step
    "builtin_bias": ("", torch.float64, None, 4, 2, False),
    # strategy.compile's per-block torch.compile (the token exchange left eager)
    "builtin_compiled": ("", torch.float64, None, 4, 2, False),
    "qwen3_moe_compiled": ("qwen3_moe", torch.float64, "eager", 4, 2, True),
}
BUILTIN = LlamaArgs(
    vocab_size=VOCAB,
    dim=16,
    n_layers=2,
    n_heads=2,
    n_kv_heads=1,
    max_seq_len=64,
    n_experts=4,
    experts_per_token=2,
    moe_hidden_dim=8,
    shared_experts=1,
    aux_loss_coef=0.1,
    init_std=0.3,
)
BUILTIN_BIAS = dataclasses.replace(BUILTIN, aux_loss_coef=0.0, balance_bias_rate=0.05)
"""(0.05 a step: the bias changes which experts tokens go to within the 5 steps.)"""


def moe_folder(
    folder: Path,
    family: str = "qwen3_moe",
    *,
    experts: int = 4,
    top_k: int = 2,
    weights: bool = True,
    initializer_range: float = 0.3,
) -> Path:
    """A tiny MoE model folder of transformers' ``family`` as transformers saves it (the hub's
    layout: one tensor per expert), or its config.json alone (tests/test_expert_parallel.py's too)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    sizes = (
        {"num_local_experts": experts}
        if family == "mixtral"
        else {"num_experts": experts, "moe_intermediate_size": 8}
    )
    config = AutoConfig.for_model(
        family,
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        num_experts_per_tok=top_k,
        output_router_logits=True,
        router_aux_loss_coef=0.1,
        tie_word_embeddings=False,
        initializer_range=initializer_range,
        **sizes,
    )
    folder.mkdir(parents=True, exist_ok=True)
    if weights:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    else:
        config.save_pretrained(folder)
    return folder


def write_folder(folder: Path, family: str) -> Path:
    model_type, _, _, experts, top_k, weights = FAMILIES[family]
    if not model_type:  # the built-in model: nothing to write
        return folder
    # (transformers' default init here: the float32 families' tolerance is set at it)
    return moe_folder(
        folder / family, model_type, experts=experts, top_k=top_k, weights=weights, initializer_range=0.02
    )


def build(path: Path, family: str):
    from fsdp_cli.models.args import HFModelArgs
    from fsdp_cli.models.hf import build_hf_model

    _, _, kernel, _, _, weights = FAMILIES[family]
    if family.startswith("builtin"):
        with torch.device("meta"):
            return Llama(BUILTIN_BIAS if family == "builtin_bias" else BUILTIN, seed=0)
    model = build_hf_model(
        HFModelArgs(path=str(path), pretrained=weights, experts_implementation=kernel), seed=0
    )
    if family.endswith("_lora"):
        from fsdp_cli.adapters.lora import apply_lora
        from fsdp_cli.adapters.options import AdapterMethod, AdapterOptions

        options = AdapterOptions(name=AdapterMethod.lora, r=4, targets=["all", "experts"])
        apply_lora(model, options, seed=0)
    return model


def batches(steps: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=gen) for _ in range(steps)]


def loss_of(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1).to(torch.float64), ids[:, 1:].flatten())
    auxiliary = model.pop_auxiliary_loss()
    return loss if auxiliary is None else loss + auxiliary.to(loss.dtype)


def train(model, steps: list[torch.Tensor], rows: slice, reduce_losses: bool, on_step=None):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, grads = [], []
    for ids in steps:
        loss = loss_of(model, ids[rows])
        loss.backward()
        mean = loss.detach().clone()
        if reduce_losses:
            dist.all_reduce(mean)
            mean /= dist.get_world_size()
        losses.append(mean.item())
        grads.append({n: _whole(p.grad).double() for n, p in model.named_parameters() if p.requires_grad})
        optimizer.step()
        optimizer.zero_grad()
        if hasattr(model, "update_balance_bias"):  # (as CausalLMModule.optimizer_step does)
            model.update_balance_bias()
        if on_step is not None:
            on_step()
    return losses, grads


def dynamo() -> dict[str, int]:
    """torch.compile's counters so far: graphs compiled, graph breaks."""
    from torch._dynamo.utils import counters

    return {"graphs": counters["stats"]["unique_graphs"], "breaks": sum(counters["graph_break"].values())}


def reference(path: Path, family: str, dtype: torch.dtype, steps: list[torch.Tensor]):
    model = build(path, family)
    model.to_empty(device="cpu")
    model.init_weights()
    model.to(dtype).train()
    model.balance_across_ranks = False
    return train(model, steps, slice(None), reduce_losses=False)


def parallel_model(path: Path, family: str, dtype: torch.dtype, layout: str):
    replicate, shard, ep = LAYOUTS[layout]
    dims = ParallelDims(dp_replicate=replicate, dp_shard=shard, tp=1, ep=ep)
    dims.build_mesh("cpu")
    model = build(path, family)
    parallelize(model, dims, ParallelizeOptions(compile=family.endswith("_compiled")))
    model.to_empty(device="cpu")
    model.init_weights()
    return model.to(dtype).train(), dims


def round_trip(model, path: Path, family: str, dtype: torch.dtype, folder: Path) -> bool:
    """``model``'s weights saved with DCP, loaded into the model at ep=1 (a fresh init first):
    every weight equal, bit for bit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    dcp.save(get_model_state_dict(model), checkpoint_id=str(folder))
    other, _ = parallel_model(path, family, dtype, "dp4" if dist.get_world_size() == 4 else "dp2")
    state = get_model_state_dict(other)
    dcp.load(state, checkpoint_id=str(folder))
    set_model_state_dict(other, state)
    mine = dict(model.named_parameters())
    return all(torch.equal(_whole(p.detach()), _whole(mine[n].detach())) for n, p in other.named_parameters())


def distributed(
    path: Path, family: str, dtype: torch.dtype, steps: list[torch.Tensor], layout: str, way: str
):
    from torch._dynamo.utils import counters

    from fsdp_cli.parallel import expert_parallel

    counters.clear()
    model, dims = parallel_model(path, family, dtype, layout)
    model.balance_across_ranks = way != "per_rank_balance"
    scale, compute = expert_parallel._ScaleGrad.apply, expert_parallel.ExpertParallel._compute
    empty = torch.zeros((), dtype=torch.int64)

    def counting(self, module, received, local_ids):  # how often a rank receives no row at all
        empty.add_(int(received.shape[0] == 0))
        return compute(self, module, received, local_ids)

    expert_parallel.ExpertParallel._compute = counting
    if way == "unscaled":
        expert_parallel._ScaleGrad.apply = staticmethod(lambda t, factor: t)
    try:
        dp_mesh = dims.data_parallel_mesh
        per = ROWS // dp_mesh.size()
        mine = slice(dp_mesh.get_local_rank() * per, (dp_mesh.get_local_rank() + 1) * per)
        snapshots: list[dict[str, int]] = []
        losses, grads = train(
            model, steps, mine, reduce_losses=True, on_step=lambda: snapshots.append(dynamo())
        )
        dist.all_reduce(empty)
        return losses, grads, model, int(empty), (snapshots[0], snapshots[-1])
    finally:
        expert_parallel._ScaleGrad.apply = scale
        expert_parallel.ExpertParallel._compute = compute


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layouts", required=True)
    parser.add_argument("--families", default="qwen3_moe")
    parser.add_argument("--ways", default="right")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--folder", required=True)
    parser.add_argument("--round-trip", action="store_true")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    folder = Path(args.folder)
    paths = {}
    for family in args.families.split(","):
        if dist.get_rank() == 0:
            write_folder(folder, family)
        paths[family] = folder / family
    dist.barrier()
    steps = batches(args.steps)
    families, layouts = args.families.split(","), args.layouts.split(",")
    for family in families:
        dtype = FAMILIES[family][1]
        ref_losses, ref_grads = reference(paths[family], family, dtype, steps)
        for layout in layouts if family == families[0] else layouts[:1]:
            for way in args.ways.split(",") if family == families[0] else ["right"]:
                losses, grads, model, empty, compiled = distributed(
                    paths[family], family, dtype, steps, layout, way
                )
                row = {
                    "layout": layout,
                    "family": family,
                    "way": way,
                    "loss_gap": gap(losses, ref_losses),
                    "grad_gap": grad_gap(grads, ref_grads),
                    "losses": losses,
                    "empty_receives": empty,  # forwards in which a rank received no token
                    # how FSDP2 and ep split the experts (``Shard(dim=1)`` first: along their rows)
                    "expert_placements": str(next(model.expert_modules()[0].parameters()).placements),
                    # torch.compile's graphs and breaks after the first step and at the end
                    "dynamo": compiled,
                }
                if args.round_trip and family == families[0] and layout == layouts[0] and way == "right":
                    row["round_trip_equal"] = round_trip(model, paths[family], family, dtype, folder / "dcp")
                if dist.get_rank() == 0:
                    print(json.dumps(row), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
