"""Reading a checkpoint that may come from elsewhere without running any of its code.

A checkpoint is input like any other file: whoever hands it over may have crafted it (its
manifest's checksums prove nothing, since they write the manifest too). Every read of a
checkpoint goes through this module, which unpickles only what a checkpoint legitimately holds:

* DCP ``.metadata`` (pickled by torch): :class:`RestrictedUnpickler`, which admits only
  :data:`ALLOWED`: torch.distributed.checkpoint's own metadata classes, ``torch.Size``, dtypes,
  layouts, paths, ``OrderedDict``, sets. The file names it lists must lie inside the folder.
* DCP byte entries (non-tensor values, e.g. an optimizer's ``param_groups``):
  ``torch.load(weights_only=True)`` (:class:`SafeLoadPlanner`; torch's own planner uses
  ``weights_only=False``). Tensor entries torch already reads with ``weights_only=True``.
* ``meta.pt`` and full (one-file) checkpoints: ``torch.load(weights_only=True)``
  (:func:`~fsdp_cli.checkpoint.format.torch_load`). torch's allowlist is extended only by what the user's own code registers
  with ``torch.serialization.add_safe_globals``.

Anything else is refused with :class:`UnsafeCheckpointError`: one line naming the file and the
class it tried to load, before anything of it is used.
"""

from __future__ import annotations

import collections
import io
import pathlib
import pickle
import warnings
from pathlib import Path
from typing import IO, Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from fsdp_cli.checkpoint.format import (
    DCP_METADATA,
    META_FILE,
    CheckpointFormatError,
    UnsafeCheckpointError,
    refused,
    torch_load,
    unsafe_globals,
)
from fsdp_cli.compat.torch_internals import DCP_METADATA_INTERNALS

_PUBLIC_METADATA = (
    "Metadata",
    "StorageMeta",
    "MetadataIndex",
    "TensorProperties",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
)
ALLOWED: dict[tuple[str, str], Any] = {
    **{(dcp_metadata.__name__, name): getattr(dcp_metadata, name) for name in _PUBLIC_METADATA},
    **DCP_METADATA_INTERNALS,
    ("torch", "Size"): torch.Size,
    **{("torch", name): value for name, value in vars(torch).items() if isinstance(value, torch.dtype)},
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    # StorageMeta.checkpoint_id: the path the checkpoint was saved to (a path object is inert)
    **{
        ("pathlib", name): getattr(pathlib, name)
        for name in ("PosixPath", "PurePosixPath", "PureWindowsPath")
    },
}
"""What a DCP ``.metadata`` pickle may name: (module, name) -> the object it stands for."""


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickles only :data:`ALLOWED` globals; anything else raises :class:`UnsafeCheckpointError`."""

    def __init__(self, file: IO[bytes], source: Path) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        try:
            return ALLOWED[(module, name)]
        except KeyError:
            raise refused(self.source, f"{module}.{name}") from None

    def persistent_load(self, pid: Any) -> Any:
        raise refused(self.source, "a persistent id (torch storages do not belong in DCP metadata)")


def read_metadata(folder: Path) -> dcp_metadata.Metadata:
    """A DCP folder's ``.metadata`` through :class:`RestrictedUnpickler`, its files inside ``folder``."""
    file = Path(folder) / DCP_METADATA
    try:
        with open(file, "rb") as fh:
            metadata = RestrictedUnpickler(fh, file).load()
    except UnsafeCheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - truncated or not a pickle: one line, whatever failed
        raise CheckpointFormatError(
            f"{file}: unreadable DCP metadata ({type(err).__name__}: {err})"
        ) from None
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise CheckpointFormatError(f"{file}: holds a {type(metadata).__name__}, not DCP metadata")
    _check_confined(folder, file, metadata)
    return metadata


def _check_confined(folder: Path, file: Path, metadata: dcp_metadata.Metadata) -> None:
    """Every shard file ``.metadata`` names lies inside ``folder`` (no ``../x``, no absolute path)."""
    root = Path(folder).resolve()
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if (
            not isinstance(name, str)
            or Path(name).is_absolute()
            or not (root / name).resolve().is_relative_to(root)
        ):
            raise UnsafeCheckpointError(
                f"{file}: names a shard file outside the checkpoint folder ({name!r}); refused"
            )


