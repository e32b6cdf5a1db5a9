"""Where the config files are: inside the package, or the checkout's ``configs/`` folder."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def config_path() -> str:
    """The configs shipped inside the package; from a source tree (``python -m fsdp_cli.cli.main``
    run in a checkout whose package is installed elsewhere) the top-level ``configs/`` folder."""
    if importlib.util.find_spec("fsdp_cli.configs") is not None:
        return "pkg://fsdp_cli.configs"
    return str(Path(__file__).resolve().parents[2] / "configs")
