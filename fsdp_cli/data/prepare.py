"""Data that must be prepared once before the ranks start (``data=jsonl`` and ``data=chat``: tokenize and cache)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fsdp_cli.rundir.files import DATA_STATISTICS_FILE, write_atomically


def prepare_data(cfg: Any, notify: Callable[[str], None] = print) -> None:
    """Run in the launching process. Inside a torchrun/SLURM job every process gets here: local
    rank 0 tokenizes, the others wait for its cache file. ``notify`` gets the lines worth printing
    once (``data=chat``: its statistics, also written to the run dir's ``data_statistics.json``)."""
    local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")) or 0)
    if cfg.data.name == "jsonl":
        from fsdp_cli.data.jsonl import prepare

        prepare(cfg.data, wait=local_rank > 0)
        return
    if cfg.data.name != "chat":
        return
    from fsdp_cli.data.chat import prepare as prepare_chat

    statistics = prepare_chat(cfg.data, wait=local_rank > 0)
    if local_rank > 0:
        return
    if cfg.run_dir:
        text = json.dumps({s["key"]: s for s in statistics}, indent=2) + "\n"
        write_atomically(Path(cfg.run_dir) / DATA_STATISTICS_FILE, text)
    for numbers in statistics:
        notify(numbers["line"])
