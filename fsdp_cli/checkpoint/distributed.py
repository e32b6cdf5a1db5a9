"""Save and load for every strategy through ``torch.distributed.checkpoint.state_dict``.

:class:`DistributedCheckpointing` is mixed into the DDP, FSDP1, FSDP2 and model-parallel
strategies so that all of them write the same two formats (see :mod:`fsdp_cli.checkpoint.format`)
with the same parameter names. That is what lets a checkpoint saved at one layout resume at
another: DCP reshards on load, and full checkpoints are split by ``set_model_state_dict``.

Saves are atomic: each writes under ``<name>.partial`` and is renamed once every rank has
finished and the files are flushed (:mod:`fsdp_cli.checkpoint.sharded_save`); a save that fails
fails on every rank with one line and leaves no ``.partial`` behind.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from fsdp_cli.checkpoint import phases
from fsdp_cli.checkpoint.atomic import replace_atomically
from fsdp_cli.checkpoint.format import (
    MANIFEST_KEY,
    META_FILE,
    PARTIAL_SUFFIX,
    checkpoint_format,
    fsync_tree,
    remove_path,
)
from fsdp_cli.checkpoint.sharded_save import (
    KEPT,
    AsyncSaves,
    SaveTarget,
    describe_error,
    disk_full_note,
    save_sharded,
)
from fsdp_cli.errors import RunFailure


class DistributedCheckpointing:
    """Mixin for Lightning strategies; expects ``self.model``, ``self.optimizers``, ``broadcast``,
    ``barrier``, ``is_global_zero`` and ``checkpoint_io`` from the strategy it is mixed into.

    ``checkpoint_format``: ``"sharded"`` (DCP folder) or ``"full"`` (one file from rank 0).
    ``checkpoint_manifest``: extra fields written into each checkpoint's manifest.
    ``async_checkpointing``: write sharded saves in the background.
    """

    checkpoint_format: str = "sharded"
    checkpoint_manifest: dict[str, Any] | None = None
    async_checkpointing: bool = False
    """Sharded saves are written in the background (``checkpoint.async_save``)."""
    _async_saves: AsyncSaves | None = None
    run_mesh: Any = None
    """The device mesh the strategy built (None for DDP: one data-parallel dimension)."""

    def __init__(
        self,
        *args: Any,
        checkpoint_format: str | None = None,
        checkpoint_manifest: dict[str, Any] | None = None,
        async_checkpointing: bool = False,
        **kwargs: Any,
    ) -> None:
        """The strategy's own arguments pass through; ``checkpoint_format`` None keeps the
        strategy's own choice (``save_distributed_checkpoint``, ``state_dict_type``)."""
        super().__init__(*args, **kwargs)
        if checkpoint_format is not None:
            self.checkpoint_format = checkpoint_format
        self.checkpoint_manifest = checkpoint_manifest
        self.async_checkpointing = async_checkpointing

    def mesh_sizes(self) -> dict[str, int]:
        """The run's mesh as ``{dimension name: size}``, for the manifest and the setup report."""
        mesh = self.run_mesh
        if mesh is None or not mesh.mesh_dim_names:
            return {"data_parallel": int(self.world_size)}
        return {name: int(size) for name, size in zip(mesh.mesh_dim_names, mesh.mesh.shape)}

    @property
    def checkpoint_io(self) -> Any:
        # Full files are read with weights_only=True and mmap unless the user set another CheckpointIO.
        if self._checkpoint_io is None:
            from fsdp_cli.checkpoint.io import FullCheckpointIO

            self._checkpoint_io = FullCheckpointIO()
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: Any) -> None:
        self._checkpoint_io = io

    # ------------------------------------------------------------------ Lightning hooks

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        # Load into the sharded/wrapped model and the real optimizers, whatever the layout.
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        return True

    def lightning_module_state_dict(self) -> dict[str, Any]:
        state = get_model_state_dict(self.model)
        return self._gather_if_full(state)

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        optimizer = _unwrap(optimizer)
        return self._gather_if_full(get_optimizer_state_dict(self.model, optimizer))

    def _gather_if_full(self, state: dict[str, Any]) -> dict[str, Any]:
        # The sharded state dict holds DTensors for FSDP1, FSDP2 and tensor parallel alike. For a
        # full checkpoint, each tensor is assembled in turn and only rank 0 keeps it (on CPU), so
        # no rank ever holds the whole model twice. (torch's own full-state-dict path for FSDP1
        # crashes on CPU processes: a segmentation fault cloning the unsharded parameters.)
        if self.checkpoint_format != "full":
            return state
        return _gather_to_rank0(state, keep=self.is_global_zero)

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        path = Path(self.broadcast(str(filepath)))
        partial = path.with_name(path.name + PARTIAL_SUFFIX)
        self.wait_for_checkpoint()  # one save at a time: a background one finishes (or fails) first
        manifest = self._manifest(checkpoint)
        if self.is_global_zero:
            remove_path(partial)  # left by a save that was interrupted
        self.barrier("checkpoint-clean")
        step = int(checkpoint.get("global_step", -1))
        if self.checkpoint_format == "sharded":
            self._save_sharded(checkpoint, SaveTarget(partial, path, step, {}, manifest))
        else:
            self._save_full(checkpoint, SaveTarget(partial, path, step, {}, manifest), storage_options)

    def wait_for_checkpoint(self) -> None:
        """Block until a background (``async_save``) checkpoint is visible; raises its failure."""
        if self._async_saves is not None:
            self._async_saves.wait()

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        if checkpoint_format(path) == "sharded":
            return self._load_sharded(path)
        return self.checkpoint_io.load_checkpoint(path, weights_only=weights_only)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if "state_dict" not in checkpoint:  # a sharded checkpoint was loaded in place already
            return
        set_model_state_dict(
            self.model,
            checkpoint["state_dict"],
            options=StateDictOptions(full_state_dict=True, strict=strict),
        )

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        self._restore_optimizer_states(checkpoint.get("optimizer_states") or [])

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            remove_path(Path(filepath))

    # ------------------------------------------------------------------ internals

    def _restore_optimizer_states(self, states: list[dict[str, Any]]) -> None:
        for optimizer, state in zip(self.optimizers, states):
            set_optimizer_state_dict(
                self.model,
                _unwrap(optimizer),
                optim_state_dict=state,
                options=StateDictOptions(full_state_dict=True),
            )

    def _manifest(self, checkpoint: Mapping[str, Any]) -> dict[str, Any]:
        from fsdp_cli.checkpoint.manifest import build_manifest

        return build_manifest(self, checkpoint, extra=self.checkpoint_manifest or {})

    def _save_sharded(self, checkpoint: dict[str, Any], target: SaveTarget) -> None:
        tensors = {
            "state_dict": checkpoint.pop("state_dict"),
            "optimizer_states": {str(i): s for i, s in enumerate(checkpoint.pop("optimizer_states", []))},
        }
        target.meta = checkpoint
        if self.async_checkpointing:
            if self._async_saves is None:
                self._async_saves = AsyncSaves()
            self._async_saves.submit(tensors, target)
        else:
            save_sharded(tensors, target)

    def _save_full(self, checkpoint: dict[str, Any], target: SaveTarget, storage_options: Any | None) -> None:
        error = None
        if self.is_global_zero:
            checkpoint[MANIFEST_KEY] = target.manifest
            error = _write_full(self.checkpoint_io, checkpoint, target, storage_options)
        # Rank 0 alone writes: every rank learns how it went, so all fail together or none.
        error = self.broadcast(error)
        if error is not None:
            raise RunFailure(error)
        phases.reached("after_rename", target.step)

    def _load_sharded(self, path: Path) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp

        model_state = get_model_state_dict(self.model)
        dcp.load({"state_dict": model_state}, checkpoint_id=str(path))
        set_model_state_dict(self.model, model_state)
        for index, optimizer in enumerate(map(_unwrap, self.optimizers)):
            optim_state = get_optimizer_state_dict(self.model, optimizer)
            dcp.load({"optimizer_states": {str(index): optim_state}}, checkpoint_id=str(path))
            set_optimizer_state_dict(self.model, optimizer, optim_state_dict=optim_state)
        meta = torch.load(path / META_FILE, map_location="cpu", weights_only=True)
        meta["optimizer_states"] = []  # restored above; tells Lightning the checkpoint has them
        return meta


