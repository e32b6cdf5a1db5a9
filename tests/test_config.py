"""Config tier: every group option and recipe composes into the typed config; the surface is pinned."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from conftest import composed

from fsdp_cli.config.convert import load_train_config, to_container, to_yaml
from fsdp_cli.config.schema import (
    Accelerator,
    CustomModelConfig,
    FSDP2Config,
    LlamaConfig,
    SyntheticDataConfig,
    TrainConfig,
    TrainerConfig,
)
from fsdp_cli.launch.layout import resolve_layout

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SNAPSHOT = Path(__file__).resolve().parent / "snapshots" / "default_config_keys.txt"
GROUPS = ("strategy", "precision", "wrap", "checkpoint", "model", "data", "trainer", "logger", "peft")
# Machines the layout is resolved for, whatever this one has (it may have 0 to 7 real GPUs).
EIGHT_GPUS = {"gpus": 8}
CPU = {"gpus": 0}


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIGS / group).glob("*.yaml"))


def test_every_group_has_options() -> None:
    for group in GROUPS:
        assert options(group), group


@pytest.mark.parametrize(("group", "option"), [(g, o) for g in GROUPS for o in options(g)])
def test_every_group_option_composes(group: str, option: str) -> None:
    needs_target = {
        ("model", "custom"): ["model._target_=tests.assets.custom_models.TinyLM"],
        ("data", "datamodule"): ["data._target_=tests.assets.lightning_habits.RegressionData"],
    }
    extra = needs_target.get((group, option), [])
    cfg = composed(f"{group}='{option}'", *extra)  # quoted: option names such as 16 are strings
    assert isinstance(cfg, TrainConfig)
    node = getattr(cfg, group)
    assert dataclasses.is_dataclass(node)


def test_default_config_keys_snapshot() -> None:
    """A new knob is added on purpose: update tests/snapshots/default_config_keys.txt with it."""
    cfg = composed()
    keys = sorted(_flat_keys(to_container(cfg)))
    assert keys == SNAPSHOT.read_text().split(), "\n".join(keys)


def test_defaults_without_gpu_are_fsdp2_on_two_cpu_processes() -> None:
    cfg = resolve_layout(composed(), {}, **CPU)
    assert isinstance(cfg.strategy, FSDP2Config)
    assert (cfg.accelerator, cfg.devices, cfg.num_nodes, cfg.dp, cfg.tp) == (Accelerator.cpu, 2, 1, 2, 1)
    assert cfg.precision.name == "32-true"
    assert isinstance(cfg.model, LlamaConfig) and isinstance(cfg.data, SyntheticDataConfig)
    assert cfg.data.vocab_size == cfg.model.vocab_size


def test_defaults_with_gpus_use_all_of_them_in_bf16() -> None:
    cfg = resolve_layout(composed(), {}, **EIGHT_GPUS)
    assert (cfg.accelerator, cfg.devices, cfg.dp, cfg.precision.name) == (Accelerator.gpu, 8, 8, "bf16-mixed")


def test_shorthands_and_user_keys() -> None:
    cfg = resolve_layout(
        composed("tp=2", "devices=4", "seed=7", "data.seq_len=16", "trainer.max_steps=3"), {}, **CPU
    )
    assert (cfg.dp, cfg.tp, cfg.devices, cfg.seed) == (2, 2, 4, 7)
    assert (cfg.data.seq_len, cfg.trainer.max_steps) == (16, 3)
    cfg = composed("data.vocab_size=100")
    assert cfg.data.vocab_size == 100


def test_custom_model_keeps_target_and_kwargs() -> None:
    cfg = composed(
        "model=custom", "model._target_=pkg.mod.Factory", "+model.hidden=64", "+model.vocab_size=99"
    )
    assert isinstance(cfg.model, CustomModelConfig)
    assert cfg.model.target == "pkg.mod.Factory"
    assert cfg.model.kwargs == {"hidden": 64, "vocab_size": 99}
    assert cfg.data.vocab_size == 99  # defaults to the model's vocabulary


def test_every_lightning_trainer_argument_is_ours_answered_or_named() -> None:
    """Each argument of the installed Lightning's ``Trainer`` is a ``trainer`` key of ours, or an
    unknown-key hint answers it (and every key the answer names exists), or the hint names it as
    one fsdp-train does not take: a Lightning release that adds an argument fails here."""
    import inspect
    import re

    import lightning as L

    from fsdp_cli.config.unknown_keys import LIGHTNING_TRAINER_ARGUMENTS, LIGHTNING_TRAINER_ONLY

    lightning_args = set(inspect.signature(L.Trainer.__init__).parameters) - {"self"}
    ours = {f.name for f in dataclasses.fields(TrainerConfig)}
    answered, named = set(LIGHTNING_TRAINER_ARGUMENTS), set(LIGHTNING_TRAINER_ONLY)
    assert not (ours & answered) and not (ours & named) and not (answered & named)
    assert lightning_args - ours - answered - named == set()  # a Lightning argument nobody answers
    assert (answered | named) - lightning_args == set()  # not (or no longer) Lightning's
    reference = (Path(__file__).resolve().parents[1] / "docs" / "config-reference.md").read_text()
    for name, answer in LIGHTNING_TRAINER_ARGUMENTS.items():
        for key in re.findall(r"\b(?:trainer|data|checkpoint)\.[a-z_]+", answer):
            assert f"| `{key}` |" in reference, (name, key)


def test_resolved_yaml_round_trips(tmp_path: Path) -> None:
    for overrides in (
        (),
        ("model=custom", "model._target_=a.b.C", "+model.n=3"),
        ("strategy=ddp", "data=text"),
    ):
        cfg = dataclasses.replace(resolve_layout(composed(*overrides), {}, **CPU), run_dir=str(tmp_path))
        path = tmp_path / "config.yaml"
        path.write_text(to_yaml(cfg))
        assert load_train_config(path) == cfg


@pytest.mark.parametrize(
    ("overrides", "error", "words"),
    [
        (
            ["strategy.reshard_after_forwrd=true"],
            "ConfigAttributeError",
            "Key 'reshard_after_forwrd' not in 'FSDP2Config'",
        ),
        (
            ["strategy.activation_checkpointing=fulll"],
            "ValidationError",
            "Invalid value 'fulll', expected one of [none, full, selective]",
        ),
        (
            ["trainer.max_steps=many"],
            "ValidationError",
            "Value 'many' of type 'str' could not be converted to Integer",
        ),
        (
            ["strategy=ddp", "strategy.bucket_cap_mb=x"],
            "ValidationError",
            "Value 'x' of type 'str' could not be converted to Integer",
        ),
    ],
)
def test_typed_config_rejects_wrong_types_while_composing(
    overrides: list[str], error: str, words: str
) -> None:
    """The schema itself refuses them (not some later failure): the cause is OmegaConf's check."""
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException) as info:
        composed(*overrides)
    cause = info.value.__cause__
    assert type(cause).__name__ == error and words in str(cause), repr(cause)


