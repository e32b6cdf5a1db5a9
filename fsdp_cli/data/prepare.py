"""Data that must be prepared once before the ranks start (``data=jsonl`` and ``data=chat``: tokenize and cache)."""

from __future__ import annotations

import os
from typing import Any


def prepare_data(cfg: Any) -> None:
    """Run in the launching process. Inside a torchrun/SLURM job every process gets here: local
    rank 0 tokenizes, the others wait for its cache file."""
    if cfg.data.name == "chat":
        from fsdp_cli.data.chat import prepare
    elif cfg.data.name == "jsonl":
        from fsdp_cli.data.jsonl import prepare
    else:
        return
    local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")) or 0)
    prepare(cfg.data, wait=local_rank > 0)
