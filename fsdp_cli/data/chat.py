"""``data=chat``: conversations (or prompt/completion pairs) from JSON lines, rendered through the
tokenizer's chat template, tokenized once and cached with the mask of the assistant's tokens.

The launching process checks every line (one-line errors naming ``file:line``), renders and
tokenizes before any rank starts (a progress bar on the console), and writes a cache folder
``<cache_dir>/<name>-<key>.chat/`` (``tokens.npy``, ``supervised.npy``, ``offsets.npy`` and a
``description.json``), published by one rename so nothing half-written is ever read. The key
hashes the input files (paths, sizes, modification times), the field names, the supervision
setting, the tokenizer's files and the chat template: a changed template is rendered again. The
ranks memory-map the arrays (``allow_pickle=False``). Torch-free.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fsdp_cli.data.chat_template import ROLES, ChatRenderer, NotPrefixStable, chat_template, load_tokenizer
from fsdp_cli.data.files import RECORD_SUFFIXES, existing_files
from fsdp_cli.data.packing import Layout, plan_sequences, supervised_prefix
from fsdp_cli.data.tables import is_table, table_rows
from fsdp_cli.errors import ConfigError
from fsdp_cli.rundir.files import check_writable_folder, write_atomically

CACHE_DIR_NAME = ".fsdp_cli_tokens"
CACHE_VERSION = 1
TOKENIZER_FILES = ("tokenizer", "special_tokens", "vocab", "merges", "added_tokens", "chat_template")
"""Files of a tokenizer folder (by name prefix) whose bytes enter the cache key."""


@dataclass(frozen=True)
class ChatCorpus:
    """A tokenized corpus: every example's tokens one after the other."""

    tokens: np.ndarray
    supervised: np.ndarray
    """1 where the token is the assistant's (a supervised label when it is predicted)."""
    offsets: np.ndarray
    """Example ``i`` is ``tokens[offsets[i]:offsets[i + 1]]``."""
    folder: Path | None = None
    """The cache folder the arrays are mapped from."""

    def __reduce__(self) -> Any:
        # DataLoader workers map the folder again: pickling a memory map would copy the whole file.
        if self.folder is None:
            return super().__reduce__()
        return read_corpus, (self.folder,)

    def layout(self, data: Any) -> Layout:
        return plan_sequences(
            self.offsets,
            supervised_prefix(self.supervised),
            seq_len=data.seq_len,
            packing=data.packing,
            keep_end=data.truncation_side.value == "left",
        )


# --------------------------------------------------------------------------- checking lines


def conversation(record: Any, where: str, key: str, data: Any) -> list[dict[str, Any]]:
    """The messages of one JSON line (in ``data.format``), checked; a :class:`ConfigError` naming
    ``file:line`` otherwise."""
    from fsdp_cli.data import chat_formats

    if not isinstance(record, dict):
        raise ConfigError(
            key, where, f"a line is a {type(record).__name__}, not a JSON object", hint="one object per line"
        )
    shape = data.format.value
    if shape == "auto":
        shape = chat_formats.detect(record, data) or "unknown"
    if shape == "sharegpt":
        messages = chat_formats.sharegpt(record, where, key)
    elif shape == "alpaca":
        messages = chat_formats.alpaca(record, where, key)
    elif data.messages_field in record:
        messages = record[data.messages_field]
    elif data.prompt_field in record and data.completion_field in record:
        messages = _pair(record, where, key, data)
    else:
        raise chat_formats.unknown_shape(record, where, key, data)
    check_messages(messages, where, key, data.messages_field)
    return messages


def _pair(record: dict[str, Any], where: str, key: str, data: Any) -> list[dict[str, Any]]:
    prompt, completion = record[data.prompt_field], record[data.completion_field]
    if not isinstance(prompt, str) or not isinstance(completion, str):
        raise ConfigError(key, where, "prompt and completion must be strings", hint="one JSON string each")
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]


def check_messages(messages: Any, where: str, key: str, field: str) -> None:
    """A list of ``{role, content}`` objects with known roles, at least one assistant turn, none empty."""
    if not isinstance(messages, list) or not messages:
        raise ConfigError(
            key,
            where,
            f"{field!r} is not a non-empty list of messages",
            hint='[{"role": "user", "content": "..."}, ...]',
        )
    for number, message in enumerate(messages, start=1):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ROLES:
            raise ConfigError(
                key,
                where,
                f"message {number} has role {role!r}",
                allowed=", ".join(ROLES),
                hint="each message is {role, content}",
            )
        content = message.get("content")
        if not isinstance(content, str):
            raise ConfigError(
                key, where, f"message {number} ({role}) has no string content", hint='"content": "..."'
            )
        if role == "assistant" and not content.strip():
            raise ConfigError(
                key,
                where,
                f"message {number} is an empty assistant turn",
                hint="remove the line or give the answer",
            )
    if not any(m["role"] == "assistant" for m in messages):
        raise ConfigError(
            key,
            where,
            "the conversation has no assistant turn: nothing to learn from it",
            hint="remove the line",
        )


