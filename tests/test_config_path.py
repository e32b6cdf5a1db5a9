"""What the config-only paths import: ``fsdp-train --cfg job`` (as errors and ``--info`` do) composes
the config and prints it, and every module it imports is paid for by each such command. Counted,
not timed: the fsdp_cli modules against a table (tests/snapshots/cfg_job_imports.txt), the other
packages against the few that composing needs (Hydra and what it uses). A slip fails here
whatever the machine's speed (the time itself is benchmarks/config_paths.py's)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import cli_in_process, run

SNAPSHOT = Path(__file__).resolve().parent / "snapshots" / "cfg_job_imports.txt"
# Hydra composing (and the Hydra plugins installed beside it); nothing of torch's world.
PACKAGES = {"fsdp_cli", "hydra", "hydra_plugins", "omegaconf", "antlr4", "yaml", "attr", "packaging"}
# Standard-library modules that cost tens of milliseconds and that only an error's hint needs.
HEAVY_STDLIB = ("importlib.metadata", "email", "asyncio", "multiprocessing", "sqlite3")
PROBE = r"""
import contextlib, io, json, sys
before = set(sys.modules)
sys.argv = ["fsdp-train", "--cfg", "job"]
from fsdp_cli.cli.entry import main
with contextlib.redirect_stdout(io.StringIO()):
    try:
        main()
    except SystemExit:
        pass
print(json.dumps(sorted(set(sys.modules) - before)))
"""


def imported_by_cfg_job(tmp_path: Path) -> list[str]:
    result = run([sys.executable, "-c", PROBE], timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.distributed
def test_cfg_job_imports_only_what_composing_needs(tmp_path: Path) -> None:
    modules = imported_by_cfg_job(tmp_path)
    table = [line for line in SNAPSHOT.read_text().splitlines() if line and not line.startswith("#")]
    ours = [m for m in modules if m.split(".")[0] == "fsdp_cli"]
    added, gone = sorted(set(ours) - set(table)), sorted(set(table) - set(ours))
    assert not added, f"--cfg job now imports {added}: defer them, or add them to {SNAPSHOT.name} on purpose"
    assert not gone, f"--cfg job no longer imports {gone}: take them out of {SNAPSHOT.name}"
    others = {
        m.split(".")[0]
        for m in modules
        if m.split(".")[0] not in sys.stdlib_module_names and not m.startswith(("_cython", "cython_runtime"))
    }
    assert others <= PACKAGES, f"--cfg job imports {sorted(others - PACKAGES)}"
    heavy = sorted(m for m in modules if m.startswith(HEAVY_STDLIB))
    assert not heavy, f"--cfg job imports {heavy}"


def test_cfg_job_converts_only_the_schemas_it_composes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stored schema becomes a config when a composition loads it: 4 of the store's 15 for
    ``--cfg job``, not every one whenever Hydra copies its repository (it does, once per
    composition, since 1.3.8: some 40 ms of each config-only command)."""
    from fsdp_cli.compat import hydra_internals

    converted: list[str] = []
    convert = hydra_internals._Unconverted.__deepcopy__

    def counted(self: Any, memo: dict[int, Any]) -> Any:
        result = convert(self, memo)
        if result is not self:
            converted.append(self.schema.__name__)
        return result

    monkeypatch.setattr(hydra_internals._Unconverted, "__deepcopy__", counted)
    result = cli_in_process(["--cfg", "job"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert sorted(converted) == ["FSDP2Config", "LlamaConfig", "SyntheticDataConfig", "TrainConfig"]
