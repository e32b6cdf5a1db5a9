"""The ``fsdp-train`` console script: answers ``--help`` before importing Hydra, else runs
:func:`fsdp_cli.cli.main.main`."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def config_path() -> str:
    """The configs shipped inside the package; from a source tree (``python -m fsdp_cli.cli.main``
    run in a checkout whose package is installed elsewhere) the top-level ``configs/`` folder."""
    if importlib.util.find_spec("fsdp_cli.configs") is not None:
        return "pkg://fsdp_cli.configs"
    return str(Path(__file__).resolve().parents[2] / "configs")


def main() -> None:
    if any(arg in ("--help", "-h") for arg in sys.argv[1:]):
        from fsdp_cli.cli.help import help_text

        print(help_text(config_path()) + "\n")
        return
    from fsdp_cli.cli.main import main as train

    train()


if __name__ == "__main__":
    main()
