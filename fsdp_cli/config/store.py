"""Register the schemas in Hydra's ConfigStore.

The primary schema types the fixed sections (precision, wrap, checkpoint, trainer, logger, optim,
launcher). The groups whose options have different shapes (strategy, model, data) are ``Any`` in
it, so each of their option files starts with ``defaults: [/schema/<group>/<kind>@_here_]``.
Either way Hydra checks keys, types and enum values against a dataclass while composing.
"""

from __future__ import annotations

from hydra.core.config_store import ConfigStore

from fsdp_cli.config.convert import DATA_SCHEMAS, MODEL_SCHEMAS, STRATEGY_SCHEMAS
from fsdp_cli.config.schema import TrainConfig


def register_schemas() -> None:
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    for group, schemas in (("strategy", STRATEGY_SCHEMAS), ("model", MODEL_SCHEMAS), ("data", DATA_SCHEMAS)):
        for name, schema in schemas.items():
            cs.store(group=f"schema/{group}", name=name, node=schema)
