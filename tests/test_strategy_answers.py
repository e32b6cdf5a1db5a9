"""The strategy schemas answer their own questions: no module switches on a strategy's config class
(``isinstance(cfg.strategy, FSDPConfig)``), as no module switches on a model's
(tests/test_model_kinds.py). A new question is a method of
:class:`~fsdp_cli.config.schema.StrategyAnswers`, answered by each schema that differs; the
answers that replaced the switches are held here to what the switches said."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
from conftest import composed, run_of

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


@pytest.mark.parametrize(
    ("overrides", "refused"),
    [
        (
            ["strategy=ddp"],
            "strategy=ddp: DistributedDataParallel reads its parameters when built: no fake step",
        ),
        (
            ["strategy=fsdp"],
            "torch's MemTracker cannot follow FSDP1's use_orig_params views "
            "(strategy.use_orig_params=false is measured): no fake step",
        ),
        (["strategy=fsdp", "strategy.use_orig_params=false"], None),
        (["strategy=fsdp2"], None),
    ],
    ids=["ddp", "fsdp1", "fsdp1-no-orig-params", "fsdp2"],
)
def test_which_strategies_a_fake_step_cannot_measure(overrides: list[str], refused: str | None) -> None:
    """The rehearsal's fake step asks the strategy's schema (``fake_step_refusal``), and says why
    it skips one in the strategy's own words."""
    from fsdp_cli.plan.fake_step import _unsupported

    reason = _unsupported(run_of(composed("model=tiny", "devices=2", *overrides)))
    assert reason == refused


def test_the_layout_search_starts_from_the_runs_own_fsdp2_settings() -> None:
    """``fsdp-plan --search`` varies FSDP2 from the run's own settings under fsdp2 (here its
    compile flag survives), from FSDP2's defaults under any other strategy."""
    from fsdp_cli.plan.search import candidates

    own = candidates(run_of(composed("model=tiny", "devices=2", "strategy=fsdp2", "strategy.compile=true")))
    other = candidates(run_of(composed("model=tiny", "devices=2", "strategy=ddp")))
    fsdp2 = lambda found: {c.strategy.compile for _, c in found if c.strategy.name == "fsdp2"}  # noqa: E731
    assert (fsdp2(own), fsdp2(other)) == ({True}, {False})
