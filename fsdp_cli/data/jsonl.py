"""``data=jsonl``: JSON-lines documents tokenized once and cached as a flat token file.

The launching process tokenizes before any rank starts (a progress bar on the console, one-line
errors for bad lines), writes the tokens as ``<cache_dir>/<name>-<key>.<dtype>.bin`` with a
``.json`` description beside it, and the ranks memory-map that file exactly as ``data=tokens``
reads its files. The key hashes the input files (paths, sizes, modification times), the field,
the tokenizer and the end-of-text token, so a changed corpus or tokenizer is tokenized again and
an unchanged one never is. Torch-free: ``tokenizers`` and numpy only.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdp_cli.data.files import RECORD_SUFFIXES, check_enough_tokens, existing_files
from fsdp_cli.data.tables import is_table, table_rows
from fsdp_cli.errors import ConfigError
from fsdp_cli.extras import install_hint
from fsdp_cli.rundir.files import check_writable_folder, write_atomically

CACHE_DIR_NAME = ".fsdp_cli_tokens"
CACHE_VERSION = 1
BYTE_EOT = 0
"""Without a tokenizer, documents are UTF-8 bytes joined by byte 0 (which text never contains)."""
EOT_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
BATCH_BYTES = 4 << 20
"""Documents handed to the tokenizer at once (its Rust side encodes a batch in parallel)."""

Encoder = Callable[[list[str]], list[Any]]
"""Documents -> one sequence of token ids each (lists or arrays)."""


@dataclass(frozen=True)
class TokenizerSpec:
    """How documents become token ids: the tokenizer file (None for bytes), its end-of-text id and vocabulary."""

    file: Path | None
    eot_id: int
    vocab_size: int

    @property
    def dtype(self) -> str:
        return "uint16" if self.vocab_size <= 1 << 16 else "uint32"


# --------------------------------------------------------------------------- tokenizer


def tokenizer_spec(data: Any) -> TokenizerSpec:
    """The tokenizer ``data.tokenizer`` names (file or folder) and its end-of-text id; bytes when null."""
    if data.tokenizer is None:
        return TokenizerSpec(None, BYTE_EOT, 256)
    file = Path(data.tokenizer)
    if file.is_dir():
        file = file / "tokenizer.json"
    if not file.is_file():
        raise ConfigError(
            "data.tokenizer",
            data.tokenizer,
            "no tokenizer.json there",
            hint="a tokenizer.json file, or a folder holding one (e.g. the model folder)",
        )
    tokenizer = _load(file)
    name = data.eot_token or _eot_name(file.parent, tokenizer)
    eot = tokenizer.token_to_id(name) if name else None
    if eot is None:
        raise ConfigError(
            "data.eot_token",
            data.eot_token,
            f"no end-of-text token {'named ' + repr(name) if name else 'found'} in {file}",
            allowed="a token of the tokenizer's vocabulary",
            hint="data.eot_token='<|endoftext|>' (whatever the tokenizer ends documents with)",
        )
    return TokenizerSpec(file, int(eot), int(tokenizer.get_vocab_size(with_added_tokens=True)))


def _load(file: Path) -> Any:
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConfigError(
            "data.tokenizer",
            str(file),
            "needs the tokenizers package",
            hint=f"{install_hint('hf')}; or leave data.tokenizer=null for bytes",
        ) from None
    try:
        return Tokenizer.from_file(str(file))
    except Exception as err:  # noqa: BLE001 - any unreadable file is one line for the user
        raise ConfigError("data.tokenizer", str(file), f"not a tokenizer.json ({err})") from None


def _eot_name(folder: Path, tokenizer: Any) -> str | None:
    """``eos_token`` of a ``tokenizer_config.json`` beside the tokenizer, else a well-known name it has."""
    config = folder / "tokenizer_config.json"
    if config.is_file():
        eos = _tokenizer_config(config).get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str):
            return eos
    return next((n for n in EOT_CANDIDATES if tokenizer.token_to_id(n) is not None), None)


def _tokenizer_config(file: Path) -> dict[str, Any]:
    """A ``tokenizer_config.json``; a :class:`ConfigError` naming it when it is not a JSON object."""
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as err:
        problem = f"is not JSON ({err})"
    else:
        if isinstance(config, dict):
            return config
        problem = "is not a JSON object"
    raise ConfigError(
        "data.tokenizer",
        str(file),
        f"{file.name} {problem}",
        hint="fix or remove the file, or name the end-of-text token: data.eot_token='<|endoftext|>'",
    )


def _encoder(spec: TokenizerSpec) -> Encoder:
    import numpy as np

    if spec.file is None:
        return lambda texts: [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]
    tokenizer = _load(spec.file)
    return lambda texts: [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]


# --------------------------------------------------------------------------- the cache


def cache_file(data: Any, key: str, spec: TokenizerSpec) -> Path:
    """Where the tokens of ``data.<key>`` (``path`` or ``val_path``) are cached (it may not exist yet)."""
    files = existing_files(f"data.{key}", getattr(data, key), RECORD_SUFFIXES, "jsonl")
    digest = hashlib.sha256()
    for file in files:
        stat = file.stat()
        digest.update(f"{file.resolve()}|{stat.st_size}|{stat.st_mtime_ns}\n".encode())
    digest.update(f"{data.field}|{spec.eot_id}|{CACHE_VERSION}\n".encode())
    digest.update(spec.file.read_bytes() if spec.file is not None else b"bytes")
    folder = Path(data.cache_dir) if data.cache_dir else files[0].resolve().parent / CACHE_DIR_NAME
    return folder / f"{files[0].stem}-{digest.hexdigest()[:16]}.{spec.dtype}.bin"


def _cache_folder(folder: Path) -> None:
    """A :class:`ConfigError` on ``data.cache_dir`` when the cache cannot be written in ``folder``."""
    hint = f"data.cache_dir=DIR (a folder this user can write; created if missing), or null for {CACHE_DIR_NAME} beside the data"
    check_writable_folder("data.cache_dir", folder, hint=hint)


def cached_tokens(data: Any, key: str) -> tuple[Path, str]:
    """The cache file of ``data.<key>`` and its dtype, for a rank to read (the launcher made it)."""
    spec = tokenizer_spec(data)
    out = cache_file(data, key, spec)
    if not out.is_file():
        raise FileNotFoundError(
            f"data.{key}: the tokenized corpus {out} is missing (fsdp-train writes it before the ranks start)"
        )
    return out, spec.dtype


def prepare(data: Any, *, wait: bool = False) -> None:
    """Tokenize ``data.path`` (and ``data.val_path``) into the cache unless already there, and
    check the result holds one window; ``wait``: another process (local rank 0) writes it."""
    spec = tokenizer_spec(data)
    if data.vocab_size is not None and spec.vocab_size > data.vocab_size:
        what = "UTF-8 bytes (no tokenizer) need" if spec.file is None else "has"
        raise ConfigError(
            "data.tokenizer",
            data.tokenizer,
            f"{what} {spec.vocab_size} tokens, more than data.vocab_size={data.vocab_size}",
            hint="use the model's own tokenizer, or a model with a larger vocabulary",
        )
    for key in ("path", "val_path"):
        if key == "val_path" and data.val_path is None:
            continue
        out = cache_file(data, key, spec)
        _cache_folder(out.parent)
        if not out.is_file():
            if wait:
                _wait_for(out)
            else:
                _tokenize(data, key, spec, out)
        total = out.stat().st_size // (2 if spec.dtype == "uint16" else 4)
        check_enough_tokens(f"data.{key}", getattr(data, key), total, data.seq_len)


def _wait_for(path: Path) -> None:
    print(f"fsdp-train: waiting for local rank 0 to tokenize into {path}", file=sys.stderr, flush=True)
    while not path.is_file():
        time.sleep(1.0)


def _tokenize(data: Any, key: str, spec: TokenizerSpec, out: Path) -> None:
    """Write the tokens under a name of this process (``<out>.<pid>.partial``), then its description
    and the rename: whatever stops it (a bad line, a full disk, Ctrl-C), nothing half-written stays."""
    files = existing_files(f"data.{key}", getattr(data, key), RECORD_SUFFIXES, "jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f"{out.name}.{os.getpid()}.partial")
    try:
        documents, tokens = _write_tokens(data, key, spec, files, partial)
        description = {
            "source": [str(f.resolve()) for f in files],
            "field": data.field,
            "tokenizer": str(spec.file) if spec.file else None,
            "eot_id": spec.eot_id,
            "dtype": spec.dtype,
            "documents": documents,
            "tokens": tokens,
        }
        write_atomically(out.with_suffix(".json"), json.dumps(description, indent=2) + "\n")
        os.replace(partial, out)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    print(
        f"fsdp-train: tokenized {documents:,} documents into {tokens:,} tokens: {out} "
        f"(reused while the input is unchanged; data=tokens data.path={out} data.dtype={spec.dtype} reads it directly)",
        file=sys.stderr,
        flush=True,
    )


def _write_tokens(
    data: Any, key: str, spec: TokenizerSpec, files: list[Path], partial: Path
) -> tuple[int, int]:
    """Tokenize ``files`` into ``partial`` (flushed to disk); (documents, tokens) written."""
    import numpy as np
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    encode = _encoder(spec)
    total_bytes = sum(f.stat().st_size for f in files)
    columns = (BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn())
    tokens = documents = 0
    with Progress(*columns, transient=True) as progress, open(partial, "wb") as sink:
        task = progress.add_task(f"tokenizing {getattr(data, key)}", total=total_bytes)
        eot = np.asarray([spec.eot_id], dtype=spec.dtype)
        for texts, nbytes in _batches(files, data.field, f"data.{key}"):
            pieces = [piece for doc in encode(texts) for piece in (np.asarray(doc, dtype=spec.dtype), eot)]
            if pieces:
                ids = np.concatenate(pieces)
                ids.tofile(sink)
                tokens += len(ids)
            documents += len(texts)
            progress.advance(task, nbytes)
        sink.flush()
        os.fsync(sink.fileno())
    return documents, tokens


def _batches(files: list[Path], field: str, key: str) -> Iterator[tuple[list[str], int]]:
    """Documents in batches of about ``BATCH_BYTES``, with the bytes of input they came from."""
    texts: list[str] = []
    size = 0
    for file in files:
        for text, nbytes in _documents(file, field, key):
            size += nbytes
            if text is not None:
                texts.append(text)
            if size >= BATCH_BYTES:
                yield texts, size
                texts, size = [], 0
    if texts or size:
        yield texts, size


def _documents(file: Path, field: str, key: str) -> Iterator[tuple[str | None, int]]:
    """(document text, bytes of input) of each line (None: a blank one) or Parquet/Arrow row."""
    if is_table(file):
        for record, where, nbytes in table_rows(file, key):
            yield _text_of(record, where, field), nbytes
        return
    with open(file, "rb") as lines:
        for number, line in enumerate(lines, start=1):
            yield (_document(line, file, number, field, key) if line.strip() else None), len(line)


def _document(line: bytes, file: Path, number: int, field: str, key: str) -> str:
    try:
        text = line.decode("utf-8-sig" if number == 1 else "utf-8")  # (a BOM: a file saved on Windows)
    except UnicodeDecodeError as err:
        raise ConfigError(
            key,
            f"{file}:{number}",
            f"not UTF-8 text (byte 0x{line[err.start]:02x} at byte {err.start + 1} of the line)",
            hint="convert the file to UTF-8 (e.g. iconv -f latin1 -t utf-8 FILE)",
        ) from None
    try:
        record = json.loads(text)
    except ValueError:
        raise ConfigError(
            key, f"{file}:{number}", "not a JSON line", hint="one JSON object per line"
        ) from None
    return _text_of(record, f"{file}:{number}", field)


def _text_of(record: Any, where: str, field: str) -> str:
    text = record.get(field) if isinstance(record, dict) else None
    if not isinstance(text, str):
        keys = ", ".join(record) if isinstance(record, dict) else type(record).__name__
        raise ConfigError(
            "data.field",
            field,
            f"{where} has no text under that key",
            allowed=keys,
            hint="data.field=KEY names the key that holds each document",
        )
    return text
