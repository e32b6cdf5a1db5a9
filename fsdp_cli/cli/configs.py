"""Where the config files are (inside the package, or the checkout's ``configs/`` folder), and
making sure Hydra finds the sweep launcher they select."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def config_path() -> str:
    """The configs shipped inside the package; from a source tree (``python -m fsdp_cli.cli.main``
    run in a checkout whose package is installed elsewhere) the top-level ``configs/`` folder."""
    if importlib.util.find_spec("fsdp_cli.configs") is not None:
        return "pkg://fsdp_cli.configs"
    return str(Path(__file__).resolve().parents[2] / "configs")


def register_sweep_launcher() -> None:
    """Make ``hydra/launcher=fsdp_cli`` available however the package was installed.

    Hydra finds the plugin by scanning the ``hydra_plugins`` namespace package. Some editable
    installs (setuptools' import-hook mode) serve it to ``import`` but not to that scan; then it
    is registered here explicitly, through Hydra's documented ``Plugins.register``."""
    from hydra.core.plugins import Plugins
    from hydra.plugins.launcher import Launcher

    plugins = Plugins.instance()  # scans
    name = "hydra_plugins.fsdp_cli_sweep.launcher.SweepLauncher"
    if not any(f"{c.__module__}.{c.__name__}" == name for c in plugins.discover(Launcher)):
        from hydra_plugins.fsdp_cli_sweep.launcher import SweepLauncher

        plugins.register(SweepLauncher)
