"""fsdp_cli as users install it, a wheel (``pip install .``) or editable from a checkout
(``pip install -e .``), runs from any directory: every command finds the configs shipped in the
package and the sweep launcher plugin (``hydra/launcher=fsdp_cli``, which train.yaml selects).

Each install goes into a throwaway virtual environment that sees this interpreter's packages
except fsdp_cli itself (nothing is downloaded, ``--no-index`` makes sure), from a copy of the
checkout (building leaves files behind). CI installs fsdp_cli into the interpreter that runs these
tests: seen through ``--system-site-packages``, that copy would be imported before an editable
install's (setuptools' finder comes after the path's), so the environment sees a view of the
interpreter's site directories without it."""

from __future__ import annotations

import json
import shutil
import site
import sys
from pathlib import Path

import pytest
from conftest import REPO, run

pytestmark = pytest.mark.distributed  # a virtual environment, pip, and the installed commands

IGNORED = shutil.ignore_patterns(
    ".git", "outputs", "multirun", "__pycache__", "build", "dist", "*.egg-info", ".*_cache", ".venv"
)
NO_CHECKOUT = {"PYTHONPATH": ""}


def _is_fsdp_cli(name: str) -> bool:
    return name.startswith(("fsdp_cli", "fsdp-cli")) or (
        name.startswith("__editable__") and "fsdp_cli" in name
    )


def packages_without_fsdp_cli(venv: Path, views: Path) -> None:
    """Make ``venv`` see the base interpreter's site directories (what ``--system-site-packages``
    shows), in their order, less fsdp_cli's package, metadata, editable hooks and sweep plugin
    (each directory a view of links)."""
    lines = []
    base = [Path(d) for d in site.getsitepackages() if Path(d).is_relative_to(sys.base_prefix)]
    for index, directory in enumerate(d for d in base if d.is_dir()):
        view = views / str(index)
        view.mkdir(parents=True)
        for entry in directory.iterdir():
            if _is_fsdp_cli(entry.name):
                continue
            if entry.name == "hydra_plugins":  # a namespace package shared with other plugins
                (view / entry.name).mkdir()
                for plugin in entry.iterdir():
                    if plugin.name != "fsdp_cli_sweep":
                        (view / entry.name / plugin.name).symlink_to(plugin)
            else:
                (view / entry.name).symlink_to(entry)
        lines.append(f"import site; site.addsitedir({str(view)!r})")
    (purelib,) = venv.glob("lib/python*/site-packages")
    (purelib / "outer_packages.pth").write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    copy = tmp_path_factory.mktemp("source") / "fsdp_cli_checkout"
    shutil.copytree(REPO, copy, ignore=IGNORED, symlinks=True)  # configs/recipe is a link
    return copy


@pytest.mark.parametrize("kind", ["wheel", "editable"])
def test_an_installed_fsdp_cli_runs_from_any_directory(kind: str, source: Path, tmp_path: Path) -> None:
    venv, elsewhere = tmp_path / "venv", tmp_path / "elsewhere"
    elsewhere.mkdir()
    made = run([sys.executable, "-m", "venv", "--without-pip", str(venv)], timeout=120)
    assert made.returncode == 0, made
    packages_without_fsdp_cli(venv, tmp_path / "outer")
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
