"""The ``fsdp-train`` console script: answers ``--help`` before importing Hydra, else runs
:func:`fsdp_cli.cli.main.main`."""

from __future__ import annotations

import sys

from fsdp_cli.cli.configs import config_path
from fsdp_cli.cli.console import quiet_on_closed_pipe


@quiet_on_closed_pipe
def main() -> None:
    if any(arg in ("--help", "-h") for arg in sys.argv[1:]):
        from fsdp_cli.cli.help import help_text

        print(help_text(config_path()) + "\n")
        return
    from fsdp_cli.cli.main import main as train

    train()


if __name__ == "__main__":
    main()
