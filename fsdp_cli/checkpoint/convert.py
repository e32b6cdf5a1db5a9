"""Offline checkpoint tools: read, check and convert, on one machine, without a process group.

Formats (see :mod:`fsdp_cli.checkpoint.format`): ``full`` (one torch file), ``sharded`` (a DCP
folder) and ``safetensors`` (model weights only, for other tools). Every conversion is atomic.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any

import torch

from fsdp_cli.checkpoint import phases
from fsdp_cli.checkpoint.atomic import file_records
from fsdp_cli.checkpoint.format import (
    MANIFEST_FILE,
    MANIFEST_KEY,
    META_FILE,
    PARTIAL_SUFFIX,
    CheckpointFormatError,
    checkpoint_format,
    fsync_tree,
    load_full,
    remove_path,
    torch_load,
    write_json_atomic,
)
from fsdp_cli.checkpoint.optimizer_layout import (
    PARAMETER_NAMES_KEY,
    is_numbered,
    module_order,
    named_by_index,
    numbered,
)
from fsdp_cli.checkpoint_format import CheckpointFormat

MODEL_PREFIX = "model."
# Offline use is the point here; DCP's note that no process group exists is noise.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


@dataclasses.dataclass
class Checkpoint:
    """A checkpoint in memory: model weights, optimizer states, the rest of Lightning's dict, manifest."""

    state_dict: dict[str, torch.Tensor]
    optimizer_states: list[dict[str, Any]]
    meta: dict[str, Any]
    manifest: dict[str, Any] | None


def check_complete(path: Path) -> CheckpointFormat:
    """The format, after checking that nothing is missing; :class:`CheckpointFormatError` otherwise."""
    fmt = checkpoint_format(path)
    if fmt is CheckpointFormat.sharded:
        sharded_metadata(path)
    return fmt


def sharded_metadata(path: Path) -> Any:
    """A sharded checkpoint's DCP metadata (read through the allowlist), after checking that every
    file it lists and ``meta.pt`` are there."""
    from fsdp_cli.checkpoint.untrusted import read_metadata

    metadata = read_metadata(path)
    files = sorted({info.relative_path for info in (metadata.storage_data or {}).values()})
    missing = [name for name in files if not (path / name).is_file()]
    if missing:
        raise CheckpointFormatError(f"{path}: missing shard file(s) {', '.join(missing)} listed in .metadata")
    if not (path / META_FILE).is_file():
        raise CheckpointFormatError(f"{path}: no {META_FILE}; not a checkpoint written by fsdp-train")
    return metadata


def load(path: Path, *, weights_only_model: bool = False) -> Checkpoint:
    """Read a full or sharded checkpoint into memory (``weights_only_model``: skip optimizer state)."""
    path = Path(path)
    if checkpoint_format(path) is CheckpointFormat.full:
        data = load_full(path)
        if not isinstance(data, dict) or "state_dict" not in data:
            raise CheckpointFormatError(
                f"{path}: a torch file without 'state_dict'; not an fsdp-train checkpoint"
            )
        manifest = data.pop(MANIFEST_KEY, None)
        state = data.pop("state_dict")
        optim = [] if weights_only_model else [_named(s, manifest) for s in data.pop("optimizer_states", [])]
        data.pop("optimizer_states", None)
        return Checkpoint(state, optim, data, manifest)
    tensors = _load_dcp(path, only_model=weights_only_model)
    optim_tree = tensors.get("optimizer_states", {})
    optim = (
        [optim_tree[k] for k in sorted(optim_tree, key=int)]
        if isinstance(optim_tree, dict)
        else list(optim_tree)
    )
    meta = torch_load(path / META_FILE, map_location="cpu")
    manifest = _read_json(path / MANIFEST_FILE)
    return Checkpoint(tensors.get("state_dict", {}), optim, meta, manifest)


def _load_dcp(path: Path, *, only_model: bool) -> dict[str, Any]:
    """The entries a conversion needs (all, or the model's tensors), read straight from the shard
    files into memory through the allowlist: nothing is copied to a temporary folder."""
    from fsdp_cli.checkpoint.untrusted import read_entries, unflatten

    metadata = sharded_metadata(path)
    keys = [k for k in metadata.state_dict_metadata if not only_model or k.startswith("state_dict.")]
    return unflatten(read_entries(path, metadata, keys), metadata)


