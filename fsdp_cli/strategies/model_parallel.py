"""Lightning's ModelParallelStrategy with the project's checkpoint formats.

For LightningModules that apply their own parallelism in ``configure_model`` (Lightning's
documented FSDP2 + tensor-parallel pattern). ``save_distributed_checkpoint`` keeps its Lightning
meaning: True writes a sharded (DCP) folder, False one full file.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import ModelParallelStrategy as _LightningModelParallelStrategy

from fsdp_cli.checkpoint.distributed import DistributedCheckpointing


class ModelParallelStrategy(DistributedCheckpointing, _LightningModelParallelStrategy):
    def __init__(self, *args: Any, save_distributed_checkpoint: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, save_distributed_checkpoint=save_distributed_checkpoint, **kwargs)
        self.checkpoint_format = "sharded" if save_distributed_checkpoint else "full"

    def setup_environment(self) -> None:
        super().setup_environment()
        self.run_mesh = self.device_mesh
