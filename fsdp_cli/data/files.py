"""Which files a ``data.path`` names, and what can be known about them without torch.

The parent runs these checks before any rank starts (bad data is one line and exit status 2);
the ranks read the same files through the same functions.
"""

from __future__ import annotations

import glob
import importlib.util
import math
import os
import sysconfig
from pathlib import Path

from fsdp_cli.data.tables import check_not_splits, is_table
from fsdp_cli.errors import ConfigError
from fsdp_cli.extras import install_hint

TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst")
"""What ``data=text`` reads from a folder."""
HELD_OUT_FRACTION = 0.05
"""The tail of a text corpus kept for validation."""
TOKEN_SUFFIXES = (".bin",)
"""What ``data=tokens`` reads from a folder."""
RECORD_SUFFIXES = (".jsonl", ".parquet", ".arrow")
"""What ``data=jsonl`` and ``data=chat`` read: JSON lines, Parquet, a ``datasets`` folder's Arrow files
(:mod:`fsdp_cli.data.tables`)."""
"""What ``data=jsonl`` reads from a folder."""
ITEM_SIZES = {"uint16": 2, "uint32": 4}
MAX_SCANNED_TOKENS = 1 << 28
"""The token-id range check reads at most this many tokens of the first file (512 MiB of uint16)."""


def text_files(path: str | None) -> list[Path]:
    """The files a ``data.path`` names: a file, a folder (its text files, recursively) or a glob;
    None = the Python standard library sources on this machine."""
    if path is None:
        path = sysconfig.get_paths()["stdlib"]
    return matching_files(path, TEXT_SUFFIXES)


def matching_files(path: str, suffixes: tuple[str, ...]) -> list[Path]:
    """A file, a folder (its files with one of ``suffixes``, recursively) or a glob, sorted."""
    if os.path.isfile(path):
        return [Path(path)]
    if os.path.isdir(path):
        return sorted(p for p in Path(path).rglob("*") if p.suffix in suffixes and p.is_file())
    return sorted(Path(p) for p in glob.glob(path, recursive=True) if os.path.isfile(p))


def existing_files(key: str, path: str | None, suffixes: tuple[str, ...], kind: str) -> list[Path]:
    """The non-empty files ``path`` names; a :class:`ConfigError` on ``key`` if there are none or one is empty."""
    if not path:
        raise ConfigError(key, None, f"data={kind} needs files to read", hint=f"{key}=GLOB")
    if os.path.isdir(path) and ".arrow" in suffixes:
        check_not_splits(key, path)
    files = matching_files(path, suffixes)
    if not files:
        wanted = "/".join(f"*{s}" for s in suffixes)
        raise ConfigError(
            key, path, "matches no file", hint=f"give a file, a folder (of {wanted} files) or a glob"
        )
    empty = [f for f in files if f.stat().st_size == 0]
    if empty:
        raise ConfigError(key, path, f"{empty[0]} is empty", hint="remove empty files from the glob")
    tables = [f for f in files if is_table(f)]
    if tables and importlib.util.find_spec("pyarrow") is None:
        raise ConfigError(
            key, str(tables[0]), "reading Parquet and Arrow files needs pyarrow", hint=install_hint("parquet")
        )
    return files


def token_counts(key: str, files: list[Path], dtype: str) -> list[int]:
    """Tokens per file; a :class:`ConfigError` when a file's size is not a whole number of items."""
    size = ITEM_SIZES[dtype]
    counts = []
    for file in files:
        nbytes = file.stat().st_size
        if nbytes % size:
            other = "uint32" if dtype == "uint16" else "uint16"
            raise ConfigError(
                key,
                str(file),
                f"holds {nbytes} bytes, not a whole number of {dtype} tokens ({size} bytes each)",
                allowed="uint16, uint32",
                hint=f"data.dtype={other} if that is how the file was written",
            )
        counts.append(nbytes // size)
    return counts


def check_token_files(
    key: str, path: str | None, *, dtype: str, seq_len: int, vocab_size: int | None
) -> list[Path]:
    """Everything checkable about a flat token corpus before training: files exist and are not
    empty, sizes fit the dtype, one window of ``seq_len + 1`` fits, and the first file holds no
    token id the model cannot embed."""
    files = existing_files(key, path, TOKEN_SUFFIXES, "tokens")
    total = sum(token_counts(key, files, dtype))
    check_enough_tokens(key, path, total, seq_len)
    if vocab_size is not None:
        check_token_range(key, files[0], dtype, vocab_size)
    return files


def check_enough_tokens(key: str, path: str | None, total: int, seq_len: int) -> None:
    if total < seq_len + 1:
        raise ConfigError(
            key,
            path,
            f"holds {total} tokens, fewer than data.seq_len + 1 = {seq_len + 1}",
            hint="point at a larger corpus or lower data.seq_len",
        )


def check_token_range(key: str, file: Path, dtype: str, vocab_size: int) -> None:
    """Every token id in (the first ``MAX_SCANNED_TOKENS`` of) ``file`` is below ``vocab_size``."""
    import numpy as np

    tokens = np.memmap(file, dtype=dtype, mode="r")
    largest = int(tokens[:MAX_SCANNED_TOKENS].max())
    if largest >= vocab_size:
        raise ConfigError(
            key,
            str(file),
            f"holds token id {largest}, not below data.vocab_size={vocab_size}",
            hint="the files were tokenized for another vocabulary, or data.dtype does not match how they were written",
        )


def text_bytes(files: list[Path], max_bytes: int) -> int:
    """How many bytes of text ``read_corpus`` will read from ``files`` (from their sizes)."""
    total = 0
    for file in files:
        total += file.stat().st_size
        if total >= max_bytes:
            return max_bytes
    return total


def check_text_corpus(path: str | None, *, max_bytes: int, seq_len: int, validating: bool) -> None:
    """``data=text``'s corpus exists and holds enough bytes for one training window (and, with
    ``validating``, one held-out window): counted from file sizes in the parent, not after the
    ranks started. (``path=None``: Python's own sources, always enough.)"""
    if path is None:
        return
    files = text_files(path)
    if not files:
        raise ConfigError(
            "data.path",
            path,
            "matches no file",
            hint="give a file, a folder or a glob; null = Python's own sources",
        )
    if max_bytes < 1:
        raise ConfigError("data.max_bytes", max_bytes, "must be at least 1")
    total = text_bytes(files, max_bytes)
    if total == 0:
        raise ConfigError(
            "data.path",
            path,
            f"the {len(files)} matching file(s) are all empty",
            hint="point data.path at files that hold text",
        )
    train = int(total * (1 - HELD_OUT_FRACTION))
    need = seq_len + 2  # one window of seq_len + 1 bytes, and somewhere to start it
    short = (
        "training"
        if train < need
        else ("held-out (validation)" if validating and total - train < need else None)
    )
    if short is not None:
        minimum = math.ceil(need / (HELD_OUT_FRACTION if validating else 1 - HELD_OUT_FRACTION))
        raise ConfigError(
            "data.path",
            path,
            f"{total} bytes of text leave the {short} part shorter than a window of data.seq_len + 1 = "
            f"{seq_len + 1} bytes",
            allowed=f"at least {minimum} bytes of text (data.max_bytes={max_bytes})",
            hint="point data.path at more text or lower data.seq_len",
        )