@dataclasses.dataclass
class Summary:
    """What ``fsdp-ckpt inspect`` shows of a checkpoint, read without reading its tensors."""

    format: str
    shapes: list[tuple[Any, torch.dtype]]
    """Shape and dtype of each model tensor."""
    optimizer_state: bool
    meta: dict[str, Any]
    manifest: dict[str, Any] | None


def summarize(path: Path) -> Summary:
    """A sharded checkpoint's :class:`Summary` from its DCP metadata, ``meta.pt`` and manifest
    (and its non-tensor entries, checked); a full one's from the memory-mapped file. No tensor's
    data is read either way."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from fsdp_cli.checkpoint.untrusted import check_sharded

    path = Path(path)
    if checkpoint_format(path) is CheckpointFormat.full:
        ckpt = load(path)
        shapes = [(t.shape, t.dtype) for t in ckpt.state_dict.values() if hasattr(t, "dtype")]
        has_state = any(s.get("state") for s in ckpt.optimizer_states)
        return Summary("full", shapes, has_state, ckpt.meta, ckpt.manifest)
    sharded_metadata(path)  # every file there
    entries = check_sharded(path).state_dict_metadata  # a crafted one is refused, not described
    shapes = [
        (info.size, info.properties.dtype)
        for key, info in entries.items()
        if key.startswith("state_dict.") and isinstance(info, TensorStorageMetadata)
    ]
    has_state = any(k.startswith("optimizer_states.") and ".state." in k for k in entries)
    meta = torch_load(path / META_FILE, map_location="cpu")
    return Summary("sharded", shapes, has_state, meta, _read_json(path / MANIFEST_FILE))


def _named(state: dict[str, Any], manifest: dict[str, Any] | None) -> dict[str, Any]:
    """A full file's optimizer state (torch's numbered layout) keyed by parameter name, as a
    sharded checkpoint keys it, by the names its manifest lists; a state already named, or one
    whose numbers no manifest names (a file another tool wrote), as is."""
    names = (manifest or {}).get(PARAMETER_NAMES_KEY)
    return named_by_index(state, names) if names is not None and is_numbered(state) else state


def save_full(ckpt: Checkpoint, partial: Path) -> None:
    # Optimizer states in torch's numbered layout, as training writes full files (module order).
    names = module_order(ckpt.state_dict, [s for s in ckpt.optimizer_states if not is_numbered(s)])
    states = [s if is_numbered(s) else numbered(s, names) for s in ckpt.optimizer_states]
    data = {**ckpt.meta, "state_dict": ckpt.state_dict, "optimizer_states": states}
    data[MANIFEST_KEY] = _manifest_as(ckpt.manifest, "full")
    if states:
        data[MANIFEST_KEY][PARAMETER_NAMES_KEY] = names
    torch.save(data, partial)


def save_sharded(ckpt: Checkpoint, partial: Path) -> None:
    import torch.distributed.checkpoint as dcp

    if any(is_numbered(s) for s in ckpt.optimizer_states):
        # A sharded checkpoint keys optimizer state by parameter name (that is how it reshards).
        raise CheckpointFormatError(
            f"its optimizer state numbers the parameters and its manifest does not name them "
            f"(no '{PARAMETER_NAMES_KEY}'): it cannot be written as a sharded checkpoint; "
            "resume from it (resume=PATH) and save sharded instead"
        )
    tensors = {
        "state_dict": ckpt.state_dict,
        "optimizer_states": {str(i): s for i, s in enumerate(ckpt.optimizer_states)},
    }
    dcp.save(tensors, checkpoint_id=str(partial), no_dist=True)
    torch.save(ckpt.meta, partial / META_FILE)
    write_json_atomic(partial / MANIFEST_FILE, _manifest_as(ckpt.manifest, "sharded", partial))


def save_safetensors(ckpt: Checkpoint, partial: Path) -> None:
    """Model weights only, named as the model's own ``state_dict`` names them (no ``model.`` prefix)."""
    from safetensors.torch import save_file

    state = ckpt.state_dict
    if state and all(k.startswith(MODEL_PREFIX) for k in state):
        state = {k[len(MODEL_PREFIX) :]: v for k, v in state.items()}
    # clone(): safetensors refuses tensors that share memory (tied embeddings) and mmap'd views.
    tensors = {k: v.detach().clone().contiguous() for k, v in state.items() if isinstance(v, torch.Tensor)}
    step = (ckpt.manifest or {}).get("step", ckpt.meta.get("global_step"))
    save_file(tensors, str(partial), metadata={"format": "pt", "producer": "fsdp-ckpt", "step": str(step)})


