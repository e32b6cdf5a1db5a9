"""Manual optimization (``self.automatic_optimization = False``) and what cannot go with it, asked
before launch of the module's source and again in each rank of the built module.

Lightning refuses ``Trainer(gradient_clip_val=...)`` for a module that optimizes by hand (its
configuration validator, before training); fsdp-train keeps that refusal, before any rank starts.
Manual optimization under FSDP1 (``strategy=fsdp``) fails inside torch (``Expects BACKWARD_PRE or
BACKWARD_POST state``: a ``manual_backward`` inside the wrapper's forward, as Lightning's own
FSDPStrategy runs it); the same module trains under ``strategy=fsdp2``.

Before launch the module is not imported (a config error must cost well under a second): its
class, and the base classes it names, are read as source for an assignment
``self.automatic_optimization = False`` or a property of that name returning False. What the source
does not tell is asked of the built module in the ranks (the same one-line error).
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import TYPE_CHECKING

from fsdp_cli.dotted import find_module
from fsdp_cli.errors import ConfigError

if TYPE_CHECKING:  # (type-only: the model registry names this check, and the resolved run asks the registry)
    from fsdp_cli.config.resolved import ResolvedRun

_ATTRIBUTE = "automatic_optimization"


def check_manual_optimization(run: ResolvedRun) -> None:
    """Before launch (``model=custom``: its registry entry's check): ``model._target_`` declares
    manual optimization in its source."""
    if declares_manual_optimization(run.cfg.model.target):
        refuse_with_manual_optimization(run)


def refuse_with_manual_optimization(run: ResolvedRun) -> None:
    """A one-line ConfigError for what cannot run with a module that optimizes by hand."""
    cfg = run.cfg
    clip = cfg.trainer.gradient_clip_val
    if clip:  # 0 and null: no automatic clipping, as in Lightning
        raise ConfigError(
            "trainer.gradient_clip_val",
            clip,
            "automatic gradient clipping is not supported for manual optimization (Lightning refuses it too)",
            allowed="null or 0 for a module with automatic_optimization = False",
            hint="remove it and call self.clip_gradients(opt, gradient_clip_val=..., "
            'gradient_clip_algorithm="norm") in training_step',
        )
    if run.entry.name == "fsdp":
        raise ConfigError(
            "strategy",
            "fsdp",
            "manual optimization (automatic_optimization = False) fails under FSDP1 "
            "(manual_backward inside the wrapper's forward; Lightning's FSDPStrategy fails alike)",
            allowed="fsdp2, ddp, model_parallel",
            hint="use strategy=fsdp2 (the same sharding, FULL_SHARD = reshard_after_forward=true)",
        )


def declares_manual_optimization(target: str) -> bool:
    """Whether the class ``target`` (``package.module.Class``) or a base class it names sets
    ``automatic_optimization`` to False, read from the source files without importing them."""
    module, _, name = target.rpartition(".")
    return _class_declares(module, name, depth=0)


def _class_declares(module: str, name: str, depth: int) -> bool:
    tree = _parse(module)
    if tree is None or depth > 8:
        return False
    found = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name), None)
    if found is None:
        imported = _imported_from(tree, name)
        return imported is not None and _class_declares(*imported, depth=depth + 1)
    if any(_sets_false(node) for node in ast.walk(found)):
        return True
    for base in found.bases:
        if isinstance(base, ast.Name) and _class_declares(module, base.id, depth + 1):
            return True
    return False


def _sets_false(node: ast.AST) -> bool:
    """``self.automatic_optimization = False``, or a property of that name that returns False."""
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        named = any(isinstance(t, ast.Attribute) and t.attr == _ATTRIBUTE for t in targets)
        return named and isinstance(node.value, ast.Constant) and node.value.value is False
    if isinstance(node, ast.FunctionDef) and node.name == _ATTRIBUTE:
        returns = [r for r in ast.walk(node) if isinstance(r, ast.Return)]
        return any(isinstance(r.value, ast.Constant) and r.value.value is False for r in returns)
    return False


def _imported_from(tree: ast.Module, name: str) -> tuple[str, str] | None:
    """``from package.module import name [as alias]`` -> (package.module, name)."""
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    return node.module, alias.name
    return None


def _parse(module: str) -> ast.Module | None:
    spec = find_module(module) if module else None
    origin = getattr(spec, "origin", None)
    if not origin or not origin.endswith(".py"):
        return None
    try:
        return ast.parse(Path(origin).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None
