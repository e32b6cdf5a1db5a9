"""Which files a ``data.path`` names. Torch-free: the parent checks the path before launch with
the same function the ranks read the corpus with."""

from __future__ import annotations

import glob
import os
import sysconfig
from pathlib import Path

TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst")
"""What ``data=text`` reads from a folder."""
HELD_OUT_FRACTION = 0.05
"""The tail of a text corpus kept for validation."""


def text_files(path: str | None) -> list[Path]:
    """The files a ``data.path`` names: a file, a folder (its text files, recursively) or a glob;
    None = the Python standard library sources on this machine."""
    if path is None:
        path = sysconfig.get_paths()["stdlib"]
    if os.path.isfile(path):
        return [Path(path)]
    if os.path.isdir(path):
        return sorted(p for p in Path(path).rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file())
    return sorted(Path(p) for p in glob.glob(path, recursive=True) if os.path.isfile(p))


def text_bytes(files: list[Path], max_bytes: int) -> int:
    """How many bytes of text ``read_corpus`` will read from ``files`` (from their sizes)."""
    total = 0
    for file in files:
        total += file.stat().st_size
        if total >= max_bytes:
            return max_bytes
    return total
