"""Making a finished save visible in one step, and recording what it wrote (torch-free).

A save is written under ``<name>.partial`` and renamed when complete. Replacing an existing
checkpoint of the same name (a run resumed at step N saves step N again) swaps the two in one
``renameat2(RENAME_EXCHANGE)`` where the filesystem supports it, so there is no moment without a
complete ``<name>``; elsewhere it falls back to two renames, and :func:`recover_interrupted_replace`
puts the old one back if a crash fell between them.

Each file of a sharded checkpoint is recorded with its size and CRC-32 in the manifest, so that
``fsdp-ckpt verify`` and ``resume=auto`` can tell a complete checkpoint from a damaged one.
"""

from __future__ import annotations

import ctypes
import errno
import os
import zlib
from pathlib import Path
from typing import Any

from fsdp_cli.checkpoint import phases
from fsdp_cli.checkpoint.format import DCP_METADATA, MANIFEST_FILE, PARTIAL_SUFFIX, fsync_dir, remove_path

OLD_SUFFIX = ".old" + PARTIAL_SUFFIX
"""The previous checkpoint while the two-rename fallback replaces it."""
_CHUNK = 16 * 2**20


def replace_atomically(partial: Path, path: Path) -> None:
    """Make ``partial`` visible as ``path``, replacing a checkpoint of that name if there is one."""
    if path.exists() and _exchange(partial, path):
        phases.reached("replace")
        remove_path(partial)  # now the previous checkpoint
    elif path.exists():
        old = path.with_name(path.name + OLD_SUFFIX)
        remove_path(old)
        os.replace(path, old)
        os.replace(partial, path)
        remove_path(old)
    else:
        os.replace(partial, path)
    fsync_dir(path.parent)


def publish(partial: Path, path: Path) -> None:
    """Make a finished sharded save visible: :func:`replace_atomically`, except into a folder
    that exists and holds files but no checkpoint (Lightning's sharded saves write into such a
    folder and keep what is there): the save's files are moved in, the manifest last."""
    if path.is_dir() and not (path / DCP_METADATA).exists() and any(path.iterdir()):
        names = sorted(p.name for p in partial.iterdir())
        for name in sorted(names, key=lambda n: n == MANIFEST_FILE):
            remove_path(path / name)
            os.replace(partial / name, path / name)
        remove_path(partial)
        fsync_dir(path)
        return
    replace_atomically(partial, path)


RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2
"""``renameat2`` flags (linux/fs.h)."""


def _renameat2(a: Path, b: Path, flag: int, unsupported: tuple[int, ...]) -> bool:
    """Linux ``renameat2(a, b, flag)``: True when done, False where the call or the flag is not
    available (``unsupported`` errnos); any other failure is an OSError naming ``b``."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), flag) == 0:
        return True
    code = ctypes.get_errno()
    if code in unsupported:
        return False
    if code == errno.EEXIST:
        raise FileExistsError(code, "created by something else meanwhile", str(b))
    raise OSError(code, os.strerror(code), str(b))


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically; False where that is not available."""
    return _renameat2(a, b, RENAME_EXCHANGE, (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EXDEV))


def recover_interrupted_replace(directory: Path) -> list[str]:
    """Restore checkpoints whose replacement by the two-rename fallback was interrupted between
    its renames; returns notices naming them."""
    notices = []
    if not directory.is_dir():
        return notices
    for old in directory.glob(f"*{OLD_SUFFIX}"):
        path = old.with_name(old.name[: -len(OLD_SUFFIX)])
        if not path.exists():
            os.replace(old, path)
            notices.append(f"note: restored {path.name}, whose replacement was interrupted")
    return notices


def file_record(path: Path) -> dict[str, Any]:
    """Size and CRC-32 of one file, as the manifest records it."""
    crc = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return {"size": path.stat().st_size, "crc32": f"{crc:08x}"}


def file_records(folder: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    return {name: file_record(folder / name) for name in names}


def publish_new(partial: Path, path: Path) -> None:
    """Rename ``partial`` to ``path``, which must not exist: never replaces what appeared there
    meanwhile (``renameat2(RENAME_NOREPLACE)``; elsewhere a hard link for a file, and for a folder
    a rename, which fails on a folder that holds files). FileExistsError if ``path`` exists."""
    if not _rename_noreplace(partial, path):
        if path.exists() or path.is_symlink():
            raise FileExistsError(errno.EEXIST, "created by something else meanwhile", str(path))
        if partial.is_dir():
            os.rename(partial, path)  # (an empty folder created in between would be replaced)
        else:
            os.link(partial, path)
            os.unlink(partial)
    fsync_dir(path.parent)


def _rename_noreplace(a: Path, b: Path) -> bool:
    """Rename without replacing what is at ``b`` (FileExistsError then); False where that is not available."""
    return _renameat2(a, b, RENAME_NOREPLACE, (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP))
