"""Save and load for every strategy through ``torch.distributed.checkpoint.state_dict``.

:class:`DistributedCheckpointing` is mixed into the DDP, FSDP1, FSDP2 and model-parallel
strategies so that all of them write the same two formats (see :mod:`fsdp_cli.checkpoint.format`)
with the same parameter names. That is what lets a checkpoint saved at one layout resume at
another: DCP reshards on load, and full checkpoints are split by ``set_model_state_dict``.

Saves are atomic: each writes under ``<name>.partial`` and is renamed once every rank has
finished and the files are flushed (:mod:`fsdp_cli.checkpoint.sharded_save`; full files through
the strategy's CheckpointIO, :class:`~fsdp_cli.checkpoint.io.FullCheckpointIO` by default); a
save that fails fails on every rank with one line and leaves no ``.partial`` behind.

Lightning's contracts are kept: a full save and every checkpoint that is not a sharded one of
ours go through the Lightning strategy's own ``save_checkpoint`` / ``load_checkpoint`` (its
checks, its errors, its lazy loading of full files, its handling of its own sharded layout),
with this mixin adding the manifest, the atomic write and the one-line failure on every rank.
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
from fsdp_cli.checkpoint.format import (
    MANIFEST_KEY,
    META_FILE,
    PARTIAL_SUFFIX,
    checkpoint_format,
    remove_path,
)
from fsdp_cli.checkpoint.manifest import TRAINED_KEY
from fsdp_cli.checkpoint.optimizer_layout import PARAMETER_NAMES_KEY, is_numbered, named, numbered
from fsdp_cli.checkpoint.sharded_save import (
    KEPT,
    AsyncSaves,
    SaveTarget,
    describe_error,
    save_sharded,
)
from fsdp_cli.checkpoint_format import CheckpointFormat
from fsdp_cli.errors import RunFailure
from fsdp_cli.parallel.names import canonical_name


class DistributedCheckpointing:
    """Mixin for Lightning strategies; expects ``self.model``, ``self.optimizers``, ``broadcast``,
    ``barrier``, ``is_global_zero`` and ``checkpoint_io`` from the strategy it is mixed into.

    ``checkpoint_format``: a :class:`~fsdp_cli.checkpoint_format.CheckpointFormat`, ``sharded``
    (DCP folder) or ``full`` (one file from rank 0); its name (``"sharded"``) is accepted too.
    ``checkpoint_manifest``: extra fields written into each checkpoint's manifest.
    ``async_checkpointing``: write sharded saves in the background.
    ``save_frozen``: checkpoints hold the parameters that do not train too (False: a LoRA run's
    adapters only; the frozen base is rebuilt from its source on resume, and a checkpoint that
    lacks frozen parameters loads without them).
    """

    _checkpoint_format: CheckpointFormat = CheckpointFormat.sharded
    checkpoint_manifest: dict[str, Any] | None = None
    async_checkpointing: bool = False
    """Sharded saves are written in the background (``checkpoint.async_save``)."""
    save_frozen: bool = True
    """Checkpoints hold frozen parameters too (``peft.save_base``)."""
    _async_saves: AsyncSaves | None = None
    run_mesh: Any = None
    """The device mesh the strategy built (None for DDP: one data-parallel dimension)."""

    def __init__(
        self,
        *args: Any,
        checkpoint_format: CheckpointFormat | str | None = None,
        checkpoint_manifest: dict[str, Any] | None = None,
        async_checkpointing: bool = False,
        save_frozen: bool = True,
        **kwargs: Any,
    ) -> None:
        """The strategy's own arguments pass through; ``checkpoint_format`` None keeps the
        strategy's own choice (``save_distributed_checkpoint``, ``state_dict_type``): read back
        here, the one place Lightning's spelling becomes ours."""
        super().__init__(*args, **kwargs)
        if checkpoint_format is None:
            from fsdp_cli.compat.lightning_internals import lightning_writes_sharded, unknown_lightning_format

            sharded = lightning_writes_sharded(self)  # type: ignore[arg-type]
            if sharded is None:  # no setting (DDP), or one Lightning's own save refuses: left as it
                # is, and saved through Lightning's save_checkpoint (the full-file path), which says so
                self._checkpoint_format = CheckpointFormat(
                    CheckpointFormat.full if unknown_lightning_format(self) else self._checkpoint_format  # type: ignore[arg-type]
                )
            else:
                self.checkpoint_format = CheckpointFormat.sharded if sharded else CheckpointFormat.full
        else:
            self.checkpoint_format = checkpoint_format
        self.checkpoint_manifest = checkpoint_manifest
        self.async_checkpointing = async_checkpointing
        self.save_frozen = save_frozen

    @property
    def checkpoint_format(self) -> CheckpointFormat:
        return self._checkpoint_format

    @checkpoint_format.setter
    def checkpoint_format(self, value: CheckpointFormat | str) -> None:
        """Also sets the Lightning strategy's own setting, which its ``save_checkpoint`` (called
        for full files) reads."""
        from fsdp_cli.compat.lightning_internals import set_lightning_writes_sharded

        self._checkpoint_format = CheckpointFormat(value)
        set_lightning_writes_sharded(self, self._checkpoint_format is CheckpointFormat.sharded)  # type: ignore[arg-type]

    def mesh_sizes(self) -> dict[str, int]:
        """The run's mesh as ``{dimension name: size}``, for the manifest and the setup report."""
        mesh = self.run_mesh
        if mesh is None or not mesh.mesh_dim_names:
            return {"data_parallel": int(self.world_size)}
        from fsdp_cli.parallel.dims import CP, PP

        sizes = zip(mesh.mesh_dim_names, mesh.mesh.shape, strict=True)
        # The pipeline and context-parallel dimensions are named only where they split something
        # (as before pp and cp existed).
        return {name: int(size) for name, size in sizes if name not in (PP, CP) or size > 1}

    @property
    def checkpoint_io(self) -> Any:
        """Lightning's rule with our default: :class:`~fsdp_cli.checkpoint.io.FullCheckpointIO`
        (atomic writes; reads with weights_only and mmap) where Lightning would use
        TorchCheckpointIO, also as the base of a wrapping plugin given without one
        (``AsyncCheckpointIO()``)."""
        from fsdp_cli.checkpoint.io import FullCheckpointIO
        from fsdp_cli.compat.lightning_internals import is_wrapping_checkpoint_io

        if self._checkpoint_io is None:
            self._checkpoint_io = FullCheckpointIO()
        elif is_wrapping_checkpoint_io(self._checkpoint_io):
            self._checkpoint_io.checkpoint_io = FullCheckpointIO()  # ignored once it has a base
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: Any) -> None:
        self._checkpoint_io = io

    # ------------------------------------------------------------------ Lightning hooks

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        # Load into the sharded/wrapped model and the real optimizers, whatever the layout.
        return True

    # lightning_restore_optimizer stays the Lightning strategy's: DDP's Lightning restores the
    # optimizers through load_optimizer_state_dict; FSDP's and ModelParallel's load_checkpoint
    # restores them itself.

    def lightning_module_state_dict(self) -> dict[str, Any]:
        state = get_model_state_dict(self.model)
        if not self.save_frozen:
            # (Filtered here: torch's ignore_frozen_params trips FSDP1's full state-dict hook.)
            frozen = frozen_names(self.model)
            state = {k: v for k, v in state.items() if canonical_name(k) not in frozen}
        return self._gather_if_full(state)

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """Sharded: the state keyed by parameter name. Full (rank 0; empty elsewhere): whole
        tensors in torch's standard layout, parameters numbered in the module's order."""
        state = self._gather_if_full(self._local_optimizer_state(optimizer))
        if self.checkpoint_format is not CheckpointFormat.full or not state:
            return state
        return numbered(state, self._parameter_names())

    def _local_optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """The optimizer's state as this rank holds it (DTensors), keyed by parameter name."""
        return get_optimizer_state_dict(self.model, _unwrap(optimizer))

    def _parameter_names(self) -> list[str]:
        module = self.lightning_module
        return [canonical_name(n) for n, _ in module.named_parameters()] if module is not None else []

    def _gather_if_full(self, state: dict[str, Any]) -> dict[str, Any]:
        # The sharded state dict holds DTensors for FSDP1, FSDP2 and tensor parallel alike. For a
        # full checkpoint, each tensor is assembled in turn and only rank 0 keeps it (on CPU), so
        # no rank ever holds the whole model twice. (torch's own full-state-dict path for FSDP1
        # crashes on CPU processes: a segmentation fault cloning the unsharded parameters.)
        if self.checkpoint_format is not CheckpointFormat.full:
            return state
        return _gather_to_rank0(state, keep=self.is_global_zero)

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        if self.checkpoint_format is not CheckpointFormat.sharded:
            self._save_full(checkpoint, filepath, storage_options)
            return
        # Lightning's own sharded saves refuse storage_options first, with these words.
        if storage_options is not None:
            raise TypeError(storage_options_refused(self))
        # Written here, not by Lightning's save_checkpoint: its layout differs ("model" /
        # "optimizer_N" keys, written in place), ours is atomic, carries a manifest and is the one
        # every strategy of this package reads (see the module docstring).
        path = Path(self.broadcast(str(filepath)))
        partial = path.with_name(path.name + PARTIAL_SUFFIX)
        self.wait_for_checkpoint()  # one save at a time: a background one finishes (or fails) first
        manifest = self._manifest(checkpoint)
        if self.is_global_zero:
            remove_path(partial)  # left by a save that was interrupted
        self.barrier("checkpoint-clean")
        step = int(checkpoint.get("global_step", -1))
        self._save_sharded(checkpoint, SaveTarget(partial, path, step, {}, manifest))

    def wait_for_checkpoint(self) -> None:
        """Block until a background (``async_save``) checkpoint is visible; raises its failure."""
        if self._async_saves is not None:
            self._async_saves.wait()

    def teardown(self) -> None:
        """Lightning's teardown, then every save still being written finished (its failure
        raised): ours in the background (``async_checkpointing``), and a CheckpointIO plugin's
        (``AsyncCheckpointIO``) through its ``teardown``. Lightning's ``Strategy.teardown`` ends
        with the plugin's, but its FSDPStrategy and ModelParallelStrategy replace it without that
        line: ``trainer.fit`` returned while the plugin's thread still wrote the file (seen in
        tests/assets/lightning_interop.py on a loaded machine). Calling it again after
        DDPStrategy's own is harmless: the plugin's pool is gone."""
        super().teardown()  # type: ignore[misc]
        self.wait_for_checkpoint()
        self.checkpoint_io.teardown()

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """A sharded checkpoint of ours is loaded in place here; anything else (a full file, a
        sharded checkpoint in Lightning's own layout) by :meth:`_load_full`, Lightning's loading.
        A path that is no checkpoint is a ValueError that says why."""
        path = Path(self.broadcast(str(checkpoint_path)))
        if checkpoint_format(path) is CheckpointFormat.sharded:
            from fsdp_cli.checkpoint.untrusted import check_sharded

            # Checked whole first (metadata through the allowlist, every non-tensor value weights
            # only), also before Lightning's own loaders read a folder in its layout.
            metadata = check_sharded(path)
            if not _lightning_layout(metadata):
                return self._load_sharded(path, metadata)
        return self._load_full(path, weights_only)

    def _load_full(self, path: Path, weights_only: bool | None) -> dict[str, Any]:
        # Lightning's own: DDP reads it through the CheckpointIO and restores through
        # load_model_state_dict / load_optimizer_state_dict; FSDP reads it lazily and restores the
        # model and optimizers itself (checking their number). The model-parallel strategies
        # override this (see load_through_checkpoint_io).
        return super().load_checkpoint(path, weights_only=weights_only)  # type: ignore[misc]

    def load_through_checkpoint_io(self, path: Path, weights_only: bool | None) -> dict[str, Any]:
        """A full file read by the CheckpointIO (memory-mapped), restored by
        load_model_state_dict / load_optimizer_state_dict (``lightning_restore_optimizer``).

        For the ModelParallelStrategy-based classes instead of Lightning's loading, which reads
        the file itself (a CheckpointIO plugin is never asked) and maps numbered optimizer
        states to the module's parameter order: wrong (a shape error, or states swapped between
        same-shaped parameters) when the optimizer's param groups list the parameters in
        another order, as a plain optimizer's state_dict numbers them.
        """
        return self.checkpoint_io.load_checkpoint(path, weights_only=weights_only)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if "state_dict" not in checkpoint:  # loaded in place already (sharded, or Lightning's loading)
            return
        state = checkpoint["state_dict"]
        set_model_state_dict(
            self.model,
            state,
            options=StateDictOptions(
                full_state_dict=True, strict=strict and not _frozen_missing(self._unwrapped_model(), state)
            ),
        )

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if self._optimizers_restored:  # by _load_sharded, in place
            self._optimizers_restored = False
            return
        self._restore_optimizer_states(checkpoint.get("optimizer_states") or [])

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            remove_path(Path(filepath))

    # ------------------------------------------------------------------ internals

    _optimizers_restored = False

    def _unwrapped_model(self) -> Any:
        """The module whose names are the state dict's: the LightningModule (DDP's wrapper adds
        ``module.``), or the model a strategy was handed without one."""
        return self.lightning_module if self.lightning_module is not None else self.model

    def _restore_optimizer_states(self, states: list[dict[str, Any]]) -> None:
        check_optimizer_count(len(self.optimizers), len(states))
        for optimizer, state in zip(map(_unwrap, self.optimizers), states):
            if is_numbered(state):  # torch's standard layout (a plain module's checkpoint, or ours)
                current = get_optimizer_state_dict(self.model, optimizer)["param_groups"]
                state = named(state, [g["params"] for g in current])
            set_optimizer_state_dict(
                self.model,
                optimizer,
                optim_state_dict=state,
                options=StateDictOptions(full_state_dict=True),
            )

    def numbered_in_module_order(self, states: list[dict[str, Any]]) -> bool:
        """Whether the numbered optimizer states among ``states`` number the parameters by the
        module's order (as this package and Lightning's FSDP / ModelParallel strategies write
        them), rather than by their position in param groups listed in another order."""
        numbered_states = [(o, s) for o, s in zip(map(_unwrap, self.optimizers), states) if is_numbered(s)]
        if not numbered_states:  # (nothing to compare: Lightning's loader then checks the count itself)
            return True
        index = {name: i for i, name in enumerate(self._parameter_names())}
        for optimizer, state in numbered_states:
            current = get_optimizer_state_dict(self.model, optimizer)["param_groups"]
            expected = [[index.get(n) for n in g["params"]] for g in current]
            if [list(g["params"]) for g in state["param_groups"]] != expected:
                return False
        return True

    def _manifest(self, checkpoint: Mapping[str, Any]) -> dict[str, Any]:
        from fsdp_cli.checkpoint.manifest import build_manifest

        extra = dict(self.checkpoint_manifest or {})
        trained = trained_names(self.lightning_module) if self.lightning_module is not None else None
        if trained is not None:
            extra[TRAINED_KEY] = trained
        return build_manifest(self, checkpoint, extra=extra)

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

    def _save_full(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None) -> None:
        """Lightning's own save (its checks and errors, a sharded checkpoint of the same name
        removed, rank 0 writing through the CheckpointIO), with the manifest inside the file; a
        write that fails on rank 0 fails every rank, with one line."""
        self.wait_for_checkpoint()
        plain = isinstance(checkpoint, dict)
        if plain and self.is_global_zero:
            # The names the optimizer states' numbers stand for: fsdp-ckpt names them again offline.
            names = (
                {PARAMETER_NAMES_KEY: self._parameter_names()} if checkpoint.get("optimizer_states") else {}
            )
            checkpoint[MANIFEST_KEY] = {**self._manifest(checkpoint), **names}
        failure: Exception | None = None
        try:
            super().save_checkpoint(checkpoint, filepath, storage_options)  # type: ignore[misc]
        except Exception as err:  # noqa: BLE001 - every rank must learn it (below)
            failure = err
        reports = _all_gather_objects(None if failure is None else _failure_line(failure, filepath))
        if failure is not None:
            raise failure  # this rank's own error, as Lightning (or the CheckpointIO) raised it
        if any(reports):  # rank 0 failed to write: the others fail with its line instead of waiting
            raise RunFailure(next(r for r in reports if r))
        phases.reached("after_rename", int(checkpoint.get("global_step", -1)) if plain else None)

    def _optimizer_aliases(self) -> dict[str, str]:
        """This rank's parameters whose optimizer state a checkpoint keeps under another name:
        {name here: name saved} (a tied weight's copy on the last pipeline stage)."""
        return {}

    def _load_sharded(self, path: Path, metadata: Any) -> dict[str, Any]:
        from fsdp_cli.checkpoint.format import torch_load
        from fsdp_cli.checkpoint.untrusted import dcp_load

        check_optimizer_count(len(self.optimizers), _saved_optimizer_count(metadata))
        model_state = get_model_state_dict(self.model)
        saved = {k.partition(".")[2] for k in metadata.state_dict_metadata if k.startswith("state_dict.")}
        # An adapters-only save: the frozen base keeps the values the run built (read in place
        # into the saved keys' tensors; the whole state set back, as FSDP1 requires every key).
        reading = model_state
        if _frozen_missing(self._unwrapped_model(), saved):
            reading = {k: v for k, v in model_state.items() if k in saved}
        dcp_load({"state_dict": reading}, path)
        set_model_state_dict(self.model, model_state)
        aliases = self._optimizer_aliases()
        for index, optimizer in enumerate(map(_unwrap, self.optimizers)):
            # Read under the names the checkpoint keeps them by (aliases), set under this rank's.
            reading = renamed(get_optimizer_state_dict(self.model, optimizer), aliases)
            dcp_load({"optimizer_states": {str(index): reading}}, path)
            optim_state = renamed(reading, {saved: own for own, saved in aliases.items()})
            set_optimizer_state_dict(self.model, optimizer, optim_state_dict=optim_state)
        self._optimizers_restored = bool(self.optimizers)
        meta = torch_load(path / META_FILE, map_location="cpu")
        meta["optimizer_states"] = []  # restored above; tells Lightning the checkpoint has them
        return meta