def records(files: list[Path], key: str) -> Iterator[tuple[Any, str, int]]:
    """(parsed JSON, ``file:line``, bytes read) of every non-blank line (of every row of a Parquet or
    Arrow file: ``file:row N``). A file saved on Windows
    reads as any other: a byte-order mark before its first line is dropped (``utf-8-sig``), and a
    line's ``\r\n`` is whitespace to JSON."""
    for file in files:
        if is_table(file):  # Parquet, a datasets folder's Arrow files: a row is a line's object
            yield from table_rows(file, key)
            continue
        with open(file, "rb") as lines:
            for number, line in enumerate(lines, start=1):
                if not line.strip():
                    yield None, "", len(line)
                    continue
                where = f"{file}:{number}"
                try:
                    yield json.loads(line.decode("utf-8-sig" if number == 1 else "utf-8")), where, len(line)
                except (UnicodeDecodeError, ValueError):
                    raise ConfigError(
                        key, where, "not a JSON line in UTF-8", hint="one JSON object per line"
                    ) from None


# --------------------------------------------------------------------------- the renderer


def renderer(data: Any) -> tuple[ChatRenderer, str]:
    """The renderer of ``data`` and the template text it renders with."""
    tokenizer = load_tokenizer(data.tokenizer)
    if not getattr(tokenizer, "is_fast", False):
        raise ConfigError(
            "data.tokenizer",
            data.tokenizer,
            "is not a fast tokenizer (tokenizer.json): character offsets are needed",
        )
    template = chat_template(tokenizer, data.chat_template, data.tokenizer)
    return ChatRenderer(tokenizer, template, last_turn_only=data.supervise.value == "last"), template


def encode(
    render: ChatRenderer, messages: list[dict[str, Any]], where: str, key: str
) -> tuple[list[int], list[bool]]:
    """``render(messages)``; the template's own refusals (roles out of order, ...) as one line."""
    try:
        return render(messages)
    except NotPrefixStable as err:
        raise ConfigError(
            "data.chat_template",
            where,
            str(err),
            hint="a template with {% generation %} markers (data.chat_template=FILE)",
        ) from None
    except Exception as err:  # noqa: BLE001 - jinja's raise_exception and the like: the user's data
        raise ConfigError(
            key, where, f"the chat template refuses this conversation ({err})", hint="fix or remove the line"
        ) from None


# --------------------------------------------------------------------------- the cache


def cache_folder(data: Any, key: str, template: str) -> Path:
    """Where the tokens of ``data.<key>`` are cached (it may not exist yet)."""
    files = existing_files(f"data.{key}", getattr(data, key), RECORD_SUFFIXES, "chat")
    digest = hashlib.sha256()
    for file in files:
        stat = file.stat()
        digest.update(f"{file.resolve()}|{stat.st_size}|{stat.st_mtime_ns}\n".encode())
    fields = (
        data.messages_field,
        data.prompt_field,
        data.completion_field,
        data.supervise.value,
        data.format.value,
        CACHE_VERSION,
    )
    digest.update(f"{fields}\n".encode())
    digest.update(template.encode())
    for file in sorted(Path(data.tokenizer).iterdir()):
        if file.is_file() and file.name.startswith(TOKENIZER_FILES):
            digest.update(file.name.encode() + b"\0" + file.read_bytes())
    folder = Path(data.cache_dir) if data.cache_dir else files[0].resolve().parent / CACHE_DIR_NAME
    return folder / f"{files[0].stem}-{digest.hexdigest()[:16]}.chat"


def read_corpus(folder: Path) -> ChatCorpus:
    """The cached arrays, memory-mapped (plain arrays only: nothing is unpickled)."""

    def load(name: str) -> np.ndarray:
        return np.load(folder / f"{name}.npy", mmap_mode="r", allow_pickle=False)

    return ChatCorpus(load("tokens"), load("supervised"), load("offsets"), folder)


def cached_corpus(data: Any, key: str) -> ChatCorpus:
    """The corpus of ``data.<key>`` for a rank (the launching process made it)."""
    _, template = renderer(data)
    folder = cache_folder(data, key, template)
    if not folder.is_dir():
        raise FileNotFoundError(
            f"data.{key}: the tokenized chat data {folder} is missing (fsdp-train writes it before the ranks start)"
        )
    return read_corpus(folder)