class SafeFileSystemReader(FileSystemReader):
    """torch's FileSystemReader, reading ``.metadata`` with :func:`read_metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        metadata = read_metadata(Path(self.path))
        # (as torch's reader does: a load identifies itself in the metadata it hands on)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """torch's DefaultLoadPlanner, reading byte entries with :func:`load_value`."""

    def __init__(self, folder: Path, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.folder = Path(folder)

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        info = (self.metadata.storage_data or {}).get(read_item.storage_index) if self.metadata else None
        obj = load_value(value, self.folder / getattr(info, "relative_path", DCP_METADATA), fqn)
        # (into the caller's dict: torch's planner writes unflattened values into a copy of it)
        put(self.original_state_dict, self.mappings[fqn] if self.flatten_state_dict else (fqn,), obj)


def load_value(value: IO[bytes], file: Path, key: str) -> Any:
    """One byte entry, weights only; refused in one line naming the file, the key and the class."""
    try:
        return torch.load(value, weights_only=True)
    except pickle.UnpicklingError:
        raise refused(file, f"{unsafe_globals(value)} (entry {key})") from None
    except Exception as err:  # noqa: BLE001 - corrupted bytes: damaged, in one line
        raise CheckpointFormatError(
            f"{file}: entry {key} is unreadable ({type(err).__name__}: {err})"
        ) from None


def put(tree: Any, path: tuple[Any, ...], value: Any) -> None:
    """Set ``tree[path[0]][path[1]]... = value``, creating dicts (str keys) and lists (int keys)."""
    node = tree
    for key, after in zip(path[:-1], path[1:]):
        node = _child(node, key, [] if isinstance(after, int) else {})
    if isinstance(node, list):
        _child(node, path[-1], None)
    node[path[-1]] = value


def _child(node: Any, key: Any, empty: Any) -> Any:
    if isinstance(node, list):
        node.extend([None] * (key + 1 - len(node)))
        if node[key] is None:
            node[key] = empty
        return node[key]
    return node.setdefault(key, empty)


def dcp_load(state: dict[str, Any], folder: Path, *, flat: bool = False, no_dist: bool = False) -> None:
    """``torch.distributed.checkpoint.load`` through :class:`SafeFileSystemReader` and
    :class:`SafeLoadPlanner` (``flat``: ``state`` is keyed by DCP's flattened names)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(
            state,
            storage_reader=SafeFileSystemReader(str(folder)),
            planner=SafeLoadPlanner(folder, flatten_state_dict=not flat),
            no_dist=no_dist,
        )
    except CheckpointException as err:  # every rank's failures, gathered: ours are one line
        failures = [e for e, _ in err.failures.values() if isinstance(e, CheckpointFormatError)]
        if not failures:
            raise
        refusals = [e for e in failures if isinstance(e, UnsafeCheckpointError)]
        raise (refusals or failures)[0] from None


def read_entries(folder: Path, metadata: dcp_metadata.Metadata, keys: list[str]) -> dict[str, Any]:
    """The entries ``keys`` (DCP's flattened names) of a folder, tensors allocated whole on CPU,
    without a process group."""
    flat: dict[str, Any] = {}
    for key in keys:
        info = metadata.state_dict_metadata[key]
        is_tensor = isinstance(info, dcp_metadata.TensorStorageMetadata)
        flat[key] = torch.empty(info.size, dtype=info.properties.dtype) if is_tensor else None
    if flat:
        # Offline on purpose: DCP's note that no process group exists is noise.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable")
            dcp_load(flat, folder, flat=True, no_dist=True)
    return flat


def unflatten(flat: dict[str, Any], metadata: dcp_metadata.Metadata) -> dict[str, Any]:
    """DCP's flattened names back to the nested state dict they were saved from."""
    paths = metadata.planner_data or {}
    tree: dict[str, Any] = {}
    for key, value in flat.items():
        put(tree, tuple(paths.get(key) or (key,)), value)
    return tree


def check_sharded(folder: Path) -> dcp_metadata.Metadata:
    """A DCP folder checked before anything else reads it (Lightning's own loaders included):
    its ``.metadata`` through the allowlist, every byte entry and ``meta.pt`` weights only.
    Tensors are not read."""
    metadata = read_metadata(folder)
    values = [
        k for k, v in metadata.state_dict_metadata.items() if isinstance(v, dcp_metadata.BytesStorageMetadata)
    ]
    read_entries(folder, metadata, values)
    if (Path(folder) / META_FILE).is_file():
        torch_load(Path(folder) / META_FILE, map_location="cpu")
    return metadata


def check_checkpoint(path: Path | str) -> None:
    """Any checkpoint checked as :func:`check_sharded` or, a full file, loaded weights only
    (memory-mapped: tensors are not read)."""
    from fsdp_cli.checkpoint.format import checkpoint_format
    from fsdp_cli.checkpoint_format import CheckpointFormat

    if checkpoint_format(path) is CheckpointFormat.sharded:
        check_sharded(Path(path))
    else:
        torch_load(path, map_location="cpu", mmap=True)
