"""Step time around a checkpoint save, with and without ``checkpoint.async_save``.

    python benchmarks/async_checkpoint.py                          # 22M parameters, 2 CPU processes
    python benchmarks/async_checkpoint.py --devices 8 --dim 2048 --layers 16 --precision bf16-mixed

Trains the same model twice per repeat (alternating sync and async, so drift hits both alike),
saving a sharded checkpoint every ``--every`` steps, with a metrics row per step. A periodic save
runs right after its step's row is written, so its cost lands in the *next* step's
``step_time_s``: the table compares that "step after a save" with the median of the other steps
(both after ``--warmup`` steps: start-up and the first save, which also creates process groups),
and reports the run's wall time. Writes every measurement to ``--out``/async_checkpoint.json;
``--reanalyze FILE`` prints the table of a saved one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# The fsdp-train installed beside this interpreter (a virtual environment's), else the one on PATH.
FSDP_TRAIN = (
    str(Path(sys.executable).parent / "fsdp-train")
    if (Path(sys.executable).parent / "fsdp-train").exists()
    else "fsdp-train"
)


def run(args: argparse.Namespace, run_dir: Path, async_save: bool) -> dict:
    cmd = [
        FSDP_TRAIN,
        "strategy=fsdp2",
        f"devices={args.devices}",
        f"precision={args.precision}",
        f"model.dim={args.dim}",
        f"model.n_layers={args.layers}",
        "model.n_heads=8",
        f"trainer.max_steps={args.steps}",
        "trainer.log_every_n_steps=1",
        f"data.global_batch_size={args.batch}",
        f"data.seq_len={args.seq}",
        f"checkpoint.every_n_steps={args.every}",
        "checkpoint.save_last=false",
        f"checkpoint.async_save={'true' if async_save else 'false'}",
        f"hydra.run.dir={run_dir}",
    ]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"fsdp-train failed:\n{result.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    size = sum(f.stat().st_size for f in (run_dir / "checkpoints").rglob("*") if f.is_file())
    return {
        "async_save": async_save,
        "wall_time_s": summary["wall_time_s"],
        "parameters": summary["parameters"],
        "checkpoint_bytes_on_disk": size,
        "steps": [(r["step"], r["step_time_s"]) for r in rows],
    }


def measure(steps: list[tuple[int, float]], every: int, warmup: int) -> dict[str, float]:
    """Median time of ordinary steps and mean time of the steps right after a save, both after
    ``warmup`` steps (the first save also creates process groups and DCP's plan caches)."""
    after = [t for step, t in steps if (step - 1) % every == 0 and step - 1 > warmup]
    others = [t for step, t in steps if (step - 1) % every != 0 and step > warmup]
    return {"step_time_s": statistics.median(others), "step_after_save_s": statistics.mean(after)}


def report(runs: list[dict], args: argparse.Namespace) -> dict:
    table = {}
    for mode in (False, True):
        mine = [r | measure(r["steps"], args.every, args.warmup) for r in runs if r["async_save"] is mode]
        table["async" if mode else "sync"] = {
            key: statistics.median(r[key] for r in mine)
            for key in ("step_time_s", "step_after_save_s", "wall_time_s")
        }
    print(
        f"{runs[0]['parameters'] / 1e6:.1f}M parameters, devices={args.devices}, a save every {args.every} "
        f"steps ({runs[0]['checkpoint_bytes_on_disk'] / 2**20:,.0f} MiB of checkpoints kept), "
        f"median of {len(runs) // 2} runs each, steps after the first {args.warmup}"
    )
    print(f"  {'':6s} {'step time':>12s} {'step after a save':>18s} {'wall time':>10s}")
    for name, values in table.items():
        print(
            f"  {name:6s} {values['step_time_s'] * 1e3:9.1f} ms {values['step_after_save_s'] * 1e3:15.1f} ms"
            f" {values['wall_time_s']:8.1f} s"
        )
    return table


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=6, help="steps left out (start-up and the first save)")
    # Short steps, a large state: the save, not the step, is what is measured.
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmark_out"))
    parser.add_argument("--reanalyze", type=Path, help="print the table of a saved async_checkpoint.json")
    args = parser.parse_args()
    if args.reanalyze is not None:
        saved = json.loads(args.reanalyze.read_text())
        args.devices, args.every = saved["settings"]["devices"], saved["settings"]["every"]
        report(saved["runs"], args)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for async_save in (False, True):
                runs.append(run(args, Path(tmp) / f"run{i}_{int(async_save)}", async_save))
    table = report(runs, args)
    (args.out / "async_checkpoint.json").write_text(
        json.dumps({"settings": vars(args) | {"out": str(args.out)}, "runs": runs, "median": table}, indent=2)
    )


if __name__ == "__main__":
    main()
