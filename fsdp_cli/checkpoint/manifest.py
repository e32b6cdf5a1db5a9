"""The manifest every checkpoint carries, and the comparison made on resume."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any

from fsdp_cli.dtypes import dtype_names

MANIFEST_VERSION = 2
"""2: sharded checkpoints list every file with its size and CRC-32 (``files``)."""
TRAINED_KEY = "trained"
"""A run that froze part of its model (``peft=lora``): the canonical names of the parameters that
trained (its exports carry those beside the adapters, nothing frozen)."""

STARTED_IN_KEY = "started_in"
"""The folder the run started in: what relative paths of its config (``model.path``,
``data.tokenizer``) are relative to, for the tools that read the checkpoint elsewhere."""


def config_path(manifest: Mapping[str, Any] | None, value: Any) -> str | None:
    """A path of the run's config as an absolute one: relative ones against the folder the run
    started in (checkpoints saved before manifests recorded it: as given)."""
    import os

    if not value:
        return None
    started = (manifest or {}).get(STARTED_IN_KEY)
    return os.path.join(started, str(value)) if started and not os.path.isabs(str(value)) else str(value)


def build_manifest(strategy: Any, checkpoint: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """Step, layout, parameter count and dtypes, versions; ``extra`` adds the run's config."""
    import lightning
    import torch

    from fsdp_cli import __version__

    tensors = [
        v for v in checkpoint.get("state_dict", {}).values() if hasattr(v, "size") and hasattr(v, "dtype")
    ]
    dtypes = dtype_names(t.dtype for t in tensors)
    return {
        "manifest_version": MANIFEST_VERSION,
        "format": strategy.checkpoint_format.value,
        "step": int(checkpoint.get("global_step", 0)),
        "epoch": int(checkpoint.get("epoch", 0)),
        "world_size": int(strategy.world_size),
        "strategy": type(strategy).__name__,
        "mesh": strategy.mesh_sizes(),
        # size() of a DTensor or ShardedTensor is the whole tensor's, so this holds on any layout.
        "parameter_count": int(sum(math.prod(t.size()) for t in tensors)),
        "dtypes": dtypes,
        "optimizer_state": bool(checkpoint.get("optimizer_states")),
        "versions": {
            "torch": str(torch.__version__),
            "lightning": str(lightning.__version__),
            "fsdp_cli": __version__,
        },
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **dict(extra),
    }
