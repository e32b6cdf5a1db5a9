"""fsdp-train against a hand-written FSDP2 loop on the same model and settings, in one run.

    python benchmarks/compare_loop.py                      # tiny model, 2 CPU processes
    python benchmarks/compare_loop.py --model llama_124m --devices 8 --precision bf16-mixed --batch 64 --seq 1024

Both sides: FSDP2 (fully_shard per block + root), the same mixed precision, synthetic data through
the same sampler, AdamW, clipping at 1.0, a loss all-reduce every 10 steps. Step times are medians
over the steps after warm-up; the runs alternate (A B A B ...) so drift hits both alike. Prints a
table and writes benchmark.json (in --out) with every measurement and the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run_fsdp_train(args: argparse.Namespace, run_dir: Path) -> dict:
    cmd = [
        "fsdp-train",
        "strategy=fsdp2",
        f"model={args.model}",
        f"devices={args.devices}",
        f"precision={args.precision}",
        f"trainer.max_steps={args.steps}",
        "trainer.log_every_n_steps=10",
        f"data.global_batch_size={args.batch}",
        f"data.seq_len={args.seq}",
        "checkpoint.save_last=false",
        "optim.lr=3e-4",
        f"hydra.run.dir={run_dir}",
    ]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"fsdp-train failed:\n{result.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = [r["step_time_s"] for r in rows if r["step"] > args.warmup + 10]
    summary = json.loads((run_dir / "summary.json").read_text())
    step_time = statistics.median(steady)
    return {
        "step_time_s": step_time,
        "tokens_per_s": args.batch * args.seq / step_time,
        "peak_memory_bytes": max(summary["peak_memory_bytes"]),
        "precision": summary["precision"],
    }


def run_hand_loop(args: argparse.Namespace, out: Path, precision: str) -> dict:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": os.environ.get(
            "OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // args.devices))
        ),
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={args.devices}",
        str(HERE / "hand_loop.py"),
        str(out),
        f"steps={args.steps}",
        f"warmup={args.warmup}",
        f"global_batch_size={args.batch}",
        f"seq_len={args.seq}",
        f"precision={precision}",
        f"model={args.model}",
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise SystemExit(f"hand-written loop failed:\n{result.stderr[-3000:]}")
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmark_out"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {"fsdp-train": [], "hand-written": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            cli = run_fsdp_train(args, Path(tmp) / f"cli{i}")
            results["fsdp-train"].append(cli)
            results["hand-written"].append(run_hand_loop(args, Path(tmp) / f"hand{i}.json", cli["precision"]))
    med = {k: statistics.median(r["tokens_per_s"] for r in v) for k, v in results.items()}
    ratio = med["fsdp-train"] / med["hand-written"]
    report = {
        "settings": vars(args) | {"out": str(args.out)},
        "runs": results,
        "median_tokens_per_s": med,
        "ratio_fsdp_train_to_hand": ratio,
    }
    (args.out / "benchmark.json").write_text(json.dumps(report, indent=2, default=str))
    print(
        f"model={args.model} devices={args.devices} precision={results['fsdp-train'][0]['precision']} "
        f"batch={args.batch}x{args.seq} steps={args.steps} (median of {args.repeats} runs each)"
    )
    for name, value in med.items():
        peak = results[name][0]["peak_memory_bytes"]
        peak_text = f"{peak / 2**20:,.0f} MiB" if peak else "-"
        print(f"  {name:13s} {value:12,.0f} tokens/s   peak {peak_text}")
    print(f"  ratio fsdp-train / hand-written: {ratio:.3f}")


if __name__ == "__main__":
    main()