def save_hf(ckpt: Checkpoint, partial: Path, hf_config: Path | None = None, *, merge: bool = False) -> None:
    from fsdp_cli.checkpoint.hf_export import save_hf as write_hf
    from fsdp_cli.checkpoint.hf_export import source_folder

    step = (ckpt.manifest or {}).get("step", ckpt.meta.get("global_step"))
    folder = source_folder(ckpt.manifest, hf_config)
    state = ckpt.state_dict
    if merge:
        from fsdp_cli.checkpoint.peft_export import merged

        state = merged(state, ckpt.manifest, folder)
    write_hf(state, partial, folder, step=step, manifest=ckpt.manifest)


def save_peft(ckpt: Checkpoint, partial: Path) -> None:
    from fsdp_cli.checkpoint.peft_export import save_peft as write_peft

    write_peft(ckpt.state_dict, ckpt.manifest, partial)


FOLDERS = ("sharded", "hf", "peft")
"""The formats written as a folder (the others: one file)."""


def convert(src: Path, dst: Path, to: str, *, hf_config: Path | None = None, merge: bool = False) -> Path:
    """``to``: full, sharded, safetensors, hf (a Hugging Face model folder, for ``model=hf``
    checkpoints; ``hf_config`` names the model folder if the run's ``model.path`` moved; ``merge``:
    a LoRA run's adapters merged into the base), or peft (a LoRA run's adapters as PEFT saves them).

    Written under ``DST.partial`` (claimed first: one left by another conversion is refused,
    never removed), flushed, and renamed to ``DST`` only if nothing appeared there meanwhile; a
    conversion that fails leaves nothing behind. Reads only what the output needs, straight from
    the checkpoint's files: the only disk it uses is the output's."""
    src, dst = Path(src), Path(dst)
    if dst.exists() or dst.is_symlink():
        raise FileExistsError(f"{dst}: already exists; choose another destination")
    from fsdp_cli.checkpoint.untrusted import check_checkpoint

    check_complete(src)
    check_checkpoint(src)  # a crafted checkpoint is refused whole, also where the output needs less of it
    dst.parent.mkdir(parents=True, exist_ok=True)
    partial = _claim(dst, folder=to in FOLDERS)
    try:
        ckpt = load(src, weights_only_model=to in ("safetensors", "hf", "peft"))
        if to == "hf":
            save_hf(ckpt, partial, hf_config, merge=merge)
        elif to == "peft":
            try:
                save_peft(ckpt, partial)
            except CheckpointFormatError as err:
                raise CheckpointFormatError(f"{src}: {err}") from None
        else:
            {"full": save_full, "sharded": save_sharded, "safetensors": save_safetensors}[to](ckpt, partial)
        _publish(partial, dst)
    except BaseException:
        remove_path(partial)  # ours: claimed above
        raise
    return dst


def _publish(partial: Path, dst: Path) -> None:
    """Flushed, then renamed: a conversion killed before this leaves only ``DST.partial``."""
    from fsdp_cli.checkpoint.atomic import publish_new

    fsync_tree(partial)
    phases.reached("convert")
    try:
        publish_new(partial, dst)
    except FileExistsError:
        raise FileExistsError(
            f"{dst}: created by something else while converting; left as it is, nothing written"
        ) from None


def _claim(dst: Path, *, folder: bool) -> Path:
    """Create ``DST.partial`` (a folder or an empty file), refusing one that exists: it belongs
    to a conversion that was interrupted, or to one still running."""
    partial = dst.with_name(dst.name + PARTIAL_SUFFIX)
    try:
        partial.mkdir() if folder else partial.touch(exist_ok=False)
    except FileExistsError:
        raise FileExistsError(
            f"{partial}: exists (left by an interrupted conversion, or one still running); "
            "hint: if no conversion is running, remove it and run again"
        ) from None
    return partial


def _manifest_as(manifest: dict[str, Any] | None, fmt: str, folder: Path | None = None) -> dict[str, Any]:
    """The source's manifest for the new format; a sharded folder lists its own files."""
    out = dict(manifest or {})
    out["format"] = fmt
    out.pop("files", None)
    out.pop(PARAMETER_NAMES_KEY, None)  # (a full file's; save_full lists its own)
    if folder is not None:
        out["files"] = file_records(folder, sorted(p.name for p in folder.iterdir() if p.is_file()))
    return out


def _read_json(path: Path) -> dict[str, Any] | None:
    import json

    return json.loads(path.read_text()) if path.is_file() else None
