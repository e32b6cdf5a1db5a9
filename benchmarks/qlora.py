"""QLoRA: fsdp-train ``peft=qlora`` against a hand-written torchao-NF4 + peft + FSDP2 loop.

    python benchmarks/qlora.py                        # a small Llama folder built here, 2 CPU processes
    python benchmarks/qlora.py --hidden 512 --layers 4 --steps 30

One Hugging Face model folder (a ``LlamaForCausalLM`` built from a config and saved here; no
download) and one token file; two runs of ``--steps`` steps, run twice, alternating:

* ``fsdp-train model=hf strategy=fsdp2 peft=qlora`` (every linear layer of the blocks),
* the hand loop below under torchrun, written as torchtune's QLoRA recipe shards a model: the
  folder loaded with ``from_pretrained``, adapters injected by peft, each adapted layer's weight
  replaced by ``torchao``'s ``to_nf4`` of it, ``fully_shard`` per decoder layer then the root,
  AdamW over the adapters, the same micro-batches (the windows ``data=tokens`` takes at each step)
  and the same starting adapters (fsdp_cli's seeded init: the one thing taken from it).

Reported: each step's loss on both sides and their largest relative gap (the test,
``tests/test_qlora.py``, asserts < 1e-5 over 8 steps), the median step time after ``--warmup``
steps and its ratio fsdp-train / hand loop, and the peak memory per rank. Timings mean
something only on a quiet machine.
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

VOCAB = 256
SEED = 1234
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_folder(root: Path, *, hidden: int, layers: int, seq: int, windows: int) -> tuple[Path, Path]:
    """A Llama folder whose adapted weights split into NF4 blocks on 2 ranks, and a token file of
    ``windows`` windows of ``seq + 1`` tokens."""
    import numpy as np
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 64),
        max_position_embeddings=seq,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(root / "model")
    np.random.default_rng(0).integers(0, VOCAB, windows * seq + 1).astype(np.uint16).tofile(
        root / "tokens.bin"
    )
    return root / "model", root / "tokens.bin"


def fsdp_train_args(
    model: Path, tokens: Path, *, seq: int, batch: int, steps: int, devices: int, r: int
) -> list[str]:
    """fsdp-train's overrides for the run the hand loop repeats."""
    return [
        "model=hf",
        f"model.path={model}",
        "data=tokens",
        f"data.path={tokens}",
        f"data.seq_len={seq}",
        f"data.global_batch_size={batch}",
        f"data.micro_batch_size={batch // devices}",
        "strategy=fsdp2",
        f"devices={devices}",
        "accelerator=cpu",
        "precision=32-true",
        f"seed={SEED}",
        f"trainer.max_steps={steps}",
        "trainer.gradient_clip_val=0",
        "checkpoint.save_last=false",
        f"checkpoint.every_n_steps={steps + 1}",
        "peft=qlora",
        f"peft.r={r}",
        f"peft.alpha={2 * r}",
    ]


def hand_loop_command(out: Path, model: Path, tokens: Path, *, seq: int, batch: int, steps: int, devices: int, r: int) -> list[str]:  # fmt: skip
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={devices}",
        __file__, "--worker", str(out), str(model), str(tokens),
        f"--seq={seq}", f"--batch={batch}", f"--steps={steps}", f"--lora-rank={r}",
    ]  # fmt: skip


def worker(args: argparse.Namespace) -> None:
    """One rank of the hand-written QLoRA loop (under torchrun)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from peft import LoraConfig, inject_adapter_in_model
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torchao.quantization import to_nf4
    from transformers import AutoModelForCausalLM

    from fsdp_cli.adapters.lora import init_adapters
    from fsdp_cli.data.tokens import TokenWindows

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    config = LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, target_modules=TARGETS)
    inject_adapter_in_model(config, model)
    holder = nn.Module()  # fsdp-train holds the transformers model as .hf: its adapters' seeds are
    holder.hf = model  # drawn by those names
    init_adapters(holder, SEED)  # the adapters fsdp-train starts from
    for module in model.modules():
        if hasattr(module, "base_layer"):
            weight = module.base_layer.weight
            module.base_layer.weight = nn.Parameter(to_nf4(weight.detach(), 64, 256), requires_grad=False)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=3e-3,
        betas=(0.9, 0.95),
        eps=1e-8,
        weight_decay=0.0,
    )
    data = TokenWindows([Path(args.tokens)], dtype="uint16", seq_len=args.seq, seed=SEED)
    per_rank = args.batch // world
    losses, times = [], []
    for step in range(args.steps):
        first = step * args.batch + rank * per_rank
        batch = torch.stack([data[i] for i in range(first, first + per_rank)])
        began = time.perf_counter()
        logits = model(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - began)
        mean = loss.detach().clone()
        dist.all_reduce(mean, op=dist.ReduceOp.AVG)
        losses.append(mean.item())
    peaks = [None] * world
    dist.all_gather_object(peaks, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    if rank == 0:
        Path(args.out).write_text(
            json.dumps({"losses": losses, "step_times_s": times, "peak_memory_bytes": max(peaks)})
        )
    dist.destroy_process_group()


def fsdp_train_result(run_dir: Path) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r and "step" in r]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "losses": [r["loss"] for r in rows],
        "step_times_s": [r["step_time_s"] for r in rows],
        "peak_memory_bytes": max(summary["peak_memory_bytes"]),
    }


def relative_gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


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
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.worker:
        args.out, args.model, args.tokens = args.worker
        worker(args)
        return
    root = args.out or Path(tempfile.mkdtemp(prefix="qlora_bench_"))
    root.mkdir(parents=True, exist_ok=True)
    model, tokens = build_folder(
        root, hidden=args.hidden, layers=args.layers, seq=args.seq, windows=args.batch * (args.steps + 1)
    )
    sizes = {
        "seq": args.seq,
        "batch": args.batch,
        "steps": args.steps,
        "devices": args.devices,
        "r": args.lora_rank,
    }
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ours, hand = [], []
    for repeat in range(args.repeats):
        run_dir = root / f"fsdp_train_{repeat}"
        cmd = ["fsdp-train", *fsdp_train_args(model, tokens, **sizes), f"hydra.run.dir={run_dir}"]
        subprocess.run(cmd, check=True, capture_output=True, timeout=1800)
        ours.append(fsdp_train_result(run_dir))
        out = root / f"hand_loop_{repeat}.json"
        subprocess.run(
            hand_loop_command(out, model, tokens, **sizes),
            check=True,
            capture_output=True,
            env=env,
            timeout=1800,
        )
        hand.append(json.loads(out.read_text()))
    print(f"losses (fsdp-train): {ours[0]['losses']}\nlosses (hand loop):  {hand[0]['losses']}")
    print(f"largest relative loss gap: {relative_gap(ours[0]['losses'], hand[0]['losses']):.2e}")

    def median(side: list[dict]) -> float:
        return statistics.median(t for run in side for t in run["step_times_s"][args.warmup :])

    ratio = median(ours) / median(hand)
    print("| side | step time (s) | peak memory / rank (MiB) |\n|---|---|---|")
    for name, side in (("fsdp-train peft=qlora", ours), ("hand NF4 + peft + FSDP2 loop", hand)):
        print(f"| {name} | {median(side):.4f} | {max(r['peak_memory_bytes'] for r in side) / 2**20:.0f} |")
    print(f"fsdp-train / hand loop step time: {ratio:.3f}x")


if __name__ == "__main__":
    main()
