"""Old names and keywords, mapped to today's config with a notice for each.

* ``strategy=ddp_fully_sharded`` (lightning_fairscale) and ``strategy=fsdp_native`` (Lightning 1.x)
  run as ``strategy=fsdp`` (PyTorch's native FSDP); fairscale's keywords are translated.
* ``strategy.activation_checkpointing`` (deprecated) becomes ``activation_checkpointing_policy``.

The strategy schemas migrate themselves (``migrate`` of :class:`~fsdp_cli.config.schema.StrategyAnswers`:
each old schema knows its keywords); this module runs them after the precision's old names.
* ``precision=16``/``bf16``/``32``/``64`` become ``16-mixed``/``bf16-mixed``/``32-true``/``64-true``.

Runs in the parent, before validation, without torch; the resolved ``config.yaml`` holds only
the new names.
"""

from __future__ import annotations

import dataclasses

from fsdp_cli.config.schema import TrainConfig
from fsdp_cli.precision import ALIASES as LEGACY_PRECISION


def migrate(cfg: TrainConfig) -> tuple[TrainConfig, list[str]]:
    """Return the config in current terms and the notices to show the user."""
    notices: list[str] = []
    precision = cfg.precision.name
    if precision in LEGACY_PRECISION:
        new = LEGACY_PRECISION[precision]
        notices.append(f"note: precision={precision} is the old name of precision={new}; running {new}")
        cfg = dataclasses.replace(cfg, precision=dataclasses.replace(cfg.precision, name=new))
    return cfg.strategy.migrate(cfg, notices), notices
