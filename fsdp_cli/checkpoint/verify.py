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
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdp_cli.checkpoint.atomic import file_record
from fsdp_cli.checkpoint.format import MANIFEST_FILE, CheckpointFormatError, checkpoint_format


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
        checked = "sizes and checksums" if self.deep else "sizes"
        step = "?" if self.step is None else self.step
        return f"{self.path}: ok ({self.format}, step {step}, {self.files} file(s), {self.bytes / 2**20:.1f} MiB, {checked} checked)"


def verify_checkpoint(path: str | Path, *, deep: bool = False) -> Verified:
    """:class:`Verified`, or :class:`CheckpointFormatError` naming the first problem."""
    path = Path(path)
    if checkpoint_format(path) == "sharded":
        return _verify_sharded(path, deep)
    return _verify_full(path, deep)


def _verify_sharded(path: Path, deep: bool) -> Verified:
    manifest = _manifest(path)
    files = manifest.get("files")
    if not isinstance(files, dict):
        return _verify_sharded_without_sizes(path, manifest)
    total = 0
    for name, record in sorted(files.items()):
        _check_record(path, name, record)
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


def _check_record(path: Path, name: str, record: Any) -> None:
    """A manifest's file record: a plain name inside the checkpoint, with an integer size and a
    checksum; anything else is a damaged (or foreign) manifest, one line naming the entry."""
    if not name or Path(name).is_absolute() or ".." in Path(name).parts:
        raise CheckpointFormatError(f"{path}: {MANIFEST_FILE} lists {name!r}, outside the checkpoint")
    size = record.get("size") if isinstance(record, dict) else None
    if not isinstance(size, int) or isinstance(size, bool) or not isinstance(record.get("crc32"), str):
        raise CheckpointFormatError(
            f"{path}: {MANIFEST_FILE} has a malformed record for {name} ({record!r}; expected size and crc32)"
        )


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
    step = None
    if deep:
        from fsdp_cli.checkpoint.format import read_manifest

        step = (read_manifest(path) or {}).get("step")
    return Verified(path, "full", step, 1, path.stat().st_size, deep)