def prepare(data: Any, *, wait: bool = False) -> list[dict[str, Any]]:
    """Render and tokenize ``data.path`` (and ``data.val_path``) unless cached, check the result,
    and return its statistics (:func:`statistics`); ``wait``: another process (local rank 0)
    writes the cache."""
    render, template = renderer(data)
    size = len(render.tokenizer)
    if data.vocab_size is not None and size > data.vocab_size:
        raise ConfigError(
            "data.tokenizer",
            data.tokenizer,
            f"has {size} tokens, more than data.vocab_size={data.vocab_size}",
            hint="use the model's own tokenizer, or a model with a larger vocabulary",
        )
    found = []
    for key in ("path", "val_path"):
        if key == "val_path" and data.val_path is None:
            continue
        folder = cache_folder(data, key, template)
        check_writable_folder(
            "data.cache_dir", folder.parent, hint="data.cache_dir=DIR (a folder this user can write)"
        )
        if not folder.is_dir():
            _wait_for(folder) if wait else _tokenize(data, key, render, folder)
        corpus = read_corpus(folder)
        layout = corpus.layout(data)
        _check_enough(data, key, layout)
        found.append(statistics(data, key, corpus, layout))
    return found


def _check_enough(data: Any, key: str, layout: Layout) -> None:
    if layout.sequences < 1:
        raise ConfigError(
            f"data.{key}",
            getattr(data, key),
            f"no example keeps a supervised token within data.seq_len={data.seq_len}",
            hint="a larger data.seq_len, or data.truncation_side=left to keep the answers",
        )


def statistics(data: Any, key: str, corpus: ChatCorpus, layout: Layout) -> dict[str, Any]:
    """Examples, sequences, the supervised fraction of processed tokens, truncated and dropped
    examples, and the line that says so."""
    processed = layout.sequences * data.seq_len
    fraction = float(layout.supervised.sum()) / max(1, processed)
    how = "packed" if data.packing else "one example each, padded"
    numbers = {
        "key": f"data.{key}",
        "examples": len(corpus.offsets) - 1,
        "sequences": layout.sequences,
        "seq_len": data.seq_len,
        "packing": data.packing,
        "supervised_tokens": int(layout.supervised.sum()),
        "supervised_fraction": fraction,
        "truncated": layout.truncated,
        "truncation_side": data.truncation_side.value,
        "dropped": layout.dropped,
    }
    line = (
        f"data.{key}: {numbers['examples']:,} examples -> {layout.sequences:,} sequences of "
        f"data.seq_len={data.seq_len} ({how}); supervised tokens {100 * fraction:.1f}% of those processed; "
        f"{layout.truncated:,} truncated (data.truncation_side={data.truncation_side.value}), "
        f"{layout.dropped:,} dropped (no supervised token left)"
    )
    return {**numbers, "line": line}


def _wait_for(folder: Path) -> None:
    print(f"fsdp-train: waiting for local rank 0 to tokenize into {folder}", file=sys.stderr, flush=True)
    while not folder.is_dir():
        time.sleep(1.0)


def _tokenize(data: Any, key: str, render: ChatRenderer, out: Path) -> None:
    """Write the arrays into ``<out>.<pid>.partial/`` (flushed), then rename the folder: whatever
    stops it (a bad line, a full disk, Ctrl-C), nothing half-written stays."""
    files = existing_files(f"data.{key}", getattr(data, key), RECORD_SUFFIXES, "chat")
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f"{out.name}.{os.getpid()}.partial")
    try:
        partial.mkdir()
        examples = _write_arrays(data, key, render, files, partial)
        description = {
            "source": [str(f.resolve()) for f in files],
            "examples": examples,
            "template": render.template,
        }
        write_atomically(partial / "description.json", json.dumps(description, indent=2) + "\n")
        os.replace(partial, out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def _write_arrays(data: Any, key: str, render: ChatRenderer, files: list[Path], folder: Path) -> int:
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn

    tokens: list[int] = []
    supervised: list[bool] = []
    offsets = [0]
    total = sum(f.stat().st_size for f in files)
    with Progress(BarColumn(), DownloadColumn(), TimeRemainingColumn(), transient=True) as progress:
        task = progress.add_task(f"rendering {getattr(data, key)}", total=total)
        for record, where, nbytes in records(files, f"data.{key}"):
            progress.advance(task, nbytes)
            if not where:
                continue
            ids, mask = encode(render, conversation(record, where, f"data.{key}", data), where, f"data.{key}")
            tokens.extend(ids)
            supervised.extend(mask)
            offsets.append(len(tokens))
    dtype = np.uint16 if len(render.tokenizer) <= 1 << 16 else np.uint32
    for name, array in (
        ("tokens", np.asarray(tokens, dtype=dtype)),
        ("supervised", np.asarray(supervised, dtype=np.uint8)),
        ("offsets", np.asarray(offsets, dtype=np.int64)),
    ):
        with open(folder / f"{name}.npy", "wb") as sink:
            np.save(sink, array, allow_pickle=False)
            sink.flush()
            os.fsync(sink.fileno())
    return len(offsets) - 1
