"""``fsdp-data show [fsdp-train overrides] [--line N]``: one example of ``data=chat`` as the run sees it.

Renders line N (default 1) of the first ``data.path`` file through the same template and masking
the run uses, and prints the text with the supervised (assistant) tokens between ``[[`` and
``]]``, then the counts: what the loss will see, checked before any training starts.

    fsdp-data show model=hf model.path=MODEL_DIR data=chat data.path=chats.jsonl --line 3
"""

from __future__ import annotations

import json
import sys
from typing import Any

from fsdp_cli.cli.console import OneLineParser, quiet_on_closed_pipe
from fsdp_cli.errors import ConfigError
from fsdp_cli.rundir.status import EXIT_CONFIG_ERROR

PROG = "fsdp-data"


def marked(tokenizer: Any, ids: list[int], mask: list[bool]) -> str:
    """The decoded tokens, runs of supervised ones between ``[[`` and ``]]``."""
    out: list[str] = []
    inside = False
    for token, supervised in zip(ids, mask, strict=True):
        if supervised != inside:
            out.append("[[" if supervised else "]]")
            inside = supervised
        out.append(tokenizer.decode([token]))
    return "".join(out) + ("]]" if inside else "")


def show(data: Any, line: int) -> str:
    """The marked rendering of line ``line`` of ``data.path``'s first file, and its counts."""
    from fsdp_cli.data.chat import conversation, encode, renderer
    from fsdp_cli.data.files import RECORD_SUFFIXES, existing_files

    if data.name != "chat":
        raise ConfigError("data", data.name, "fsdp-data show renders chat data", allowed="data=chat")
    render, _ = renderer(data)
    file = existing_files("data.path", data.path, RECORD_SUFFIXES, "chat")[0]
    record, where = _record_at(file, line)
    ids, mask = encode(render, conversation(record, where, "data.path", data), where, "data.path")
    how = "generation markers" if render.markers else "rendered prefixes"
    counts = f"{where}: {len(ids)} tokens, {sum(mask)} supervised ([[...]], found by {how})"
    return marked(render.tokenizer, ids, mask) + "\n\n" + counts


def _record_at(file: Any, line: int) -> tuple[Any, str]:
    """Line ``line`` of a JSON-lines file (row ``line`` of a Parquet or Arrow file), and where it is."""
    import itertools

    from fsdp_cli.data.tables import is_table, table_rows

    if is_table(file):
        rows = list(itertools.islice(table_rows(file, "data.path"), max(line, 1)))
        if not 1 <= line <= len(rows):
            raise ConfigError("--line", line, f"{file} has {len(rows)} rows", allowed=f"1..{len(rows)}")
        return rows[-1][0], rows[-1][1]
    lines = file.read_text(encoding="utf-8-sig").splitlines()  # (a BOM: a file saved on Windows)
    if not 1 <= line <= len(lines):
        raise ConfigError("--line", line, f"{file} has {len(lines)} lines", allowed=f"1..{len(lines)}")
    where = f"{file}:{line}"
    try:
        return json.loads(lines[line - 1]), where
    except ValueError:
        raise ConfigError("data.path", where, "not a JSON line", hint="one JSON object per line") from None


@quiet_on_closed_pipe
def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["show"])
    parser.add_argument("--line", type=int, default=1, help="which line of the first data.path file (from 1)")
    parser.add_argument(
        "overrides", nargs="*", help="fsdp-train overrides (data=chat data.path=... model.path=...)"
    )
    args = parser.parse_args(argv)
    from fsdp_cli.cli.plan import compose

    try:
        print(show(compose(args.overrides, PROG).data, args.line))
    except ConfigError as err:
        print(f"{PROG}: error: {err.one_line()}", file=sys.stderr, flush=True)
        sys.exit(EXIT_CONFIG_ERROR)


if __name__ == "__main__":
    main()
