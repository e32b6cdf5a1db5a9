"""What a LightningModule defines to train under ``pp > 1`` (docs/strategies.md, Pipeline
parallel), asked of its class before launch and of the module in the rank. Torch-free."""

from __future__ import annotations

from typing import Any

from fsdp_cli.errors import ConfigError

PIPELINE_HOOKS = ("pipeline_inputs", "pipeline_loss")


def refuse_missing_hooks(target: Any, pp: int, *, allowed: str | None = None) -> None:
    """One line naming the hooks ``target`` (a LightningModule or its class) lacks."""
    missing = [hook for hook in PIPELINE_HOOKS if not callable(getattr(target, hook, None))]
    if missing:
        name = target.__name__ if isinstance(target, type) else type(target).__name__
        raise ConfigError(
            "pp",
            pp,
            f"{name} does not say how a pipeline runs it: it lacks {', '.join(missing)}",
            allowed=allowed,
            hint="define pipeline_inputs(batch) -> (inputs, targets) and pipeline_loss(output, targets) "
            "(docs/strategies.md, Pipeline parallel), or use pp=1",
        )
