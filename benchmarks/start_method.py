"""How the ranks are started (``launcher.start_method``) against what they then do per step.

    python benchmarks/start_method.py                                   # custom/small/fsdp2, 3 rounds
    python benchmarks/start_method.py --model builtin --strategy ddp --rounds 3

Runs one cell of ``compare_loop.py`` (the same fsdp-train command, 2 CPU ranks, logging every
step, ``CPU_MALLOC``) once per start method per round, the order rotating between rounds, with
``step_parts.py``'s split of each step. Wall times move by 10-30% between runs on a shared
machine; the ratios of one run's own phases do not: a start method whose ranks run the model's
Python and small ops slower shows a larger forward (and step) per millisecond of backward, which
is mostly C++ autograd. Prints, per start method, each round's forward / backward and step /
backward, and their medians.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import compare_loop

METHODS = ("forkserver", "fork", "subprocess")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="custom", choices=("custom", "builtin"))
    parser.add_argument("--strategy", default="fsdp2")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=120)
    args = parser.parse_args()
    compare_loop.SIZES["small"] = {**compare_loop.SIZES["small"], "steps": args.steps}
    run_args = argparse.Namespace(devices=2, precision="32-true", parts=True, default_malloc=False)
    cell = compare_loop.Cell(args.model, "small", args.strategy, 1)
    methods = args.methods.split(",")
    parts: dict[str, list[dict]] = {m: [] for m in methods}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for method in methods[r % len(methods) :] + methods[: r % len(methods)]:
                run_dir = Path(tmp) / f"{method}{r}"
                extra = (f"launcher.start_method={method}",)
                measured = compare_loop.run_fsdp_train(cell, run_args, run_dir, extra)["parts"]
                parts[method].append(measured)
                phase = measured["parts_ms"]
                print(
                    f"round {r} {method:<10} step {measured['step_ms']:6.2f} ms  forward {phase['forward_loss']:6.2f}"
                    f"  backward {phase['backward']:6.2f}  optimizer {phase['optimizer']:5.2f}"
                    f"  framework {measured['framework_ms']:5.2f}",
                    flush=True,
                )
    print(f"{cell.name}, {args.rounds} rounds: per round, then the median")
    for method, runs in parts.items():
        fwd = [p["parts_ms"]["forward_loss"] / p["parts_ms"]["backward"] for p in runs]
        step = [p["step_ms"] / p["parts_ms"]["backward"] for p in runs]
        print(
            f"  {method:<10} forward/backward {' '.join(f'{v:.3f}' for v in fwd)} ({statistics.median(fwd):.3f})"
            f"   step/backward {' '.join(f'{v:.3f}' for v in step)} ({statistics.median(step):.3f})"
        )


if __name__ == "__main__":
    main()
