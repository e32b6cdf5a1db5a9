"""Which ``model_type`` names the installed transformers knows, and which have a causal-LM class,
read from its auto-mapping source files without importing it.

The parent checks a model folder's ``config.json`` before any rank starts, in well under a
second; importing transformers costs about a second and ``transformers.models.auto`` imports
torch (several). The tables (``CONFIG_MAPPING_NAMES``, ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``) are
literals in ``transformers/models/auto/*.py``, so they are read with :mod:`ast` instead. Where a
future transformers moves them, :func:`model_type_tables` answers None and the check is left to
the ranks (``AutoModelForCausalLM``'s own error); a test pins that the installed version parses.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from dataclasses import dataclass
from pathlib import Path

CONFIG_TABLE = "CONFIG_MAPPING_NAMES"
CAUSAL_LM_TABLE = "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"
SOURCES = ("auto_mappings.py", "configuration_auto.py", "modeling_auto.py")
"""Where transformers 5 keeps the tables (4.x had the config table in configuration_auto.py)."""


@dataclass(frozen=True)
class ModelTypes:
    """``known``: every ``model_type`` transformers can build a config for; ``causal_lm``: those
    ``AutoModelForCausalLM`` builds."""

    known: frozenset[str]
    causal_lm: frozenset[str]


@functools.cache
def model_type_tables() -> ModelTypes | None:
    """The installed transformers' tables, or None (not installed, or laid out otherwise)."""
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        return None
    auto = Path(next(iter(spec.submodule_search_locations))) / "models" / "auto"
    tables: dict[str, set[str]] = {CONFIG_TABLE: set(), CAUSAL_LM_TABLE: set()}
    for name in SOURCES:
        if (auto / name).is_file():
            _collect(ast.parse((auto / name).read_text()), tables)
    known, causal = tables[CONFIG_TABLE], tables[CAUSAL_LM_TABLE]
    if not known or not causal:
        return None
    return ModelTypes(frozenset(known), frozenset(causal))


def _collect(tree: ast.Module, tables: dict[str, set[str]]) -> None:
    """String keys of ``TABLE = OrderedDict([(key, ...), ...])`` and ``TABLE.update({key: ...})``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name) and target.id in tables:
                tables[target.id].update(_keys(node.value))
        elif (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "update"
        ):
            owner = node.func.value
            if isinstance(owner, ast.Name) and owner.id in tables and node.args:
                tables[owner.id].update(_keys(node.args[0]))


def _keys(node: ast.expr) -> set[str]:
    """Keys of a dict literal, of a list of pairs, or of ``OrderedDict(...)`` around either."""
    if isinstance(node, ast.Call):  # OrderedDict([...]), OrderedDict(**{...}, **OTHER)
        parts = [*node.args, *(k.value for k in node.keywords if k.arg is None)]
        return set().union(set(), *(_keys(part) for part in parts))
    if isinstance(node, ast.Dict):
        return {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
    if isinstance(node, (ast.List, ast.Tuple)):
        firsts = [e.elts[0] for e in node.elts if isinstance(e, ast.Tuple) and e.elts]
        return {k.value for k in firsts if isinstance(k, ast.Constant) and isinstance(k.value, str)}
    return set()
