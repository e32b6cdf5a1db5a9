"""Dotted paths from the config (``model._target_``, ``strategy.parallelize_fn``, ``callbacks``) to
objects: checked without importing (the parent, before launch) and imported or built (a rank)."""

from __future__ import annotations

import ast
import difflib
import importlib
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
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
    spec = find_module(module)
    if spec is None:
        raise ConfigError(
            key,
            path,
            f"module {module!r} cannot be imported",
            hint="run from the folder that holds it, or add that folder to PYTHONPATH",
        )
    names = top_level_names(spec)
    if names is not None and attr not in names and not _is_submodule(spec, path):
        close = difflib.get_close_matches(attr, sorted(names), n=1)
        raise ConfigError(
            key,
            path,
            f"module {module} has no attribute {attr!r}",
            hint=f"did you mean {module}.{close[0]}?" if close else _names_hint(names, spec.origin),
        )


DYNAMIC_NAMES = frozenset({"globals", "vars", "setattr", "exec", "__getattr__"})
"""Names whose use lets a module define names its source does not show: then only importing it tells."""


def _is_submodule(package: importlib.machinery.ModuleSpec, path: str) -> bool:
    """``path`` is a module inside ``package`` (found without importing the package)."""
    locations = package.submodule_search_locations
    return bool(locations) and importlib.machinery.PathFinder.find_spec(path, list(locations)) is not None


def top_level_names(spec: importlib.machinery.ModuleSpec) -> set[str] | None:
    """The names a module's source defines or imports at its top level (inside ``if``/``try``
    blocks too), read with :mod:`ast` without running it: a typo'd target is refused in
    milliseconds, before any import of torch. None where the source cannot tell: no Python
    source, a ``from x import *``, or a module ``__getattr__``."""
    if not (spec.origin or "").endswith(".py"):
        return None
    try:
        tree = ast.parse(Path(spec.origin).read_bytes())
    except (OSError, SyntaxError, ValueError):
        return None  # importing it will say what is wrong
    names: set[str] = set()
    for node in _top_level(tree.body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            if any(alias.name == "*" for alias in node.names):
                return None
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.For, ast.AsyncFor)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            names.update(n.id for i in node.items for n in ast.walk(i) if isinstance(n, ast.Name))
    dynamic = any(isinstance(n, ast.Name) and n.id in DYNAMIC_NAMES for n in ast.walk(tree))
    return None if dynamic or "__getattr__" in names else names


def _top_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements run at import: the body, and the bodies of its ``if``, ``try`` and ``with``."""
    for node in body:
        yield node
        for field in ("body", "orelse", "finalbody", "handlers"):
            inner = getattr(node, field, None)
            if isinstance(inner, list) and not isinstance(
                node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
            ):
                yield from _top_level(inner)


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


def _names_hint(names: set[str], origin: str | None) -> str:
    """The module's public names where they are few enough to read in one line, else its file."""
    public = sorted(name for name in names if not name.startswith("_"))
    if public and len(public) <= 40:
        return "names there: " + ", ".join(public)
    return f"the names are in {origin}"
