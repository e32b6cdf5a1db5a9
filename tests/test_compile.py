"""``strategy.compile=true`` compiled for real on CPU (inductor and the C++ compiler) under FSDP2's
HSDP and FSDP2 x tensor parallel: every transformer block runs one compiled graph, compiled during the
first step and never again (no graph breaks, no recompiles: torch._dynamo's counters read inside
each rank by tests/assets/live_probe.py), and the losses are eager's to 1e-5 relative.

The eager references are the shared parity runs (conftest ``layout_run``): of the same layout, or
of one process for HSDP 2x2.
The compiled tensor-parallel run starts from the eager dp=2 run's step-3 checkpoint (compile
across a resume at another layout): its steps 4-6 are eager's.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import LAYOUTS, PARITY, assert_ok, losses, run_cli

from tests.assets.live_probe import probe_env, read_probe

pytestmark = pytest.mark.distributed

BLOCKS = 4  # the tiny model's layers


COMPILED = {
    # HSDP 2x2 on 4 ranks, against the one-process run (the same optimisation at every layout).
    "hsdp": (["strategy=fsdp2", "devices=4", "strategy.replicate_size=2"], "single"),
    "fsdp2_tp2": (LAYOUTS["fsdp2_tp2"], "fsdp2_tp2"),
}
"""Each compiled layout: its overrides and the shared eager run it is compared with."""
RESUMED_FROM = {"fsdp2_tp2": "fsdp2"}
"""A compiled layout that starts from the step-3 checkpoint of another layout's eager run."""


@pytest.fixture(scope="module")
def compiled_run(
    tmp_path_factory: pytest.TempPathFactory, layout_run: Any
) -> Callable[[str], tuple[Path, dict[str, Any]]]:
    """``compiled_run(layout)`` -> (probe root, summary) of ``COMPILED[layout]`` with compile on."""
    root = tmp_path_factory.mktemp("compile")
    done: dict[str, tuple[Path, dict[str, Any]]] = {}

    def get(layout: str) -> tuple[Path, dict[str, Any]]:
        if layout not in done:
            where = root / layout
            run_dir = where / "run"
            args = [*COMPILED[layout][0], *PARITY, "strategy.compile=true"]
            if layout in RESUMED_FROM:
                saved = layout_run(RESUMED_FROM[layout]) / "checkpoints" / "step_00000003"
                args.append(f"resume={saved}")
            done[layout] = (where, assert_ok(run_cli(args, run_dir, env=probe_env(where)), run_dir))
        return done[layout]

    return get


@pytest.mark.parametrize("layout", list(COMPILED))
def test_blocks_compile_once_and_train_like_eager(layout_run: Any, compiled_run: Any, layout: str) -> None:
    root, summary = compiled_run(layout)
    assert summary["setup"]["compiled_blocks"] == BLOCKS
    for rank in (0, 1):
        dynamo = read_probe(root, rank)["dynamo"]
        first, end = dynamo["after_first_step"], dynamo["at_end"]
        assert first["graph_breaks"] == 0, first["graph_break_reasons"]
        # The blocks share their code: one graph serves all of them (under tensor parallel the
        # first block used to get a graph of its own, for its in-flight all-reduce input).
        assert first["unique_graphs"] == 1, dynamo
        assert end == first, dynamo  # nothing compiled after the first step: no recompiles
    eager, compiled = losses(layout_run(COMPILED[layout][1])), losses(root / "run")
    if layout in RESUMED_FROM:
        eager = eager[3:]  # (steps 4-6: the same optimisation in every layout)
    assert len(compiled) == len(eager) >= 3
    worst = max(abs(a - b) / b for a, b in zip(compiled, eager))
    assert worst <= 1e-5, (worst, compiled, eager)
