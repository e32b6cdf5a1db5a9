"""The strategy schemas answer their own questions: no module switches on a strategy's config class
(``isinstance(cfg.strategy, FSDPConfig)``), as no module switches on a model's
(tests/test_model_kinds.py). A new question is a method of
:class:`~fsdp_cli.config.schema.StrategyAnswers`, answered by each schema that differs."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from fsdp_cli.config import schema
from fsdp_cli.parallel.options import ParallelizeSettings

ROOT = Path(__file__).resolve().parents[1]
STRATEGY_SCHEMAS = {
    name
    for name, cls in vars(schema).items()
    if inspect.isclass(cls) and issubclass(cls, (schema.StrategyAnswers, ParallelizeSettings))
}
"""Every strategy config class (and the bases they answer through), found rather than listed, so
that a new schema is held to this too."""


def _isinstance_on_strategy_schemas(path: Path) -> list[int]:
    """Lines of ``isinstance(x, <a strategy config class>)`` (a tuple of classes included)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "isinstance" and len(node.args) == 2:
            names = {
                n.id if isinstance(n, ast.Name) else n.attr
                for n in ast.walk(node.args[1])
                if isinstance(n, (ast.Name, ast.Attribute))
            }
            if names & STRATEGY_SCHEMAS:
                lines.append(node.lineno)
    return lines


def test_the_strategy_schemas_are_found() -> None:
    assert {
        "DDPConfig",
        "FSDP2Config",
        "FSDPConfig",
        "ModelParallelConfig",
        "StrategyAnswers",
    } <= STRATEGY_SCHEMAS


def test_no_module_switches_on_the_strategy_config_class() -> None:
    """Each strategy question is its schema's to answer (config/schema.py's StrategyAnswers)."""
    found = {
        str(path.relative_to(ROOT)): lines
        for path in (ROOT / "fsdp_cli").rglob("*.py")
        if (lines := _isinstance_on_strategy_schemas(path))
    }
    assert found == {}
