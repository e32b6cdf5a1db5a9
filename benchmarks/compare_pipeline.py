"""fsdp-train with pipeline parallel against the hand-written pipeline loop (``pipeline_loop.py``):
the same built-in Llama, schedule, micro-batches and FSDP2 inside, pp=2 x dp=2 on 4 CPU processes.

    python benchmarks/compare_pipeline.py                                   # 1F1B and Interleaved1F1B
    python benchmarks/compare_pipeline.py --record docs/benchmark.md        # ... and write the table there
    python benchmarks/compare_pipeline.py --hand-only --steps 6 --warmup 2 --repeats 1   # the hand loop alone

The harness is ``compare_loop.py``'s: each schedule is a pair (fsdp-train and the hand loop,
which goes first alternating between repeats), the pairs of all schedules interleaved, a pair's
ratio fsdp-train's median step time (after warm-up) over the hand loop's; a schedule reports the
median ratio and its spread. Beside it, the bubble the hand loop measured (each pipeline rank's
time waiting for its peers over the step time, averaged over its data-parallel ranks) and the
schedule's theoretical one (``fsdp_cli.pipeline.schedules``). Both sides keep the parameters
gathered from forward to backward (``strategy.reshard_after_forward=false``), which the
zero-bubble schedules need and every schedule's micro-batches profit from. ``--hand-only`` runs
the hand loop alone (a quick check that it runs, or its bubble without the comparison).
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

from benchmarks.compare_loop import (
    HERE,
    N_HEADS,
    N_KV_HEADS,
    REPO,
    SIZES,
    Cell,
    commit,
    record,
    run_fsdp_train,
)

SIZES["pipeline"] = {"dim": 128, "n_layers": 4, "seq": 128, "batch": 16, "steps": 60, "warmup": 20}
"""4 blocks: two stages per rank at pp=2 for the interleaved schedules."""
MARKS = ("<!-- compare_pipeline:begin -->", "<!-- compare_pipeline:end -->")


def pipeline_overrides(schedule: str, args: argparse.Namespace) -> tuple[str, ...]:
    return (
        f"pp={args.pp}",
        f"pipeline.schedule={schedule}",
        f"pipeline.microbatches={args.microbatches}",
        "strategy.reshard_after_forward=false",
    )


def run_pipeline_loop(schedule: str, args: argparse.Namespace, out: Path, precision: str) -> dict:
    size = SIZES["pipeline"]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // args.devices)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={args.devices}",
        str(HERE / "pipeline_loop.py"),
        str(out),
        f"pp={args.pp}",
        f"schedule={schedule}",
        f"microbatches={args.microbatches}",
        f"dim={size['dim']}",
        f"n_layers={size['n_layers']}",
        f"n_heads={N_HEADS}",
        f"n_kv_heads={N_KV_HEADS}",
        f"seq_len={size['seq']}",
        f"global_batch_size={size['batch']}",
        f"steps={size['steps']}",
        f"warmup={size['warmup']}",
        f"log_every={args.log_every}",
        f"precision={precision}",
        "reshard_after_forward=false",
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=args.timeout)
    if not out.is_file():
        raise SystemExit(f"hand-written pipeline loop failed ({schedule}):\n{result.stderr[-3000:]}")
    return json.loads(out.read_text())


def measure(args: argparse.Namespace, tmp: Path) -> dict[str, list[dict]]:
    pairs: dict[str, list[dict]] = {s: [] for s in args.schedules}
    cell = Cell("builtin", "pipeline", "fsdp2", args.log_every)
    for repeat in range(args.repeats):
        for schedule in args.schedules:
            started, stem = time.time(), tmp / f"{schedule}_{repeat}"
            hand_out = stem.with_suffix(".json")
            if args.hand_only:
                ours, hand = None, run_pipeline_loop(schedule, args, hand_out, args.precision)
            elif repeat % 2 == 0:
                ours = run_fsdp_train(cell, args, stem, pipeline_overrides(schedule, args))
                hand = run_pipeline_loop(schedule, args, hand_out, ours["precision"])
            else:
                hand = run_pipeline_loop(schedule, args, hand_out, pairs[schedule][0]["precision"])
                ours = run_fsdp_train(cell, args, stem, pipeline_overrides(schedule, args))
            pair = {
                "hand_s": hand["step_time_s"],
                "idle": hand["idle_fraction_by_pp_rank"],
                "theoretical_bubble": hand["theoretical_bubble"],
                "precision": ours["precision"] if ours else args.precision,
                "load_avg": os.getloadavg()[0],
            }
            if ours:
                pair |= {
                    "fsdp_train_s": ours["step_time_s"],
                    "ratio": ours["step_time_s"] / hand["step_time_s"],
                }
            pairs[schedule].append(pair)
            idle = ", ".join(f"{float(v):.0%}" for v in pair["idle"].values())
            versus = (
                f"fsdp-train {pair['fsdp_train_s'] * 1e3:8.2f} ms  ratio {pair['ratio']:.3f}  "
                if ours
                else ""
            )
            print(
                f"[{repeat + 1}/{args.repeats}] {schedule:16s} {versus}hand {pair['hand_s'] * 1e3:8.2f} ms  "
                f"idle by stage {idle} (theory {pair['theoretical_bubble']:.0%})  "
                f"(load {pair['load_avg']:.1f}, {time.time() - started:.0f} s)",
                flush=True,
            )
    return pairs


def table(pairs: dict[str, list[dict]]) -> str:
    lines = [
        "| schedule | fsdp-train ms/step | hand-written ms/step | ratio (median) | spread | measured bubble by stage (hand) | theoretical bubble |",
        "|---|---|---|---|---|---|---|",
    ]
    for schedule, runs in pairs.items():
        ratios = [p["ratio"] for p in runs if "ratio" in p]
        ours = [p["fsdp_train_s"] for p in runs if "fsdp_train_s" in p]
        stages = runs[0]["idle"].keys()
        idle = ", ".join(f"{statistics.median(float(p['idle'][s]) for p in runs):.1%}" for s in stages)
        lines.append(
            f"| {schedule} | {f'{statistics.median(ours) * 1e3:.2f}' if ours else '-'} | "
            f"{statistics.median(p['hand_s'] for p in runs) * 1e3:.2f} | "
            f"{f'{statistics.median(ratios):.3f}' if ratios else '-'} | "
            f"{f'{min(ratios):.3f}-{max(ratios):.3f}' if ratios else '-'} | {idle} | "
            f"{runs[0]['theoretical_bubble']:.1%} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--schedules", default="1F1B,Interleaved1F1B")
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--devices", type=int, default=4, help="processes: pp x dp")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--log-every", type=int, default=1)
    parser.add_argument("--precision", default="32-true", help="the hand loop's, with --hand-only")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--timeout", type=int, default=900, help="seconds per hand-loop run")
    parser.add_argument("--hand-only", action="store_true", help="run the hand-written loop alone")
    parser.add_argument("--out", type=Path, default=Path("benchmark_out"))
    parser.add_argument("--record", type=Path, default=None, help="write the table into this markdown file")
    args = parser.parse_args()
    args.schedules = args.schedules.split(",")
    for key in ("steps", "warmup"):
        if getattr(args, key) is not None:
            SIZES["pipeline"][key] = getattr(args, key)
    args.out.mkdir(parents=True, exist_ok=True)
    measured = commit()
    with tempfile.TemporaryDirectory() as tmp:
        pairs = measure(args, Path(tmp))
    text = table(pairs)
    command = "python " + " ".join(["benchmarks/compare_pipeline.py", *sys.argv[1:]])
    (args.out / "pipeline_benchmark.json").write_text(
        json.dumps({"command": command, "settings": vars(args), "pairs": pairs}, indent=2, default=str)
    )
    print(text)
    if args.record is not None:
        loads = [p["load_avg"] for runs in pairs.values() for p in runs]
        settings = (
            f"pp={args.pp} x dp={args.devices // args.pp}, {args.microbatches} micro-batches, "
            f"{next(iter(pairs.values()))[0]['precision']}, {args.repeats} interleaved repeats, {os.cpu_count()} cores, "
            f"load average {min(loads):.1f}-{max(loads):.1f}; {time.strftime('%Y-%m-%d', time.gmtime())}, commit {measured}"
        )
        record(args.record, command, text, settings, marks=MARKS)


if __name__ == "__main__":
    main()