def _unwrap(optimizer: Any) -> Any:
    """The torch optimizer inside Lightning's wrapper (Lightning hands the strategy either)."""
    from lightning.pytorch.core.optimizer import LightningOptimizer

    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def _gather_to_rank0(tree: Any, keep: bool) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(tree, dict):
        out = {k: _gather_to_rank0(v, keep) for k, v in tree.items()}
        return out if keep else {}
    if isinstance(tree, list):
        return [_gather_to_rank0(v, keep) for v in tree]
    if isinstance(tree, DTensor):
        tree = tree.full_tensor()  # a collective: every rank takes part
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=True) if keep else None
    return tree


def _write_full(io: Any, checkpoint: dict[str, Any], target: SaveTarget, storage_options: Any) -> str | None:
    """Rank 0: the whole checkpoint into ``.partial``, flushed, renamed; an error as one line."""
    try:
        target.partial.parent.mkdir(parents=True, exist_ok=True)
        io.save_checkpoint(checkpoint, target.partial, storage_options=storage_options)
        phases.reached("before_rename", target.step)
        fsync_tree(target.partial)
        replace_atomically(target.partial, target.final)
    except Exception as err:  # noqa: BLE001 - every rank must learn it (see _save_full)
        reason = "; ".join([*disk_full_note(target.partial.parent), f"rank 0: {describe_error(err)}"])
        remove_path(target.partial)
        return f"checkpoint save of step {target.step} to {target.final} failed: {reason}; {KEPT}"
    return None
