"""DDP with the project's checkpoint formats (so a DDP run resumes from, and into, sharded layouts)."""

from __future__ import annotations

from lightning.pytorch.strategies import DDPStrategy as _LightningDDPStrategy

from fsdp_cli.checkpoint.distributed import DistributedCheckpointing


class DDPStrategy(DistributedCheckpointing, _LightningDDPStrategy):
    """Lightning's DDPStrategy; checkpoints are written and read as in :mod:`fsdp_cli.checkpoint`."""
