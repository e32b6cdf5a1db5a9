"""fsdp_cli as users install it, a wheel (``pip install .``) or editable from a checkout
(``pip install -e .``), runs from any directory: every command finds the configs shipped in the
package and the sweep launcher plugin (``hydra/launcher=fsdp_cli``, which train.yaml selects).

Each install goes into a throwaway virtual environment that sees this interpreter's packages
(``--system-site-packages``: nothing is downloaded, ``--no-index`` makes sure), from a copy of the
checkout (building leaves files behind)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from conftest import REPO, run

pytestmark = pytest.mark.distributed  # a virtual environment, pip, and the installed commands

IGNORED = shutil.ignore_patterns(
    ".git", "outputs", "multirun", "__pycache__", "build", "dist", "*.egg-info", ".*_cache", ".venv"
)
NO_CHECKOUT = {"PYTHONPATH": ""}


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    copy = tmp_path_factory.mktemp("source") / "fsdp_cli_checkout"
    shutil.copytree(REPO, copy, ignore=IGNORED, symlinks=True)  # configs/recipe is a link
    return copy


@pytest.mark.parametrize("kind", ["wheel", "editable"])
def test_an_installed_fsdp_cli_runs_from_any_directory(kind: str, source: Path, tmp_path: Path) -> None:
    venv, elsewhere = tmp_path / "venv", tmp_path / "elsewhere"
    elsewhere.mkdir()
    made = run(
        [sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)], timeout=120
    )
    assert made.returncode == 0, made
    target = ["-e", str(source)] if kind == "editable" else [str(source)]
    pip = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--quiet"]
    installed = run([*pip, "--no-index", "--no-build-isolation", *target], timeout=600, cwd=tmp_path)
    assert installed.returncode == 0, installed

    def command(*args: str) -> str:
        r = run([str(venv / "bin" / args[0]), *args[1:]], timeout=120, cwd=elsewhere, env=NO_CHECKOUT)
        assert r.returncode == 0, (args, r)
        return r.stdout

    where = command(
        "python",
        "-c",
        "import fsdp_cli, hydra_plugins.fsdp_cli_sweep as p; print(fsdp_cli.__file__, p.__file__)",
    )
    inside = source if kind == "editable" else venv
    assert all(Path(f).is_relative_to(inside) for f in where.split()), where
    plan = json.loads(command("fsdp-plan", "model=tiny", "--gpus", "2", "--json"))
    assert plan["strategy"] == "fsdp2" and len(plan["ranks"]) == 2
    launcher = command("fsdp-train", "--cfg", "hydra", "--package", "hydra.launcher")
    assert "_target_: hydra_plugins.fsdp_cli_sweep.launcher.SweepLauncher" in launcher, launcher
    assert "name: fsdp2" in command("fsdp-train", "--cfg", "job")
    assert " cpu_smoke " in command("fsdp-recipe", "ls")
    assert not list(elsewhere.iterdir()), "nothing written to the working directory"