def renamed(state: Mapping[str, Any], names: Mapping[str, str]) -> dict[str, Any]:
    """An optimizer state dict keyed by name (``get_optimizer_state_dict``'s), with the parameters
    of ``names`` under their new names (the same values: tensors loaded in place stay shared)."""
    if not names:
        return dict(state)
    groups = [{**g, "params": [names.get(n, n) for n in g["params"]]} for g in state.get("param_groups", [])]
    return {**state, "state": {names.get(n, n): v for n, v in state["state"].items()}, "param_groups": groups}


def frozen_names(model: Any) -> set[str]:
    """The canonical names of ``model``'s parameters that do not train, under every name a tied
    parameter has (a frozen embedding's tied head is frozen too, and not saved)."""
    return {
        canonical_name(n) for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad
    }


def trained_names(model: Any) -> list[str] | None:
    """The canonical names of ``model``'s parameters that train (every name of a tied one), for
    the manifest: what an export of the run carries beside its adapters. None when every
    parameter trains (a full fine-tune: nothing to list)."""
    named = list(model.named_parameters(remove_duplicate=False))
    if all(p.requires_grad for _, p in named):
        return None
    return sorted({canonical_name(n) for n, p in named if p.requires_grad})


def _frozen_missing(model: Any, saved: Any) -> bool:
    """Whether ``saved`` (state-dict keys) lacks parameters of ``model``, all of them frozen: a
    checkpoint written without them (``save_frozen=False``). Missing trainable ones stay an error.
    ``model``: the LightningModule, whose names are the state dict's (DDP's wrapper adds
    ``module.`` to every name: read through it, nothing would match)."""
    names = {canonical_name(n): p.requires_grad for n, p in model.named_parameters()}
    missing = set(names) - {canonical_name(k) for k in saved}
    return bool(missing) and not any(names[n] for n in missing)


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


