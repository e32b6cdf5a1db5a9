"""Lightning's ModelParallelStrategy with the project's checkpoint formats.

For LightningModules that apply their own parallelism in ``configure_model`` (Lightning's
documented FSDP2 + tensor-parallel pattern). ``save_distributed_checkpoint`` keeps its Lightning
meaning: True writes a sharded (DCP) folder, False one full file.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lightning.pytorch.strategies import ModelParallelStrategy as _LightningModelParallelStrategy

from fsdp_cli.checkpoint.distributed import DistributedCheckpointing
from fsdp_cli.parallel.fsdp2 import fsdp2_modules, gradient_sync_disabled
from fsdp_cli.strategies.clipping import GlobalNormClipping


class ModelParallelStrategy(GlobalNormClipping, DistributedCheckpointing, _LightningModelParallelStrategy):
    def setup_environment(self) -> None:
        super().setup_environment()
        self.run_mesh = self.device_mesh

    @property
    def lightning_restore_optimizer(self) -> bool:
        return True  # restored by load_optimizer_state_dict (see _load_full)

    def _load_full(self, path: Path, weights_only: bool | None) -> dict[str, Any]:
        return self.load_through_checkpoint_io(path, weights_only)

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """No gradient reduction on accumulation micro-batches for the FSDP2 modules the user's
        ``configure_model`` created (Lightning's own strategy syncs on every micro-batch)."""
        module = self.lightning_module
        with gradient_sync_disabled(fsdp2_modules(module) if module is not None else []):
            yield