def test_unknown_group_option_is_refused_while_composing() -> None:
    from hydra.errors import MissingConfigException

    with pytest.raises(MissingConfigException, match="Could not find 'precision/bf17'"):
        composed("precision=bf17")


def _flat_keys(node: object, prefix: str = "") -> list[str]:
    if isinstance(node, dict) and node:  # an empty mapping (callbacks: {}) is a key of its own
        out: list[str] = []
        for key, value in node.items():
            out.extend(_flat_keys(value, f"{prefix}{key}."))
        return out
    return [prefix[:-1]]


def test_hydra_is_imported_only_by_the_entry_point() -> None:
    """Nothing under fsdp_cli except the entry point (cli/, the sweep's launcher and report in
    sweep/, config/store.py, and Hydra's entry in compat/) imports Hydra."""
    allowed = {"config/store.py", "compat/hydra_internals.py"}
    package = Path(__file__).resolve().parents[1] / "fsdp_cli"
    offenders = [
        p.relative_to(package).as_posix()
        for p in package.rglob("*.py")
        if p.relative_to(package).as_posix() not in allowed
        and p.relative_to(package).parts[0] not in ("cli", "sweep")
        and ("import hydra" in p.read_text() or "from hydra" in p.read_text())
    ]
    assert offenders == []
