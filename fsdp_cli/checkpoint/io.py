"""The default CheckpointIO for full (one-file) checkpoints: written atomically, read cheaply."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from fsdp_cli.checkpoint import phases
from fsdp_cli.checkpoint.atomic import replace_atomically
from fsdp_cli.checkpoint.format import PARTIAL_SUFFIX, fsync_tree, remove_path
from fsdp_cli.checkpoint.sharded_save import KEPT, describe_error, disk_full_note
from fsdp_cli.errors import RunFailure


class FullCheckpointIO(TorchCheckpointIO):
    """Lightning's TorchCheckpointIO, writing under ``<name>.partial`` and renaming when flushed;
    ``torch.load(weights_only=True, mmap=True)`` to read.

    The rename is part of the write, so a plugin that writes in the background
    (``AsyncCheckpointIO()``, whose base this is by default) renames when its write has finished,
    never before. ``weights_only`` refuses to unpickle arbitrary objects (a refusal is one line
    naming the file and the class: :mod:`fsdp_cli.checkpoint.untrusted`), unless the caller
    passes ``weights_only=False`` itself (fsdp-train never does); ``mmap`` lets every rank
    open the same file without each holding a full copy in memory (pages are shared and read on
    demand). A failed write raises :class:`~fsdp_cli.errors.RunFailure` with one line and leaves
    no ``.partial`` behind.
    """

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        path = Path(path)
        partial = path.with_name(path.name + PARTIAL_SUFFIX)
        step = int(checkpoint.get("global_step", -1)) if isinstance(checkpoint, dict) else -1
        remove_path(partial)  # left by a save that was interrupted
        try:
            super().save_checkpoint(checkpoint, partial, storage_options=storage_options)
            phases.reached("before_rename", step)
            # (A subclass that writes elsewhere, a remote store, leaves nothing here to rename.)
            if partial.exists():
                fsync_tree(partial)
                replace_atomically(partial, path)
        except Exception as err:  # noqa: BLE001 - one line, whatever failed
            reason = "; ".join([*disk_full_note(path.parent), f"rank 0: {describe_error(err)}"])
            remove_path(partial)
            raise RunFailure(f"checkpoint save of step {step} to {path} failed: {reason}; {KEPT}") from None

    def load_checkpoint(
        self, path: Any, map_location: Any | None = "cpu", weights_only: bool | None = None
    ) -> dict[str, Any]:
        if weights_only is False:  # the caller's explicit word (trainer.fit(..., weights_only=False))
            return torch.load(path, map_location=map_location, mmap=True, weights_only=False)
        from fsdp_cli.checkpoint.untrusted import torch_load

        return torch_load(path, map_location=map_location, mmap=True)
