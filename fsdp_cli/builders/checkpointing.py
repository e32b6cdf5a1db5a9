"""What every strategy builder tells its strategy's checkpointing (its own module so that
:mod:`fsdp_cli.builders.strategy` can name every builder, FSDP1's included, directly)."""

from __future__ import annotations

import os
from typing import Any

from fsdp_cli.checkpoint.manifest import STARTED_IN_KEY
from fsdp_cli.checkpoint.run import RUN_ID_KEY
from fsdp_cli.config.resolved import ResolvedRun


def checkpointing(run: ResolvedRun) -> dict[str, Any]:
    """What every strategy's checkpointing is told at construction: the format, what each
    checkpoint's manifest records, and whether sharded saves are written in the background."""
    from fsdp_cli.config.convert import to_container

    return {
        "checkpoint_format": run.checkpoint_format,
        "checkpoint_manifest": {
            "config": to_container(run.cfg),
            "dp": run.layout.dp,
            "tp": run.layout.tp,
            RUN_ID_KEY: run.cfg.run_id,  # whose saves retention may remove (CheckpointCallback.prune)
            # What the config's relative paths (model.path, data.tokenizer) are relative to.
            STARTED_IN_KEY: os.getcwd(),
        },
        "async_checkpointing": run.cfg.checkpoint.async_save,
        # A LoRA run saves its adapters (and what else trains); the frozen base only when asked.
        "save_frozen": not run.cfg.peft.enabled or run.cfg.peft.save_base,
    }
