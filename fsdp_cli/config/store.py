"""Register the schemas in Hydra's ConfigStore.

The primary schema types the fixed sections (precision, wrap, checkpoint, trainer, logger, optim,
launcher). The groups whose options have different shapes (strategy, model, data) are ``Any`` in
it, so each of their option files starts with ``defaults: [/schema/<group>/<kind>@_here_]``.
Either way Hydra checks keys, types and enum values against a dataclass while composing.
"""

from __future__ import annotations

from fsdp_cli.compat.hydra_internals import store_schema
from fsdp_cli.config.convert import DATA_SCHEMAS, MODEL_SCHEMAS, STRATEGY_SCHEMAS
from fsdp_cli.config.schema import TrainConfig


def register_schemas() -> None:
    """Each schema is converted only when a composition loads it (see
    :func:`~fsdp_cli.compat.hydra_internals.store_schema`)."""
    store_schema("train_schema", TrainConfig)
    for group, schemas in (("strategy", STRATEGY_SCHEMAS), ("model", MODEL_SCHEMAS), ("data", DATA_SCHEMAS)):
        for name, schema in schemas.items():
            store_schema(name, schema, group=f"schema/{group}")
