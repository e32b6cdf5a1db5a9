"""The default CheckpointIO for full (one-file) checkpoints: safe to load, cheap on memory."""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO


class FullCheckpointIO(TorchCheckpointIO):
    """``torch.save`` to write; ``torch.load(weights_only=True, mmap=True)`` to read.

    ``weights_only`` refuses to unpickle arbitrary objects; ``mmap`` lets every rank open the
    same file without each holding a full copy in memory (pages are shared and read on demand).
    """

    def load_checkpoint(
        self, path: Any, map_location: Any | None = "cpu", weights_only: bool | None = None
    ) -> dict[str, Any]:
        return torch.load(
            path,
            map_location=map_location,
            mmap=True,
            weights_only=True if weights_only is None else weights_only,
        )
