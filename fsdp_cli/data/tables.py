"""Records from columnar files: Parquet, and the Arrow files of a Hugging Face ``datasets`` folder.

Public instruction and pretraining data arrive as Parquet (the Hub's own format) or as a folder
written by ``datasets``' ``save_to_disk`` (``state.json``, ``dataset_info.json`` and
``data-*.arrow``: Arrow IPC streams). ``data=jsonl`` and ``data=chat`` read them row by row with
pyarrow (the library ``datasets`` keeps them in; ``pip install ".[parquet]"``), one record
batch at a time, never whole: each row is the dict a JSON line would be, checked and cached by
the same code, and named ``FILE:row N`` in errors.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fsdp_cli.errors import ConfigError
from fsdp_cli.extras import install_hint

TABLE_SUFFIXES = (".parquet", ".arrow")
BATCH_ROWS = 1024


def is_table(file: Path) -> bool:
    return file.suffix in TABLE_SUFFIXES


def check_not_splits(key: str, path: str) -> None:
    """A folder of a ``DatasetDict`` (``dataset_dict.json``: one subfolder per split) is refused:
    reading it whole would mix its splits."""
    listing = Path(path) / "dataset_dict.json"
    if not listing.is_file():
        return
    try:
        splits = json.loads(listing.read_text()).get("splits") or []
    except (OSError, ValueError, AttributeError):
        splits = []
    named = ", ".join(map(str, splits)) or "its splits"
    first = splits[0] if splits else "train"
    raise ConfigError(
        key,
        path,
        f"a datasets DatasetDict folder (splits {named}): reading it whole would mix them",
        hint=f"name one split's folder: {key}={Path(path) / str(first)}",
    )


def pyarrow_or_error(key: str, file: Path) -> Any:
    try:
        import pyarrow
    except ImportError:
        raise ConfigError(
            key, str(file), "reading Parquet and Arrow files needs pyarrow", hint=install_hint("parquet")
        ) from None
    return pyarrow


def table_rows(file: Path, key: str) -> Iterator[tuple[Any, str, int]]:
    """(row as a dict, ``FILE:row N``, its share of the file's bytes) of every row of ``file``."""
    share = file.stat().st_size
    rows = _row_count(file, key)
    each = share // max(1, rows)
    number = 0
    for batch in _batches(file, key):
        for record in batch.to_pylist():
            number += 1
            yield record, f"{file}:row {number}", each


def _batches(file: Path, key: str) -> Iterator[Any]:
    pa = pyarrow_or_error(key, file)
    try:
        if file.suffix == ".parquet":
            import pyarrow.parquet as pq

            yield from pq.ParquetFile(str(file)).iter_batches(batch_size=BATCH_ROWS)
            return
        with pa.memory_map(str(file)) as source:
            yield from _arrow_reader(pa, source)
    except (pa.ArrowInvalid, OSError) as err:
        raise ConfigError(key, str(file), f"not a readable {file.suffix[1:]} file ({err})") from None


def _arrow_reader(pa: Any, source: Any) -> Any:
    """An Arrow IPC stream (what ``datasets`` writes), else an Arrow IPC file."""
    try:
        return pa.ipc.open_stream(source)
    except pa.ArrowInvalid:
        source.seek(0)
        return pa.ipc.open_file(source)


def _row_count(file: Path, key: str) -> int:
    pa = pyarrow_or_error(key, file)
    try:
        if file.suffix == ".parquet":
            import pyarrow.parquet as pq

            return int(pq.ParquetFile(str(file)).metadata.num_rows)
        with pa.memory_map(str(file)) as source:
            return sum(batch.num_rows for batch in _arrow_reader(pa, source))
    except (pa.ArrowInvalid, OSError) as err:
        raise ConfigError(key, str(file), f"not a readable {file.suffix[1:]} file ({err})") from None
