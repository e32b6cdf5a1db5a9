"""Is a checkpoint complete and intact? (``fsdp-ckpt verify`` and ``resume=auto``; torch-free.)

* sharded: ``manifest.json`` parses and lists every file of the checkpoint (shards,
  ``.metadata``, ``meta.pt``) with its size and CRC-32; each must be present with that size
  (``deep``: and that checksum). Checkpoints from before manifests listed their files are
  checked against DCP's ``.metadata`` instead (that needs torch).
* full: a ``torch.save`` file is a zip archive; its directory (at the end of the file, so a
  truncated file has none) must list the pickled object (``deep``: every member's CRC-32 matches).
"""

from __future__ import annotations

import json
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdp_cli.checkpoint.atomic import file_record
from fsdp_cli.checkpoint.format import MANIFEST_FILE, CheckpointFormatError, checkpoint_format
from fsdp_cli.checkpoint_format import CheckpointFormat


@dataclass(frozen=True)
class Verified:
    """What a successful check found."""

    path: Path
    format: str
    step: int | None
    files: int
    bytes: int
    deep: bool

    def describe(self) -> str:
        checked = {
            ("safetensors", False): "header and offsets",
            ("safetensors", True): "header, offsets and every tensor",
        }.get((self.format, self.deep), "sizes and checksums" if self.deep else "sizes")
        step = "?" if self.step is None else self.step
        return f"{self.path}: ok ({self.format}, step {step}, {self.files} file(s), {self.bytes / 2**20:.1f} MiB, {checked} checked)"


class ManifestError(CheckpointFormatError):
    """A manifest that is not one fsdp-train writes (a malformed record, a path outside the
    checkpoint): the checkpoint cannot be checked at all, rather than found damaged."""


def verify_checkpoint(path: str | Path, *, deep: bool = False) -> Verified:
    """:class:`Verified`, or :class:`CheckpointFormatError` naming the first problem."""
    path = Path(path)
    if path.suffix == SAFETENSORS_SUFFIX and path.is_file():
        return _verify_safetensors(path, deep)
    if checkpoint_format(path) is CheckpointFormat.sharded:
        return _verify_sharded(path, deep)
    return _verify_full(path, deep)


def _verify_sharded(path: Path, deep: bool) -> Verified:
    manifest = _manifest(path)
    files = manifest.get("files")
    if files is None:
        return _verify_sharded_without_sizes(path, manifest)
    _check_records(path, files)
    total = 0
    for name, record in sorted(files.items()):
        file = path / name
        if not file.is_file():
            raise CheckpointFormatError(f"{path}: {name} is missing (the manifest lists it)")
        size = file.stat().st_size
        if size != record["size"]:
            raise CheckpointFormatError(
                f"{path}: {name} has {size} bytes, the manifest records {record['size']}"
            )
        if deep and file_record(file)["crc32"] != record["crc32"]:
            raise CheckpointFormatError(f"{path}: {name} does not match its recorded checksum (corrupted)")
        total += size
    return Verified(path, "sharded", manifest.get("step"), len(files), total, deep)


def check_step(path: Path, manifest: dict[str, Any]) -> None:
    """Every manifest fsdp-train writes records the step it was saved at; resume needs it."""
    step = manifest.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointFormatError(
            f"{path}: {MANIFEST_FILE} records no step ({'missing' if step is None else repr(step)}); "
            "not written by fsdp-train, or edited"
        )


def _manifest(path: Path) -> dict[str, Any]:
    file = path / MANIFEST_FILE
    if not file.is_file():
        raise CheckpointFormatError(
            f"{path}: no {MANIFEST_FILE} (the save did not finish, or not written by fsdp-train)"
        )
    try:
        manifest = json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointFormatError(f"{path}: {MANIFEST_FILE} is unreadable ({err})") from None
    if not isinstance(manifest, dict):
        raise CheckpointFormatError(f"{path}: {MANIFEST_FILE} is not a JSON object")
    check_step(path, manifest)
    return manifest


def _check_records(path: Path, files: Any) -> None:
    """Each record ``{name: {"size": int, "crc32": "8 hex digits"}}``, each name a file inside the
    checkpoint folder (no ``../x``, no absolute path): :class:`ManifestError` otherwise."""
    where = path / MANIFEST_FILE
    if not isinstance(files, dict):
        raise ManifestError(
            f"{where}: 'files' is a {type(files).__name__}, not a mapping of file name to record"
        )
    root = path.resolve()
    for name, record in files.items():
        if Path(name).is_absolute() or not (root / name).resolve().is_relative_to(root):
            raise ManifestError(f"{where}: names a file outside the checkpoint folder ({name!r}); refused")
        size, crc = (record.get("size"), record.get("crc32")) if isinstance(record, dict) else (None, None)
        if not (
            type(size) is int and size >= 0 and isinstance(crc, str) and re.fullmatch(r"[0-9a-f]{8}", crc)
        ):
            raise ManifestError(
                f"{where}: the record of {name!r} is {json.dumps(record)[:80]}, "
                'not {"size": <bytes>, "crc32": "<8 hex digits>"}'
            )


def _verify_sharded_without_sizes(path: Path, manifest: dict[str, Any]) -> Verified:
    from fsdp_cli.checkpoint.convert import check_complete

    check_complete(path)  # every file DCP's .metadata names is present
    files = [p for p in path.iterdir() if p.is_file()]
    return Verified(
        path, "sharded", manifest.get("step"), len(files), sum(p.stat().st_size for p in files), False
    )


def _verify_full(path: Path, deep: bool) -> Verified:
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
            if not any(n.endswith("/data.pkl") for n in names):
                raise CheckpointFormatError(
                    f"{path}: a zip file without a pickled object; not a torch checkpoint"
                )
            bad = archive.testzip() if deep else None
    except (zipfile.BadZipFile, OSError) as err:
        raise CheckpointFormatError(
            f"{path}: not an fsdp-train checkpoint, or a truncated one (not a complete zip archive: {err})"
        ) from None
    if bad is not None:
        raise CheckpointFormatError(f"{path}: member {bad} does not match its checksum (corrupted)")
    return Verified(path, "full", full_step(path), 1, path.stat().st_size, deep)


def full_step(path: Path) -> int | None:
    """The step a full file was saved at, as ``fsdp-ckpt inspect`` reads it: its manifest's, else
    Lightning's ``global_step`` (a plain Lightning ``.ckpt``). Only the pickled metadata is read:
    the file is memory-mapped, through the weights-only unpickler."""
    from fsdp_cli.checkpoint.format import MANIFEST_KEY, load_full

    data = load_full(path)
    if not isinstance(data, dict):
        return None
    step = (data.get(MANIFEST_KEY) or {}).get("step", data.get("global_step"))
    return step if isinstance(step, int) and not isinstance(step, bool) else None


SAFETENSORS_SUFFIX = ".safetensors"


def _verify_safetensors(path: Path, deep: bool) -> Verified:
    """A safetensors file (``fsdp-ckpt convert --to safetensors``): its header parses and its
    tensors' offsets cover the file exactly (the safetensors library checks both on opening);
    ``deep``: every tensor is read."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as weights:
            step = (weights.metadata() or {}).get("step")
            for key in weights.keys() if deep else ():
                weights.get_tensor(key)
    except Exception as err:  # noqa: BLE001 - SafetensorError, OSError: damaged either way
        raise CheckpointFormatError(
            f"{path}: not a complete safetensors file ({type(err).__name__}: {err})"
        ) from None
    step_number = int(step) if isinstance(step, str) and step.isdigit() else None
    return Verified(path, "safetensors", step_number, 1, path.stat().st_size, deep)
