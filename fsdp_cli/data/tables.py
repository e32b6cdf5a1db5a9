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


def table_rows(file: Path, key: str) -> Iterator[tuple[Any, str, int]]:
    """(row as a dict, ``FILE:row N``, its share of the file's bytes) of every row of ``file``, in
    one pass. (pyarrow's presence was checked with the files: :func:`fsdp_cli.data.files.existing_files`.)"""
    import pyarrow as pa

    number = 0
    try:
        for batch, nbytes in _batches(pa, file):
            records = batch.to_pylist()
            for i, record in enumerate(records):
                number += 1
                last = i == len(records) - 1
                yield (
                    record,
                    f"{file}:row {number}",
                    nbytes // len(records) + (nbytes % len(records) if last else 0),
                )
    except (pa.ArrowInvalid, OSError) as err:
        raise ConfigError(key, str(file), f"not a readable {file.suffix[1:]} file ({err})") from None


def _batches(pa: Any, file: Path) -> Iterator[tuple[Any, int]]:
    """Record batches, each with the bytes of the file it came from (about: a Parquet file's
    share by rows, from its footer; an Arrow stream's, by the position read up to)."""
    size = file.stat().st_size
    if file.suffix == ".parquet":
        import pyarrow.parquet as pq

        parquet = pq.ParquetFile(str(file))
        rows = max(1, parquet.metadata.num_rows)
        for batch in parquet.iter_batches(batch_size=BATCH_ROWS):
            yield batch, size * batch.num_rows // rows
        return
    with pa.memory_map(str(file)) as source:
        try:
            stream = pa.ipc.open_stream(source)  # what ``datasets`` writes
        except pa.ArrowInvalid:
            source.seek(0)
            reader = pa.ipc.open_file(source)  # an Arrow IPC file
            for index in range(reader.num_record_batches):
                yield reader.get_batch(index), size // max(1, reader.num_record_batches)
            return
        read = source.tell()
        for batch in stream:
            yield batch, source.tell() - read
            read = source.tell()
