"""Dotted paths from the config (``model._target_``, ``strategy.parallelize_fn``, ``callbacks``) to
objects: checked without importing (the parent, before launch) and imported or built (a rank)."""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Mapping
from typing import Any

from fsdp_cli.errors import ConfigError


def serve_working_directory() -> None:
    """Let dotted paths name the user's own modules in the working directory
    (``model._target_=my_pkg.MyModel`` run from the folder holding ``my_pkg``): appended to
    ``sys.path``, after the installed packages, never first, where a file named like a dependency
    (``rich.py``) would be imported instead of it."""
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.append(cwd)


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


def instantiate(node: Mapping[str, Any], key: str) -> Any:
    """A ``{_target_: dotted.Path, arg: value, ...}`` node -> ``Path(**args)``, the convention of
    Hydra's ``instantiate`` (Hydra itself stays in the entry point): an argument that is such a
    node is built first, ``_args_`` are positional arguments, other ``_name_`` keys (Hydra's
    options) are ignored. A constructor that refuses its arguments is a one-line ConfigError on
    ``key``."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    target = import_object(str(node["_target_"]), f"{key}._target_")
    args = [_built(value, f"{key}._args_.{i}") for i, value in enumerate(node.get("_args_") or [])]
    kwargs = {
        name: _built(value, f"{key}.{name}")
        for name, value in node.items()
        if not (name.startswith("_") and name.endswith("_"))
    }
    try:
        return target(*args, **kwargs)
    except (TypeError, ValueError, MisconfigurationException) as err:
        raise ConfigError(
            key, node["_target_"], f"{type(err).__name__}: {' '.join(str(err).split())}"
        ) from None


def _built(value: Any, key: str) -> Any:
    if isinstance(value, Mapping) and "_target_" in value:
        return instantiate(value, key)
    if isinstance(value, Mapping):
        return {name: _built(item, f"{key}.{name}") for name, item in value.items()}
    if isinstance(value, list):
        return [_built(item, f"{key}.{i}") for i, item in enumerate(value)]
    return value


def check_dotted(key: str, path: str) -> None:
    """``path`` names an attribute of a module that can be found (without importing it)."""
    module, _, attr = path.rpartition(".")
    if not module or not attr:
        raise ConfigError(key, path, "not a dotted path", allowed="package.module.Name")
    if find_module(module) is None:
        raise ConfigError(
            key,
            path,
            f"module {module!r} cannot be imported",
            hint="run from the folder that holds it, or add that folder to PYTHONPATH",
        )


def find_module(dotted: str) -> importlib.machinery.ModuleSpec | None:
    """The spec of module ``dotted``, found without importing it or its parent packages where the
    files tell (``importlib.util.find_spec`` imports the parents: ``lightning.pytorch.callbacks``
    would import torch); a package that builds its ``__path__`` at import time is imported."""
    parts = dotted.split(".")
    try:
        spec = importlib.util.find_spec(parts[0])
        for depth in range(2, len(parts) + 1):
            if spec is None or spec.submodule_search_locations is None:
                break
            spec = importlib.machinery.PathFinder.find_spec(
                ".".join(parts[:depth]), list(spec.submodule_search_locations)
            )
        else:
            return spec
        return importlib.util.find_spec(dotted)
    except (ImportError, ValueError):
        return None