def storage_options_refused(strategy: Any) -> str:
    """Lightning's refusal of ``storage_options`` (by the name of the Lightning strategy class)."""
    # The Lightning class this strategy extends (FSDP1Strategy -> FSDPStrategy), as Lightning names it.
    name = next(c.__name__ for c in type(strategy).__mro__ if c.__module__.startswith("lightning."))
    return (
        f"`{name}.save_checkpoint(..., storage_options=...)` is not supported because `{name}` does not "
        "use the `CheckpointIO` for sharded checkpoints; storage_options reach the CheckpointIO of "
        "full (one-file) checkpoints under DDP"
    )


def check_optimizer_count(configured: int, saved: int) -> None:
    """Lightning's check (and words): as many optimizer states as optimizers, never a silent subset."""
    if saved and configured != saved:
        raise RuntimeError(
            f"You have configured {configured} optimizers but the checkpoint contains {saved} optimizers to "
            "load. Please resume training with the same number of optimizers or edit the checkpoint "
            "manually to remove states."
        )


def _saved_optimizer_count(metadata: Any) -> int:
    keys = metadata.state_dict_metadata
    return len({k.split(".")[1] for k in keys if k.startswith("optimizer_states.")})


def _lightning_layout(metadata: Any) -> bool:
    """A sharded checkpoint written by Lightning's own FSDPStrategy / ModelParallelStrategy
    (tensors under ``model`` or ``optimizer_N``), which its strategies load."""
    import re

    return any(re.match(r"(model|optimizer_\d+)\.", k) for k in metadata.state_dict_metadata)


def _failure_line(err: BaseException, filepath: Any) -> str:
    if isinstance(err, RunFailure):
        return str(err)
    return f"checkpoint save to {filepath} failed: rank {_rank()}: {describe_error(err)}; {KEPT}"


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _all_gather_objects(obj: Any) -> list[Any]:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
