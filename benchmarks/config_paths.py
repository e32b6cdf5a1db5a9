"""Wall time of fsdp-train's config-only paths against a bare two-file Hydra app doing the same.

    python benchmarks/config_paths.py [--repeats 15] [--record docs/benchmark.md]

Pairs, interleaved: ``--help``; ``--cfg job``; a validation error (``tp=3 devices=4`` against an
``trainer.max_steps=0`` for the bare app: both compose, check, print one line, exit 2). Prints median times and ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BARE = [sys.executable, str(HERE / "bare_hydra" / "app.py")]
FSDP_TRAIN = [str(Path(sys.executable).parent / "fsdp-train")]


def cases(tmp: str) -> dict[str, tuple[list[str], list[str]]]:
    return {
        "--help": ([*FSDP_TRAIN, "--help"], [*BARE, "--help"]),
        "--cfg job": ([*FSDP_TRAIN, "--cfg", "job"], [*BARE, "--cfg", "job"]),
        "validation error": (
            [*FSDP_TRAIN, "tp=3", "devices=4", f"hydra.run.dir={tmp}/err"],
            [*BARE, "trainer.max_steps=0", f"hydra.run.dir={tmp}/bare"],
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--record", type=Path, default=None)
    args = parser.parse_args()
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    with tempfile.TemporaryDirectory() as tmp:
        pairs = cases(tmp)
        times: dict[str, list[list[float]]] = {k: [[], []] for k in pairs}
        for _ in range(args.repeats):
            for name, commands in pairs.items():
                for side, cmd in enumerate(commands):
                    start = time.perf_counter()
                    subprocess.run(cmd, capture_output=True, env=env, cwd=tmp)
                    times[name][side].append(time.perf_counter() - start)
    lines = ["| path | fsdp-train ms | bare Hydra app ms | ratio |", "|---|---|---|---|"]
    for name, (ours, bare) in times.items():
        a, b = statistics.median(ours), statistics.median(bare)
        lines.append(f"| {name} | {a * 1e3:.0f} | {b * 1e3:.0f} | {a / b:.2f} |")
    text = "\n".join(lines)
    print(text)
    if args.record is not None:
        doc = args.record.read_text()
        begin, end = "<!-- config_paths:begin -->", "<!-- config_paths:end -->"
        i, j = doc.index(begin), doc.index(end)
        note = f"`python benchmarks/config_paths.py --repeats {args.repeats}` (load average {os.getloadavg()[0]:.1f} at the end):\n\n"
        args.record.write_text(doc[:i] + begin + "\n" + note + text + "\n" + doc[j:])


if __name__ == "__main__":
    main()
