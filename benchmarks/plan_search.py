"""Wall time of ``fsdp-plan --search`` for llama_8b on 8 x 80 GB, process start included (the
figure docs/memory.md quotes; tests assert what the search answers, not how fast).

    python benchmarks/plan_search.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

FSDP_PLAN = [str(Path(sys.executable).parent / "fsdp-plan")]
SEARCH = [
    "recipe=llama_8b_hsdp",
    "num_nodes=1",
    "--gpus",
    "8",
    "--device-memory",
    "80GB",
    "--search",
    "--json",
]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    times = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        subprocess.run([*FSDP_PLAN, *SEARCH], check=True, capture_output=True, timeout=120)
        times.append(time.perf_counter() - started)
    print(
        f"fsdp-plan --search, llama_8b on 8 x 80 GB: median {statistics.median(times):.2f} s of {args.repeats}"
    )


if __name__ == "__main__":
    main()
