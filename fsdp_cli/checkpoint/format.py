"""On-disk checkpoint formats, shared by the strategies and the ``fsdp-ckpt`` tool.

* **sharded**: a folder written by torch.distributed.checkpoint (DCP) — ``.metadata`` plus one
  ``*.distcp`` file per writing rank — holding ``state_dict`` (model) and ``optimizer_states``;
  beside them ``meta.pt`` (the rest of Lightning's checkpoint: loops, schedulers, callbacks) and
  ``manifest.json``. Plain ``torch.distributed.checkpoint`` tools read it.
* **full**: one ``torch.save`` file with the whole model and optimizer state, keyed by parameter
  name, and the manifest under ``MANIFEST_KEY``; loadable with ``torch.load(weights_only=True)``.

Both are written under a temporary name and renamed when complete, so a checkpoint that is
visible is whole; ``*.partial`` names are leftovers of interrupted saves.

Keys are the model's parameter names as ``torch.distributed.checkpoint.state_dict`` reports
them (wrapper prefixes of DDP, FSDP, activation checkpointing and compile removed), so the
formats and layouts are interchangeable.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from fsdp_cli.checkpoint_format import CheckpointFormat
from fsdp_cli.errors import RunFailure

META_FILE = "meta.pt"
MANIFEST_FILE = "manifest.json"
DCP_METADATA = ".metadata"
MANIFEST_KEY = "fsdp_cli_manifest"
PARTIAL_SUFFIX = ".partial"
FULL_SUFFIX = ".pt"


NOT_ALLOWED = (
    "not a class a checkpoint holds (only DCP metadata, tensors and plain values are unpickled; "
    "a crafted checkpoint runs code when loaded otherwise, torch.load(weights_only=False) included)"
)
"""Why a refused checkpoint is refused, after the file and the class it named."""


class CheckpointFormatError(ValueError):
    """A path that is not a complete checkpoint."""


class UnsafeCheckpointError(CheckpointFormatError, RunFailure):
    """A checkpoint that would run code, or read files outside its folder, if it were loaded
    (:mod:`fsdp_cli.checkpoint.untrusted`). Never skipped as merely damaged: a
    :class:`CheckpointFormatError` for the tools and the parent (``fsdp-ckpt`` exits 2, ``resume``
    is a one-line config error) and a :class:`~fsdp_cli.errors.RunFailure` in the ranks
    (summary.json's error is its one line)."""


def refused(file: Path | str, what: str) -> UnsafeCheckpointError:
    """The one line for a ``file`` that tried to load ``what`` (a class, a function)."""
    return UnsafeCheckpointError(f"{file}: refused to load {what}: {NOT_ALLOWED}")


def torch_load(path: Path | str, **kwargs: Any) -> Any:
    """``torch.load(path, weights_only=True, ...)``, refused in one line naming the class: how
    ``meta.pt`` and full files are read (part of :mod:`fsdp_cli.checkpoint.untrusted`'s boundary,
    kept here, torch-free until called, for :func:`load_full`)."""
    import pickle

    import torch

    try:
        return torch.load(path, weights_only=True, **kwargs)
    except pickle.UnpicklingError:
        raise refused(path, unsafe_globals(path)) from None


def unsafe_globals(source: Any) -> str:
    """The classes torch's weights-only unpickler would not admit, as one phrase."""
    import torch

    if hasattr(source, "seek"):
        source.seek(0)
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(source)
    except Exception:  # noqa: BLE001 - not even a torch file: say so rather than fail here
        names = []
    return ", ".join(names) if names else "an object torch's weights-only unpickler refuses"


def checkpoint_format(path: str | Path) -> CheckpointFormat:
    """The format of what is at ``path`` (a folder with DCP's metadata: sharded; a file: full);
    :class:`CheckpointFormatError` with a reason otherwise."""
    path = Path(path)
    if not path.exists():
        raise CheckpointFormatError(f"{path}: no such file or folder")
    if path.name.endswith(PARTIAL_SUFFIX):
        raise CheckpointFormatError(f"{path}: an incomplete save (interrupted before it was renamed)")
    if path.is_dir():
        if not (path / DCP_METADATA).is_file():
            # (Lightning's wording, "does not point to a valid checkpoint", is kept for its tests.)
            raise CheckpointFormatError(
                f"{path}: does not point to a valid checkpoint (a folder without {DCP_METADATA}, "
                "not a sharded checkpoint)"
            )
        return CheckpointFormat.sharded
    return CheckpointFormat.full


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + PARTIAL_SUFFIX)
    with open(tmp, "w") as fh:
        json.dump(data, fh, indent=2, sort_keys=True, default=str)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def fsync_tree(path: Path) -> None:
    """Flush every file under ``path`` (and ``path`` itself) to stable storage."""
    paths = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for file in paths:
        with open(file, "rb") as fh:
            os.fsync(fh.fileno())
    fsync_dir(path if path.is_dir() else path.parent)


def remove_path(path: Path) -> None:
    """Delete a checkpoint or a leftover of one, folder or file; nothing if it is not there."""
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_manifest(path: str | Path) -> dict[str, Any] | None:
    """The manifest of a checkpoint, or None if it has none."""
    path = Path(path)
    if checkpoint_format(path) is CheckpointFormat.sharded:
        file = path / MANIFEST_FILE
        return json.loads(file.read_text()) if file.is_file() else None
    data = load_full(path)
    return data.get(MANIFEST_KEY) if isinstance(data, dict) else None


def load_full(path: str | Path) -> Any:
    """``torch.load`` of a full checkpoint: weights only (nothing arbitrary is unpickled), memory-mapped."""
    try:
        return torch_load(path, map_location="cpu", mmap=True)
    except UnsafeCheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - any unreadable file is "not a checkpoint" to the user
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointFormatError(f"{path}: not an fsdp-train checkpoint (torch.load: {reason})") from None
