"""The model registry (one entry per model kind) and the strategy tables keyed by entry name."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from conftest import composed, run_of

from fsdp_cli.config.model_kinds import (
    HF,
    KINDS,
    LIGHTNING,
    LLAMA,
    MODULE,
    ModelKind,
    kind_of,
    kind_of_target,
)

ROOT = Path(__file__).resolve().parents[1]
MODEL_SCHEMAS = {"LlamaConfig", "HFModelConfig", "CustomModelConfig"}


def _isinstance_on_model_schemas(path: Path) -> list[int]:
    """Lines of ``isinstance(x, <a model config class>)`` (a tuple of classes included)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "isinstance" and len(node.args) == 2:
            names = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
            if names & MODEL_SCHEMAS:
                lines.append(node.lineno)
    return lines


def test_no_module_switches_on_the_model_config_class() -> None:
    """Each model question is its kind's entry's to answer (config/model_kinds.py)."""
    found = {
        str(path.relative_to(ROOT)): lines
        for path in (ROOT / "fsdp_cli").rglob("*.py")
        if path.name != "model_kinds.py" and (lines := _isinstance_on_model_schemas(path))
    }
    assert found == {}


@pytest.mark.parametrize(
    ("overrides", "kind"),
    [
        (["model=tiny"], LLAMA),
        (["model=hf"], HF),
        (["model=custom", "model._target_=assets.custom_models.TinyLM"], MODULE),
        (["model=custom", "model._target_=assets.model_parallel_module.FeedForwardLM"], MODULE),
    ],
)
def test_each_model_option_has_its_entry(overrides: list[str], kind: ModelKind) -> None:
    """Before launch a custom target is MODULE whatever it is (the parent does not import it)."""
    cfg = composed(*overrides)
    assert kind_of(cfg.model) is kind and isinstance(cfg.model, kind.schema)


def test_a_custom_target_is_told_apart_once_imported() -> None:
    module = composed("model=custom", "model._target_=assets.custom_models.TinyLM").model
    lightning = composed("model=custom", "model._target_=assets.model_parallel_module.FeedForwardLM").model
    assert (kind_of_target(module), kind_of_target(lightning)) == (MODULE, LIGHTNING)
    assert kind_of_target(composed("model=tiny").model) is LLAMA


def test_every_entry_answers_the_coming_features_hooks_with_a_documented_function() -> None:
    """Pipeline stages, adapters, packed sequences: every kind answers (None: not supported yet)."""
    for kind in KINDS.values():
        assert kind.stage_split_points.__doc__ and kind.adapter_targets.__doc__, kind.name
        assert isinstance(kind.document_masks, bool)


def test_the_llama_hooks_name_its_real_blocks_and_linear_layers() -> None:
    """Where the built-in model may be cut into stages, and what adapters may wrap, name modules
    that a meta-device build has."""
    import torch
    from torch import nn

    from fsdp_cli.models.llama import Llama

    model_cfg = composed("model=tiny").model
    with torch.device("meta"):
        modules = dict(Llama(model_cfg).named_modules())
    assert LLAMA.stage_split_points(model_cfg) == [f"layers.{i}" for i in range(model_cfg.n_layers)]
    assert all(name in modules for name in LLAMA.stage_split_points(model_cfg))
    linear = {
        name.split(".", 2)[-1]
        for name, m in modules.items()
        if isinstance(m, nn.Linear) and "layers." in name
    }
    assert set(LLAMA.adapter_targets(model_cfg)) == linear
    assert (MODULE.stage_split_points(None), LIGHTNING.adapter_targets(None), LIGHTNING.document_masks) == (
        None,
        None,
        False,
    )
    # (model=hf and a plain module: the layers adapters wrap are found on their meta model)
    assert HF.adapter_targets(None) == MODULE.adapter_targets(None) == []


def test_tensor_parallel_sizes_are_one_check_for_every_kind() -> None:
    """The built-in model's sizes come from its entry; ``tp`` is held to them in one place."""
    from fsdp_cli.config.model_kinds import check_tp_sizes
    from fsdp_cli.errors import ConfigError

    run = run_of(composed("tp=4", "devices=4", "model.n_kv_heads=2"))
    assert check_tp_sizes in run.model_kind.checks
    with pytest.raises(ConfigError, match=r"^tp=4: model.n_kv_heads=2 is not divisible by tp=4"):
        check_tp_sizes(run)
    assert MODULE.tp_sizes(None) == {}


def test_every_strategy_entry_has_a_builder_and_a_planner_slot() -> None:
    """The config room holds the entries; the builder and the planner live where the layering
    lets them be referenced directly, keyed by the entry's name."""
    from fsdp_cli.builders.fsdp1 import build_fsdp1
    from fsdp_cli.builders.strategy import BUILDERS
    from fsdp_cli.config.strategies import ENTRIES
    from fsdp_cli.plan.memory import FSDP1, PLANNERS

    assert set(BUILDERS) == set(ENTRIES) == set(PLANNERS)
    assert (BUILDERS["fsdp"], PLANNERS["fsdp"], PLANNERS["model_parallel"]) == (build_fsdp1, FSDP1, None)
