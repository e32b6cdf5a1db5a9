"""Expert parallel on CPU: fsdp-train at ep=2 against a hand-written loop around the same expert
parallel code, against FSDP2 without ep, and against transformers' own expert parallel, in one run.

    python benchmarks/compare_expert_parallel.py                  # ~5 minutes on 2 cores
    python benchmarks/compare_expert_parallel.py --repeats 1

The model: a Qwen3-MoE folder in the hub's layout (hidden 256, 4 layers, 8 experts of 256, top-2,
load-balancing loss on; transformers' default ``grouped_mm`` experts), fp32, 2 sequences of 256
tokens per rank per step, AdamW, clipping at 1.0, the loss averaged over the ranks every step.

* **fsdp-train ep=2** on 2 ranks (4 experts each);
* **hand loop** (this file under torchrun, ``--loop hand``): the same model built by
  ``build_hf_model`` and split by :func:`fsdp_cli.parallel.parallelize.parallelize` at ep=2 (the
  expert-parallel code is the same on both sides: the comparison is of everything around it), a
  plain PyTorch loop;
* **fsdp-train ep=1**: plain FSDP2 over the 2 ranks (every rank computes every expert);
* **transformers' expert parallel** (``--loop transformers``): ``from_pretrained`` with
  ``DistributedConfig(ep_size=2, fsdp_size=2)`` (its FSDP2 and expert parallel), the loss
  transformers computes, the same optimizer and clipping (fsdp_cli's clip: torch's refuses
  gradients on the two meshes transformers makes).

Pairs interleaved; each run's step time is its median after warm-up; the peak is the largest
rank's max RSS (the interpreter and libraries included).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SEQ, ROWS, STEPS, WARMUP = 256, 2, 30, 10
CONFIG = {
    "vocab_size": 2048,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "output_router_logits": True,
    "router_aux_loss_coef": 0.01,
    "tie_word_embeddings": False,
    "max_position_embeddings": 1024,
}
ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO)}


def make_folder(path: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(Qwen3MoeConfig(**CONFIG)).save_pretrained(path)
    return path


def fsdp_train(folder: Path, run_dir: Path, ep: int) -> dict:
    command = [
        "fsdp-train",
        "model=hf",
        f"model.path={folder}",
        "accelerator=cpu",
        "devices=2",
        f"ep={ep}",
        "precision=32-true",
        f"data.seq_len={SEQ}",
        f"data.global_batch_size={2 * ROWS}",
        f"trainer.max_steps={STEPS}",
        "trainer.gradient_clip_val=1.0",
        "checkpoint.every_n_steps=null",
        "checkpoint.save_last=false",
        f"hydra.run.dir={run_dir}",
    ]
    result = subprocess.run(command, capture_output=True, text=True, env=ENV, cwd=REPO)
    if result.returncode != 0:
        raise SystemExit(f"fsdp-train ep={ep} failed:\n{result.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    times = [r["step_time_s"] for r in rows if r["step"] > WARMUP]
    return {"step_time_s": statistics.median(times), "peak_bytes": max(summary["peak_memory_bytes"])}


def torchrun(folder: Path, out: Path, loop: str) -> dict:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        __file__, "--loop", loop, "--folder", str(folder), "--out", str(out),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, env=ENV, cwd=REPO)
    if result.returncode != 0 or not out.exists():
        errors = [line for line in result.stderr.splitlines() if "Error:" in line] or ["no output"]
        return {"error": errors[0].split("]:", 1)[-1].strip()[:300]}
    return json.loads(out.read_text())


# --------------------------------------------------------------------------- the loops (under torchrun)


def _batches(vocab: int, rank: int):
    import torch

    gen = torch.Generator().manual_seed(100 + rank)
    while True:
        yield torch.randint(0, vocab, (ROWS, SEQ + 1), generator=gen)


def _timed_loop(step, rank: int, vocab: int) -> list[float]:
    times = []
    for _, ids in zip(range(STEPS), _batches(vocab, rank), strict=False):
        started = time.perf_counter()
        step(ids)
        times.append(time.perf_counter() - started)
    return times


def hand_loop(folder: Path):
    import torch.nn.functional as F

    from fsdp_cli.models.args import HFModelArgs
    from fsdp_cli.models.hf import build_hf_model
    from fsdp_cli.parallel.dims import ParallelDims
    from fsdp_cli.parallel.parallelize import ParallelizeOptions, parallelize

    dims = ParallelDims(dp_replicate=1, dp_shard=2, tp=1, ep=2)
    dims.build_mesh("cpu")
    model = build_hf_model(HFModelArgs(path=str(folder)), seed=0)
    parallelize(model, dims, ParallelizeOptions())
    model.to_empty(device="cpu")
    model.init_weights()
    model.train()

    def loss_of(ids):
        logits = model(ids[:, :-1])
        return (
            F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten()) + model.pop_auxiliary_loss()
        )

    return _optimizer_step(model, loss_of), model.hf.config.vocab_size


def transformers_loop(folder: Path):
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    model = AutoModelForCausalLM.from_pretrained(
        folder, distributed_config=DistributedConfig(ep_size=2, fsdp_size=2)
    )
    model.train()
    return _optimizer_step(model, lambda ids: model(input_ids=ids[:, :-1], labels=ids[:, :-1]).loss), (
        model.config.vocab_size
    )


def _optimizer_step(model, loss_of):
    """One training step around ``loss_of(ids)``, the same on both loops: backward, clipping at 1.0
    (fsdp_cli's clip: torch's refuses gradients on two meshes, the experts' and the rest's),
    AdamW, and the loss averaged over the ranks and read on the host."""
    import torch
    import torch.distributed as dist

    from fsdp_cli.parallel.grad_norm import clip_grad_norm

    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95))

    def step(ids):
        loss = loss_of(ids)
        loss.backward()
        clip_grad_norm(model, model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        mean.item()

    return step


def rank_main(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    make = hand_loop if args.loop == "hand" else transformers_loop
    step, vocab = make(Path(args.folder))
    times = _timed_loop(step, dist.get_rank(), vocab)
    peak = [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, peak[0])
    if dist.get_rank() == 0:
        result = {"step_time_s": statistics.median(times[WARMUP:]), "peak_bytes": max(gathered)}
        Path(args.out).write_text(json.dumps(result))
    dist.destroy_process_group()


# --------------------------------------------------------------------------- the comparison


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--loop", choices=("hand", "transformers"))
    parser.add_argument("--folder")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.loop:
        rank_main(args)
        return
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        folder = make_folder(tmp / "model")
        runs: dict[str, list[dict]] = {"fsdp-train ep=2": [], "hand loop ep=2": [], "fsdp-train ep=1": []}
        for repeat in range(args.repeats):
            order = list(runs) if repeat % 2 == 0 else list(reversed(runs))
            for name in order:
                out = tmp / f"{name.replace(' ', '_').replace('=', '')}_{repeat}"
                if name.startswith("fsdp-train"):
                    result = fsdp_train(folder, out, int(name[-1]))
                else:
                    result = torchrun(folder, out.with_suffix(".json"), "hand")
                runs[name].append(result)
                print(f"[{repeat + 1}/{args.repeats}] {name:18s} {result['step_time_s'] * 1e3:8.1f} ms/step  "
                      f"peak {result['peak_bytes'] / 2**20:7.0f} MiB", flush=True)  # fmt: skip
        theirs = torchrun(folder, tmp / "transformers.json", "transformers")
    report(runs, theirs)


def report(runs: dict[str, list[dict]], theirs: dict) -> None:
    ep2 = statistics.median(r["step_time_s"] for r in runs["fsdp-train ep=2"])
    ratios = [
        a["step_time_s"] / b["step_time_s"]
        for a, b in zip(runs["fsdp-train ep=2"], runs["hand loop ep=2"], strict=True)
    ]
    print("\n| run | step (ms, median) | peak RSS per rank (MiB) | vs fsdp-train ep=2 |")
    print("|---|---|---|---|")
    for name, results in runs.items():
        step = statistics.median(r["step_time_s"] for r in results)
        peak = max(r["peak_bytes"] for r in results) / 2**20
        print(f"| {name} | {step * 1e3:.1f} | {peak:.0f} | {step / ep2:.3f}x |")
    if "error" in theirs:
        print(f"| transformers ep_size=2 | did not run: {theirs['error']} | | |")
    else:
        print(
            f"| transformers ep_size=2 | {theirs['step_time_s'] * 1e3:.1f} | {theirs['peak_bytes'] / 2**20:.0f} "
            f"| {theirs['step_time_s'] / ep2:.3f}x |"
        )
    print(f"\nfsdp-train ep=2 / hand loop, per pair: {', '.join(f'{r:.3f}' for r in ratios)}; "
          f"median {statistics.median(ratios):.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
