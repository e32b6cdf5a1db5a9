"""Dotted paths from the config (``model._target_``, ``strategy.parallelize_fn``) to objects."""

from __future__ import annotations

import importlib
from typing import Any

from fsdp_cli.errors import ConfigError


def import_object(path: str, key: str) -> Any:
    """``package.module.Name`` -> the object; a path that does not resolve is a ConfigError on ``key``."""
    module, _, attr = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise ConfigError(
            key,
            path,
            f"cannot be imported ({err})",
            hint="run from the folder that holds the module, or add it to PYTHONPATH",
        ) from None
