"""fsdp-train against hand-written loops (``hand_loop.py``), the same model and settings, interleaved.

    python benchmarks/compare_loop.py                              # the whole matrix, 2 CPU processes
    python benchmarks/compare_loop.py --record docs/benchmark.md   # ... and write the table there
    python benchmarks/compare_loop.py --models builtin --sizes small --strategies fsdp2 --log-every 1
    python benchmarks/compare_loop.py --quick                      # before stopping: 2 cells, ~2 minutes
    python benchmarks/compare_loop.py --quick --lightning          # ... with plain Lightning as a third side

The matrix: the built-in Llama (``model=tiny`` resized) and a plain ``nn.Module`` from this folder
(``benchmarks/gpt.py`` through ``model=custom``), at an overhead-bound size (dim 64, 2 blocks,
seq 128, batch 8) and a compute-bound one (dim 256, 4 blocks, seq 256, batch 8), under
``strategy=fsdp2``, ``fsdp`` and ``ddp``, with ``trainer.log_every_n_steps=1`` and ``10``.

Every cell is run as a pair, fsdp-train and the hand-written loop (plus plain Lightning with
``--lightning``; which side goes first rotates between repeats), and the pairs of all cells are
interleaved (cell 1, cell 2, ..., then the next repeat), so load drifting on the machine hits
every side alike. A pair's ratio is fsdp-train's median step time over the hand loop's (steps
after warm-up); its CPU ratio is the same for the CPU seconds per step of the ranks' processes
(``cpu_clock.py``: what a side does per step, which other load on the machine barely moves). A
cell reports the median ratios over its repeats and their spread (min-max). Writes
``benchmark.json`` (every measurement) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SIZES = {
    "small": {"dim": 64, "n_layers": 2, "seq": 128, "batch": 8, "steps": 200, "warmup": 20},
    "large": {"dim": 256, "n_layers": 4, "seq": 256, "batch": 8, "steps": 60, "warmup": 20},
}
QUICK_STEPS = 100  # --quick: 80 steps measured after the warm-up
N_HEADS, N_KV_HEADS, VOCAB = 4, 2, 256
MARK_BEGIN, MARK_END = "<!-- compare_loop:begin -->", "<!-- compare_loop:end -->"
# On CPUs, glibc's malloc hands the step's large buffers back to the kernel when they are freed
# and faults them in again at the next step: 10 to 600 page faults per step, a different number
# in every process (it depends on the allocation history), which moved a side's step time by 20%
# from one run to the next. With these thresholds raised the heap keeps them (3-5 faults per
# step), on every side alike (``--default-malloc``: as the machine has it).
CPU_MALLOC = "glibc.malloc.mmap_threshold=268435456:glibc.malloc.trim_threshold=536870912"


def side_env(args: argparse.Namespace) -> dict[str, str]:
    """The environment every side runs in."""
    env = dict(os.environ)
    if not getattr(args, "default_malloc", True) and "GLIBC_TUNABLES" not in env and not _has_cuda():
        env["GLIBC_TUNABLES"] = CPU_MALLOC
    return env


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@dataclass(frozen=True)
class Cell:
    model: str  # builtin | custom
    size: str
    strategy: str
    log_every: int

    @property
    def name(self) -> str:
        return f"{self.model}/{self.size}/{self.strategy}/log{self.log_every}"


def fsdp_train_command(
    cell: Cell, args: argparse.Namespace, run_dir: Path, extra: tuple[str, ...] = ()
) -> list[str]:
    """The fsdp-train command of a cell; ``extra``: more overrides (``compare_pipeline.py``'s pp)."""
    size = SIZES[cell.size]
    if cell.model == "builtin":
        model = [
            "model=tiny",
            f"model.dim={size['dim']}",
            f"model.n_layers={size['n_layers']}",
            f"model.n_heads={N_HEADS}",
            f"model.n_kv_heads={N_KV_HEADS}",
        ]
    else:
        model = [
            "model=custom",
            "model._target_=benchmarks.gpt.GPT",
            f"+model.dim={size['dim']}",
            f"+model.n_layers={size['n_layers']}",
            f"+model.n_heads={N_HEADS}",
            f"+model.max_seq_len={size['seq']}",
            f"+model.vocab_size={VOCAB}",
        ]
    fsdp_train = Path(sys.executable).parent / "fsdp-train"
    return [
        str(fsdp_train) if fsdp_train.exists() else "fsdp-train",
        f"strategy={cell.strategy}",
        *model,
        f"devices={args.devices}",
        f"precision={args.precision}",
        f"trainer.max_steps={size['steps']}",
        f"trainer.log_every_n_steps={cell.log_every}",
        f"data.global_batch_size={size['batch']}",
        f"data.seq_len={size['seq']}",
        "checkpoint.save_last=false",
        "optim.lr=3e-4",
        *extra,
        f"hydra.run.dir={run_dir}",
    ]


def run_fsdp_train(cell: Cell, args: argparse.Namespace, run_dir: Path, extra: tuple[str, ...] = ()) -> dict:
    cpu_clock = run_dir.with_name(run_dir.name + ".cpu.json")
    clock = (  # CPU seconds per step (cpu_clock.py), through the callbacks group as a user's callback
        "+callbacks.cpu_clock._target_=benchmarks.lightning_loop.CpuClock",
        f"+callbacks.cpu_clock.warmup={SIZES[cell.size]['warmup']}",
        f"+callbacks.cpu_clock.out={cpu_clock}",
    )
    parts = run_dir.with_name(run_dir.name + ".parts.json")
    if getattr(args, "parts", False):  # the step split into model work and the rest (step_parts.py)
        size = SIZES[cell.size]
        clock += (
            "+callbacks.step_parts._target_=benchmarks.lightning_loop.StepParts",
            f"+callbacks.step_parts.start={size['warmup']}",
            f"+callbacks.step_parts.stop={size['steps'] - 1}",
            f"+callbacks.step_parts.out={parts}",
        )
    command = fsdp_train_command(cell, args, run_dir, (*extra, *clock))
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=side_env(args))
    if result.returncode != 0:
        raise SystemExit(f"fsdp-train failed ({cell.name}):\n{result.stderr[-3000:]}")
    warmup = SIZES[cell.size]["warmup"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    samples = [r["step_time_s"] for r in rows if r["step"] > warmup]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "step_time_s": statistics.median(samples),
        "samples": len(samples),
        "peak_memory_bytes": max(summary["peak_memory_bytes"]),
        "precision": summary["precision"],
        "mfu": summary.get("mfu"),
        **json.loads(cpu_clock.read_text()),
        **({"parts": json.loads(parts.read_text())} if parts.exists() else {}),
    }


