"""LoRA: fsdp-train's LoRA against full fine-tuning, and against a hand-written peft + FSDP2 loop.

    python benchmarks/lora.py                       # a small Llama folder built here, 2 CPU processes
    python benchmarks/lora.py --hidden 512 --layers 8 --steps 30 --devices 2

One Hugging Face model folder (a ``LlamaForCausalLM`` built from a config and saved here; no
download) and one token file, three runs of ``--steps`` steps each:

* ``fsdp-train model=hf strategy=fsdp2 peft=none`` (full fine-tuning),
* ``fsdp-train model=hf strategy=fsdp2 peft=lora`` (r, alpha, every linear layer of the blocks),
* the hand loop below under torchrun: ``peft.get_peft_model`` on ``from_pretrained``,
  ``fully_shard`` per decoder layer then the root, AdamW over the trainable parameters, the same
  micro-batches (consecutive windows of the token file).

Reported: median step time after ``--warmup`` steps and peak memory per rank (fsdp-train's
``summary.json``; the loop's own peak RSS), and the ratio fsdp-train LoRA / hand loop (goal
<= 1.05). Timings mean something only on a quiet machine. ``--out DIR`` keeps the runs.
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

FSDP_TRAIN = (
    str(Path(sys.executable).parent / "fsdp-train")
    if (Path(sys.executable).parent / "fsdp-train").exists()
    else "fsdp-train"
)
VOCAB = 256


def build_folder(root: Path, args: argparse.Namespace) -> tuple[Path, Path]:
    """The model folder and a token file of enough windows for every step."""
    import numpy as np
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64),
        max_position_embeddings=args.seq,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(root / "model")
    tokens = (args.steps + 1) * args.batch * (args.seq + 1) + 1
    np.random.default_rng(0).integers(0, VOCAB, tokens).astype(np.uint16).tofile(root / "tokens.bin")
    return root / "model", root / "tokens.bin"


def run_fsdp_train(args: argparse.Namespace, model: Path, tokens: Path, peft: str, run_dir: Path) -> dict:
    cmd = [
        FSDP_TRAIN,
        "model=hf",
        f"model.path={model}",
        "data=tokens",
        f"data.path={tokens}",
        f"data.seq_len={args.seq}",
        f"data.global_batch_size={args.batch}",
        "strategy=fsdp2",
        f"devices={args.devices}",
        "precision=32-true",
        "accelerator=cpu",
        f"trainer.max_steps={args.steps}",
        "trainer.gradient_clip_val=0",
        "checkpoint.save_last=false",
        f"checkpoint.every_n_steps={args.steps + 1}",
        f"peft={peft}",
        f"peft.r={args.lora_rank}",
        f"peft.alpha={2 * args.lora_rank}",  # as the hand loop's LoraConfig
        f"hydra.run.dir={run_dir}",
    ]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"fsdp-train failed:\n{result.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time_s"] for r in rows if r.get("step_time_s") and r.get("step", 0) > args.warmup]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"step_time_s": statistics.median(times), "peak_memory_bytes": max(summary["peak_memory_bytes"])}


def run_hand_loop(args: argparse.Namespace, model: Path, tokens: Path, out: Path) -> dict:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.devices}",
        __file__, "--worker", str(out), str(model), str(tokens),
        *[f"--{k.replace('_', '-')}={getattr(args, k)}" for k in ("steps", "warmup", "batch", "seq", "lora_rank")],
    ]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if result.returncode != 0:
        raise SystemExit(f"hand loop failed:\n{result.stderr[-3000:]}")
    return json.loads(out.read_text())


def worker(args: argparse.Namespace) -> None:
    """One rank of the hand-written peft + FSDP2 loop (under torchrun)."""
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from peft import LoraConfig, get_peft_model
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    names = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(
        base, LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, target_modules=names)
    )
    for layer in base.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    data = torch.from_numpy(np.fromfile(args.tokens, dtype=np.uint16).astype(np.int64))
    per_rank, window = args.batch // world, args.seq + 1
    times = []
    for step in range(args.steps):
        start = (step * args.batch + rank * per_rank) * window
        batch = data[start : start + per_rank * window].view(per_rank, window)
        began = time.perf_counter()
        logits = model(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(loss.detach(), op=dist.ReduceOp.AVG)
        times.append(time.perf_counter() - began)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    peaks = [None] * world
    dist.all_gather_object(peaks, peak)
    if rank == 0:
        measured = {"step_time_s": statistics.median(times[args.warmup :]), "peak_memory_bytes": max(peaks)}
        Path(args.out).write_text(json.dumps(measured))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worker", nargs=3, metavar=("OUT", "MODEL", "TOKENS"), help=argparse.SUPPRESS)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.worker:
        args.out, args.model, args.tokens = args.worker
        worker(args)
        return
    root = args.out or Path(tempfile.mkdtemp(prefix="lora_bench_"))
    root.mkdir(parents=True, exist_ok=True)
    model, tokens = build_folder(root, args)
    full = run_fsdp_train(args, model, tokens, "none", root / "full")
    lora = run_fsdp_train(args, model, tokens, "lora", root / "lora")
    hand = run_hand_loop(args, model, tokens, root / "hand_loop.json")
    print("| run | step time (s) | peak memory / rank (MiB) |\n|---|---|---|")
    for name, m in (
        ("fsdp-train full (fsdp2)", full),
        ("fsdp-train LoRA (fsdp2)", lora),
        ("hand peft + FSDP2 loop", hand),
    ):
        print(f"| {name} | {m['step_time_s']:.4f} | {m['peak_memory_bytes'] / 2**20:.0f} |")
    print(f"fsdp-train LoRA / hand loop: {lora['step_time_s'] / hand['step_time_s']:.3f}x (goal <= 1.05)")


if __name__ == "__main__":
    main()
