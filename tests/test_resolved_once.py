"""The resolved run is built once per process and then passed: a test of the source, so that a new
``ResolvedRun.of(...)`` or a ``TrainConfig | ResolvedRun`` signature is added on purpose."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "fsdp_cli"
BUILDERS_OF_RUNS = {
    "config/validate.py": "checked_run: the parent's one run (resolve.py), fsdp-plan's and each --search candidate's",
    "worker/rank.py": "each rank's one run, from the config.yaml the parent wrote",
    "sweep/job.py": "the summary columns of a job that was skipped before it resolved",
}


def _trees() -> dict[str, ast.AST]:
    return {str(p.relative_to(PACKAGE)): ast.parse(p.read_text()) for p in PACKAGE.rglob("*.py")}


def test_resolved_run_is_built_only_where_a_run_begins() -> None:
    built = {
        name
        for name, tree in _trees().items()
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "ResolvedRun.of"
    }
    assert built == set(BUILDERS_OF_RUNS), "pass the ResolvedRun along instead of building another"


def test_no_signature_takes_a_config_or_a_run() -> None:
    either = [
        f"{name}:{node.lineno}"
        for name, tree in _trees().items()
        for node in ast.walk(tree)
        if isinstance(node, ast.arg) and node.annotation is not None
        for text in [ast.unparse(node.annotation)]
        if "TrainConfig" in text and "ResolvedRun" in text
    ]
    assert either == [], "take the ResolvedRun (derived values are read only from it)"