def run_hand_loop(
    cell: Cell,
    args: argparse.Namespace,
    out: Path,
    precision: str,
    script: str = "hand_loop.py",
    **more: object,
) -> dict:
    """``script``: ``hand_loop.py`` (plain PyTorch) or ``lightning_loop.py`` (plain Lightning);
    ``more``: further ``KEY=VALUE`` options of the script (``cp=2``)."""
    size = SIZES[cell.size]
    env = side_env(args)
    # fsdp-train's launcher gives each CPU rank its share of the cores; so does this side.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // args.devices)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={args.devices}",
        str(HERE / script),
        str(out),
        f"model={'llama' if cell.model == 'builtin' else 'gpt'}",
        f"strategy={cell.strategy}",
        f"dim={size['dim']}",
        f"n_layers={size['n_layers']}",
        f"n_heads={N_HEADS}",
        f"n_kv_heads={N_KV_HEADS}",
        f"seq_len={size['seq']}",
        f"global_batch_size={size['batch']}",
        f"steps={size['steps']}",
        f"warmup={size['warmup']}",
        f"log_every={cell.log_every}",
        f"precision={precision}",
        *([f"parts={out.with_suffix('.parts.json')}"] if getattr(args, "parts", False) else []),
        *(f"{key}={value}" for key, value in more.items()),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    if result.returncode != 0 and not out.is_file():
        raise SystemExit(f"hand-written loop failed ({cell.name}):\n{result.stderr[-3000:]}")
    if result.returncode != 0:  # rank 0 wrote its measurement; a rank failed while exiting
        print(
            f"note: the hand-written loop exited {result.returncode} after measuring ({cell.name}):"
            f" {_last_error(result.stderr)}",
            flush=True,
        )
    measured = json.loads(out.read_text())
    if getattr(args, "parts", False):
        measured["parts"] = json.loads(out.with_suffix(".parts.json").read_text())
    return measured


