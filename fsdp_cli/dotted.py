"""Dotted paths from the config (``model._target_``, ``strategy.parallelize_fn``) to objects:
checked without importing (the parent, before launch) and imported (a rank, when it builds)."""

from __future__ import annotations

import importlib
import importlib.util
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


def check_dotted(key: str, path: str) -> None:
    """``path`` names an attribute of a module that can be found (without importing it)."""
    module, _, attr = path.rpartition(".")
    if not module or not attr:
        raise ConfigError(key, path, "not a dotted path", allowed="package.module.Name")
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise ConfigError(
            key,
            path,
            f"module {module!r} cannot be imported",
            hint="run from the folder that holds it, or add that folder to PYTHONPATH",
        )
