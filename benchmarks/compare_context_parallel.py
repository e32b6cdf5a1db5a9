"""Context parallel on CPU: fsdp-train at cp=2 against a hand-written loop with the same all-to-all
attention, and the memory per rank at cp=1, 2 and 4 beside the plan's.

    python benchmarks/compare_context_parallel.py                       # both parts, ~10 minutes on 2 cores
    python benchmarks/compare_context_parallel.py --record docs/benchmark.md
    python benchmarks/compare_context_parallel.py --skip-memory --repeats 1

Step time: the built-in Llama (dim 128, 2 blocks, 4 heads, 2 key/value heads) on 2 sequences of
2048 tokens per step, FSDP2 over the 2 cp ranks; the hand loop (``hand_loop.py cp=2``) builds the
same model with ``fully_shard`` and the library's :class:`ContextParallel` (the attention is the
same code on both sides: the comparison is of everything around it). Pairs interleaved as in
``compare_loop.py``; a pair's ratio is fsdp-train's median step time after warm-up over the hand
loop's.

Memory: fsdp-train at cp=1, 2, 4 (one process per cp rank, dp=1, one 8192-token sequence per
step): the measured peak per rank (max RSS, the interpreter and libraries included) and the
plan's total and activations per rank (``fsdp-plan --json`` of the same command).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `benchmarks.compare_loop` from a checkout

from benchmarks.compare_loop import SIZES, Cell, commit, record, run_fsdp_train, run_hand_loop

SIZES["context"] = {"dim": 128, "n_layers": 2, "seq": 2048, "batch": 2, "steps": 40, "warmup": 10}
MEMORY = {"dim": 128, "n_layers": 2, "seq": 8192, "batch": 1, "steps": 4}
MARKS = ("<!-- compare_context_parallel:begin -->", "<!-- compare_context_parallel:end -->")


def step_times(args: argparse.Namespace, tmp: Path) -> list[dict]:
    cell = Cell("builtin", "context", "fsdp2", args.log_every)
    extra = ("cp=2", f"model.max_seq_len={SIZES['context']['seq']}")
    pairs = []
    for repeat in range(args.repeats):
        stem = tmp / f"step_{repeat}"
        first_ours = repeat % 2 == 0
        ours = run_fsdp_train(cell, args, stem, extra) if first_ours else None
        hand = run_hand_loop(cell, args, stem.with_suffix(".json"), args.precision, cp=2)
        ours = ours or run_fsdp_train(cell, args, stem, extra)
        pair = {
            "fsdp_train_s": ours["step_time_s"],
            "hand_s": hand["step_time_s"],
            "ratio": ours["step_time_s"] / hand["step_time_s"],
            "load_avg": os.getloadavg()[0],
        }
        pairs.append(pair)
        print(
            f"[{repeat + 1}/{args.repeats}] fsdp-train {pair['fsdp_train_s'] * 1e3:8.2f} ms  "
            f"hand {pair['hand_s'] * 1e3:8.2f} ms  ratio {pair['ratio']:.3f}  (load {pair['load_avg']:.1f})",
            flush=True,
        )
    return pairs


def memory_command(cp: int, run_dir: Path | None) -> list[str]:
    size = MEMORY
    fsdp_train = Path(sys.executable).parent / "fsdp-train"
    return [
        str(fsdp_train) if fsdp_train.exists() else "fsdp-train",
        "accelerator=cpu",
        f"devices={cp}",
        f"cp={cp}",
        "model=tiny",
        f"model.dim={size['dim']}",
        f"model.n_layers={size['n_layers']}",
        f"model.max_seq_len={size['seq']}",
        f"data.seq_len={size['seq']}",
        f"data.global_batch_size={size['batch']}",
        f"trainer.max_steps={size['steps']}",
        "checkpoint.save_last=false",
        *([f"hydra.run.dir={run_dir}"] if run_dir else []),
    ]


def memory(tmp: Path) -> list[dict]:
    rows = []
    for cp in (1, 2, 4):
        run_dir = tmp / f"memory_cp{cp}"
        result = subprocess.run(memory_command(cp, run_dir), capture_output=True, text=True)
        if result.returncode != 0:
            raise SystemExit(f"fsdp-train cp={cp} failed:\n{result.stderr[-3000:]}")
        summary = json.loads((run_dir / "summary.json").read_text())
        plan_cmd = [str(Path(sys.executable).parent / "fsdp-plan"), *memory_command(cp, None)[1:], "--json"]
        planned = json.loads(subprocess.run(plan_cmd, capture_output=True, text=True, check=True).stdout)
        rank0 = planned["ranks"][0]
        row = {
            "cp": cp,
            "tokens_per_rank": MEMORY["seq"] // cp,
            "measured_peak_bytes": max(summary["peak_memory_bytes"]),
            "plan_total_bytes": rank0["total"],
            "plan_activations_bytes": rank0["activations"],
        }
        rows.append(row)
        print(
            f"cp={cp}: measured {row['measured_peak_bytes'] / 2**20:.0f} MiB per rank, plan "
            f"{row['plan_total_bytes'] / 2**20:.0f} MiB (activations {row['plan_activations_bytes'] / 2**20:.0f})",
            flush=True,
        )
    return rows


def table(pairs: list[dict], rows: list[dict]) -> str:
    lines = []
    if pairs:
        ratios = [p["ratio"] for p in pairs]
        lines += [
            "| cp=2 (2 CPU ranks) | fsdp-train ms/step | hand-written ms/step | ratio (median) | spread |",
            "|---|---|---|---|---|",
            f"| {SIZES['context']['batch']} x {SIZES['context']['seq']} tokens | "
            f"{statistics.median(p['fsdp_train_s'] for p in pairs) * 1e3:.1f} | "
            f"{statistics.median(p['hand_s'] for p in pairs) * 1e3:.1f} | {statistics.median(ratios):.3f} | "
            f"{min(ratios):.3f}-{max(ratios):.3f} |",
            "",
        ]
    if rows:
        mib = 2**20
        lines += [
            f"| cp (one {MEMORY['seq']}-token sequence) | tokens per rank | measured peak per rank (MiB, RSS) | plan per rank (MiB) | plan's activations (MiB) |",
            "|---|---|---|---|---|",
            *(
                f"| {r['cp']} | {r['tokens_per_rank']} | {r['measured_peak_bytes'] / mib:.0f} | "
                f"{r['plan_total_bytes'] / mib:.0f} | {r['plan_activations_bytes'] / mib:.0f} |"
                for r in rows
            ),
        ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--log-every", type=int, default=1)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--skip-steps", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("benchmark_out"))
    parser.add_argument("--record", type=Path, default=None, help="write the tables into this markdown file")
    args = parser.parse_args()
    args.devices, args.default_malloc = 2, False
    args.out.mkdir(parents=True, exist_ok=True)
    measured = commit()
    with tempfile.TemporaryDirectory() as tmp:
        pairs = [] if args.skip_steps else step_times(args, Path(tmp))
        rows = [] if args.skip_memory else memory(Path(tmp))
    text = table(pairs, rows)
    command = "python " + " ".join(["benchmarks/compare_context_parallel.py", *sys.argv[1:]])
    (args.out / "context_parallel_benchmark.json").write_text(
        json.dumps({"command": command, "pairs": pairs, "memory": rows}, indent=2)
    )
    print(text)
    if args.record is not None:
        loads = [p["load_avg"] for p in pairs] or [os.getloadavg()[0]]
        settings = (
            f"{args.precision}, {args.repeats} interleaved repeats, {os.cpu_count()} cores, load average "
            f"{min(loads):.1f}-{max(loads):.1f}; {time.strftime('%Y-%m-%d', time.gmtime())}, commit {measured}"
        )
        record(args.record, command, text, settings, marks=MARKS)


if __name__ == "__main__":
    main()