def _last_error(stderr: str) -> str:
    """What a rank said as it failed: the first line of ``stderr`` naming an error that is not
    torchrun's own report of the failed rank (else stderr's last line)."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    said = [
        line
        for line in lines
        if re.search(r"Error|Exception|terminate called|Signal|Abort", line)
        and "torch/distributed/elastic" not in line
        and "ChildFailedError" not in line
        and not line.startswith(("File ", "raise ", "Traceback"))
    ]
    return said[0] if said else (lines[-1] if lines else "(no output)")


def run_lightning_loop(cell: Cell, args: argparse.Namespace, stem: Path, precision: str) -> dict:
    """``--lightning``: the cell written as a plain LightningModule and Trainer
    (``lightning_loop.py``); nothing for ``fsdp`` (Lightning's FSDPStrategy refuses CPUs) or without the flag."""
    import torch

    if not args.lightning or (cell.strategy == "fsdp" and not torch.cuda.is_available()):
        return {}
    measured = run_hand_loop(cell, args, stem.with_suffix(".lightning.json"), precision, "lightning_loop.py")
    return {
        "lightning_s": measured["step_time_s"],
        "lightning_cpu_s": measured["cpu_step_s"],
        **({"lightning_parts": measured["parts"]} if "parts" in measured else {}),
    }


def measure(cells: list[Cell], args: argparse.Namespace, tmp: Path) -> dict[str, list[dict]]:
    pairs: dict[str, list[dict]] = {c.name: [] for c in cells}
    for repeat in range(args.repeats):
        for cell in cells:
            started = time.time()
            stem = tmp / f"{cell.name.replace('/', '_')}_{repeat}"
            pair = measure_sides(cell, args, stem, repeat, pairs[cell.name])
            pairs[cell.name].append(pair)
            print(
                f"[{repeat + 1}/{args.repeats}] {cell.name:28s} fsdp-train {pair['fsdp_train_s'] * 1e3:8.2f} ms  "
                f"hand {pair['hand_s'] * 1e3:8.2f} ms  ratio {pair['ratio']:.3f}  CPU ratio {pair['cpu_ratio']:.3f}  "
                + (
                    f"lightning {pair['lightning_s'] * 1e3:8.2f} ms, CPU ratio to it {pair['cpu_ratio_lightning']:.3f}  "
                    if "lightning_s" in pair
                    else ""
                )
                + f"(load {pair['load_avg']:.1f}, {time.time() - started:.0f} s)",
                flush=True,
            )
    return pairs


def measure_sides(cell: Cell, args: argparse.Namespace, stem: Path, repeat: int, earlier: list[dict]) -> dict:
    """One repeat of a cell: fsdp-train, the hand loop and (``--lightning``) plain Lightning, in an
    order that rotates between repeats, so that a machine slowing down (or speeding up) during a
    repeat favours no side over the run. The other sides take the precision fsdp-train resolved
    (known from the first repeat, where fsdp-train goes first)."""
    names = ["ours", "hand", "lightning"] if args.lightning else ["ours", "hand"]
    order = names[repeat % len(names) :] + names[: repeat % len(names)]
    done: dict[str, dict] = {}
    for side in order:
        precision = earlier[0]["precision"] if earlier else None
        if side == "ours":
            done[side] = run_fsdp_train(cell, args, stem)
        elif side == "hand":
            done[side] = run_hand_loop(
                cell, args, stem.with_suffix(".json"), precision or done["ours"]["precision"]
            )
        else:
            done[side] = run_lightning_loop(cell, args, stem, precision or done["ours"]["precision"])
    ours, hand = done["ours"], done["hand"]
    pair = {
        **done.get("lightning", {}),
        "fsdp_train_s": ours["step_time_s"],
        "hand_s": hand["step_time_s"],
        "ratio": ours["step_time_s"] / hand["step_time_s"],
        "fsdp_train_cpu_s": ours["cpu_step_s"],
        "hand_cpu_s": hand["cpu_step_s"],
        "cpu_ratio": ours["cpu_step_s"] / hand["cpu_step_s"],
        "precision": ours["precision"],
        "mfu": ours["mfu"],
        "load_avg": os.getloadavg()[0],
    }
    if "lightning_cpu_s" in pair:
        pair["cpu_ratio_lightning"] = ours["cpu_step_s"] / pair["lightning_cpu_s"]
    if "parts" in ours:
        pair.update(fsdp_train_parts=ours["parts"], hand_parts=hand["parts"])
        # The hand loop's step plus the difference in framework time (step_parts.py): what the
        # ratio would be if the model's work took the same time on both sides.
        extra = ours["parts"]["framework_ms"] - hand["parts"]["framework_ms"]
        pair["parts_ratio"] = 1 + extra / hand["parts"]["step_ms"]
        if "lightning_parts" in pair:  # the same for plain Lightning: the floor its loop sets
            extra = pair["lightning_parts"]["framework_ms"] - hand["parts"]["framework_ms"]
            pair["lightning_parts_ratio"] = 1 + extra / hand["parts"]["step_ms"]
    return pair


def table(cells: list[Cell], pairs: dict[str, list[dict]]) -> str:
    """One row per cell: medians over its repeats (and the spread of the ratios); the plain-Lightning
    and framework-time columns where those were measured."""
    measured = [p for runs in pairs.values() for p in runs]
    columns = [
        ("fsdp-train ms/step", lambda runs: _median(runs, lambda p: p["fsdp_train_s"] * 1e3, "{:.2f}")),
        ("hand-written ms/step", lambda runs: _median(runs, lambda p: p["hand_s"] * 1e3, "{:.2f}")),
        ("ratio (median)", lambda runs: _median(runs, lambda p: p["ratio"])),
        ("spread", lambda runs: _spread(runs, "ratio")),
        ("CPU ratio (median)", lambda runs: _median(runs, lambda p: p["cpu_ratio"])),
        ("CPU spread", lambda runs: _spread(runs, "cpu_ratio")),
    ]
    if any("lightning_s" in p for p in measured):
        columns += [
            (
                "plain Lightning ms/step",
                lambda runs: _median(runs, lambda p: p["lightning_s"] * 1e3, "{:.2f}"),
            ),
            (
                "fsdp-train / Lightning",
                lambda runs: _median(runs, lambda p: p["fsdp_train_s"] / p["lightning_s"]),
            ),
            ("CPU: fsdp-train / Lightning", lambda runs: _median(runs, lambda p: p["cpu_ratio_lightning"])),
        ]
    if any("parts_ratio" in p for p in measured):

        def framework(side: str) -> Any:
            return lambda runs: _median(runs, lambda p: p[side]["framework_ms"], "{:.2f}", needs=side)

        columns += [("framework ms/step: fsdp-train", framework("fsdp_train_parts"))]
        columns += [("hand-written", framework("hand_parts"))]
        if any("lightning_parts" in p for p in measured):
            columns += [("plain Lightning", framework("lightning_parts"))]
        columns += [
            ("ratio from framework time (median)", lambda runs: _median(runs, lambda p: p["parts_ratio"])),
            ("its spread", lambda runs: _spread(runs, "parts_ratio")),
        ]
        if any("lightning_parts_ratio" in p for p in measured):
            columns += [
                (
                    "plain Lightning's ratio from framework time",
                    lambda runs: _median(
                        runs, lambda p: p["lightning_parts_ratio"], needs="lightning_parts_ratio"
                    ),
                )
            ]
    lines = [
        "| model | size | strategy | log every | " + " | ".join(name for name, _ in columns) + " |",
        "|---|---|---|---|" + "---|" * len(columns),
    ]
    for cell in cells:
        runs = pairs[cell.name]
        cells_text = " | ".join(value(runs) for _, value in columns)
        lines.append(f"| {cell.model} | {cell.size} | {cell.strategy} | {cell.log_every} | {cells_text} |")
    return "\n".join(lines)


def _median(runs: list[dict], value: Any, form: str = "{:.3f}", needs: str | None = None) -> str:
    """The median of ``value(pair)`` over the pairs that measured it (``-`` where none did: plain
    Lightning does not run FSDP1 on CPUs)."""
    values = [value(p) for p in runs if needs is None or needs in p]
    try:
        return form.format(statistics.median(values)) if values else "-"
    except KeyError:
        return "-"


def _spread(runs: list[dict], key: str) -> str:
    values = [p[key] for p in runs if key in p]
    return f"{min(values):.3f}-{max(values):.3f}" if values else "-"


def commit() -> str:
    """The checkout's commit (with ``+changes`` when the work tree differs from it)."""
    git = ["git", "-C", str(REPO)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(
        [*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
    )
    return (
        head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")
        if head.returncode == 0
        else "unknown"
    )


def record(
    path: Path, command: str, text: str, settings: str, marks: tuple[str, str] = (MARK_BEGIN, MARK_END)
) -> None:
    """Replace the block between the markers in ``path`` with this run's table."""
    doc = path.read_text()
    mark_begin, mark_end = marks
    begin, end = doc.index(mark_begin), doc.index(mark_end)
    block = f"{mark_begin}\n`{command}` ({settings}):\n\n{text}\n{mark_end}"
    path.write_text(doc[:begin] + block + doc[end + len(mark_end) :])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="builtin,custom")
    parser.add_argument("--sizes", default="small,large")
    parser.add_argument("--strategies", default="fsdp2,fsdp,ddp")
    parser.add_argument("--log-every", default="1,10")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmark_out"))
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the overhead-bound FSDP2 cells only (both models, logging every step), 2 repeats of "
        f"{QUICK_STEPS} steps: about two minutes, for a developer to run before stopping",
    )
    parser.add_argument(
        "--lightning",
        action="store_true",
        help="also run each cell as a plain LightningModule and Trainer (lightning_loop.py): "
        "separates Lightning's own per-step cost from fsdp-train's (not fsdp on CPUs: Lightning's FSDPStrategy needs GPUs)",
    )
    parser.add_argument(
        "--parts",
        action="store_true",
        help="split every side's step into the model's work and the framework's, inside each run "
        "(step_parts.py), and report the ratio the framework times imply: what the machine's speed "
        "changing between runs does not move",
    )
    parser.add_argument(
        "--default-malloc",
        action="store_true",
        help="leave glibc's malloc thresholds as they are (by default every side runs with CPU_MALLOC "
        "on CPUs: without it, page faults move each run's step time by up to 20%%)",
    )
    parser.add_argument("--record", type=Path, default=None, help="write the table into this markdown file")
    args = parser.parse_args()
    if args.quick:
        args.models, args.sizes, args.strategies, args.log_every, args.repeats = (
            "custom,builtin",
            "small",
            "fsdp2",
            "1",
            2,
        )
        SIZES["small"] = {**SIZES["small"], "steps": QUICK_STEPS}
    cells = [
        Cell(model, size, strategy, int(log))
        for model in args.models.split(",")
        for size in args.sizes.split(",")
        for strategy in args.strategies.split(",")
        for log in args.log_every.split(",")
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    measured = commit()  # the code measured is the checkout's at the start
    with tempfile.TemporaryDirectory() as tmp:
        pairs = measure(cells, args, Path(tmp))
    text = table(cells, pairs)
    command = "python " + " ".join(
        [
            str(Path(sys.argv[0]).relative_to(REPO) if Path(sys.argv[0]).is_absolute() else sys.argv[0]),
            *sys.argv[1:],
        ]
    )
    (args.out / "benchmark.json").write_text(
        json.dumps({"command": command, "settings": vars(args), "pairs": pairs}, indent=2, default=str)
    )
    print(text)
    if args.record is not None:
        precision = next(iter(pairs.values()))[0]["precision"]
        settings = (
            f"{args.devices} processes, {precision}, {args.repeats} interleaved repeats, {os.cpu_count()} cores, "
            f"{'default malloc' if args.default_malloc or _has_cuda() else 'CPU_MALLOC'}, "
            f"load average {min(p['load_avg'] for c in pairs.values() for p in c):.1f}-"
            f"{max(p['load_avg'] for c in pairs.values() for p in c):.1f}; "
            f"{time.strftime('%Y-%m-%d', time.gmtime())}, commit {measured}"
        )
        record(args.record, command, text, settings)


if __name__ == "__main__":
    main()
