"""``hydra/launcher=fsdp_cli``: validate every job of a sweep first, then run the valid ones.

Hydra instantiates launchers only from modules under ``hydra_plugins``, so the class lives here;
its behaviour is :class:`fsdp_cli.sweep.launcher.SweepLauncherBase`.
"""

# No `from __future__ import annotations`: Hydra's plugin scan runs this module before it is in
# sys.modules, where string annotations on a dataclass break every Hydra app in the environment.
from fsdp_cli.sweep import (
    launcher as sweep_launcher,  # the module, not the class: the scan registers classes it sees here
)


class SweepLauncher(sweep_launcher.SweepLauncherBase):
    """Hydra's basic launcher with fsdp-train's pre-launch check of every job."""


sweep_launcher.register_launcher_config(f"{__name__}.{SweepLauncher.__name__}")
