"""Every number has a declared range, checked before launch; the precision table is the one
owner of what a precision means (and MFU's peak follows the compute dtype in effect)."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any

import pytest
from conftest import composed, run_of

from fsdp_cli.config import schema
from fsdp_cli.config.convert import DATA_SCHEMAS, MODEL_SCHEMAS, STRATEGY_SCHEMAS
from fsdp_cli.config.validate import checked_run, validate
from fsdp_cli.errors import ConfigError
from fsdp_cli.launch.layout import resolve_layout
from fsdp_cli.ranges import field_range, is_numeric

# `Any` fields that hold numbers; the others (`strategy`, `model`, `data`: group sections;
# `reshard_after_forward`: true/false/an int dividing the shard size, a cross-field check) do not
# have one range of their own.
NUMERIC_ANY = {"TrainConfig.dp", "TrainConfig.devices"}


def _schemas() -> list[type]:
    """Every dataclass a composed config can hold, found by walking the schemas' field types."""
    todo = [
        schema.TrainConfig,
        schema.CustomModelConfig,
        *STRATEGY_SCHEMAS.values(),
        *MODEL_SCHEMAS.values(),
        *DATA_SCHEMAS.values(),
    ]
    seen: list[type] = []
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.append(cls)
        for hint in typing.get_type_hints(cls).values():
            for candidate in (hint, *typing.get_args(hint)):
                if dataclasses.is_dataclass(candidate) and isinstance(candidate, type):
                    todo.append(candidate)
    return seen


def test_every_numeric_field_of_every_schema_declares_its_range() -> None:
    schemas = _schemas()
    assert len(schemas) > 20, [s.__name__ for s in schemas]  # the walk found them all
    missing = []
    for cls in schemas:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            key = f"{cls.__name__}.{f.name}"
            numeric = is_numeric(hints[f.name]) or key in NUMERIC_ANY
            if numeric and field_range(f) is None:
                missing.append(key)
    assert missing == [], "declare a range with metadata=at_least(...)/positive()/between(...)"


def _refused(*overrides: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        validate(checked_run(resolve_layout(composed(*overrides), {}, gpus=0)))
    return info.value


@pytest.mark.parametrize(
    ("override", "key", "words"),
    [
        # Each of these ran before: a traceback after 11 s, a run trained into NaN, or
        # Lightning's error at the first validation.
        ("wrap.min_num_params=-5", "wrap.min_num_params=-5", "must be at least 1"),
        ("optim.eps=0", "optim.eps=0.0", "must be positive"),
        ("model.rope_theta=-1", "model.rope_theta=-1.0", "must be positive"),
        ("trainer.limit_val_batches=-1", "trainer.limit_val_batches=-1", "must be a finite number >= 0"),
        ("data.num_workers=-2", "data.num_workers=-2", "must be a finite number >= 0"),
        ("optim.lr=nan", "optim.lr=nan", "must be a finite number >= 0"),
        ("seed=-1", "seed=-1", "must be 0..4294967295"),
        ("checkpoint.keep_last=0", "checkpoint.keep_last=0", "must be at least 1"),
        ("strategy.ac_every_n_blocks=0", "strategy.ac_every_n_blocks=0", "must be at least 1"),
        ("launcher.max_restarts=-1", "launcher.max_restarts=-1", "must be a finite number >= 0"),
    ],
)
def test_a_number_outside_its_range_is_one_line_before_launch(override: str, key: str, words: str) -> None:
    line = _refused(override).one_line()
    assert line.startswith(f"{key}: {words}"), line
    assert "allowed: " in line, line


def test_null_is_allowed_where_the_type_allows_it_and_named_in_the_line() -> None:
    validate(
        checked_run(
            resolve_layout(
                composed("trainer.gradient_clip_val=null", "checkpoint.every_n_steps=null"), {}, gpus=0
            )
        )
    )
    line = _refused("trainer.gradient_clip_val=-1").one_line()
    assert "must be a finite number >= 0" in line and "allowed: 0 or more, or null" in line, line
    assert "hint: " in line, line


def test_lightnings_limit_val_batches_0_turns_validation_off_and_below_is_refused_saying_so() -> None:
    """A Lightning user turns validation off with limit_val_batches=0, and so does this config."""
    validate(checked_run(resolve_layout(composed("trainer.limit_val_batches=0"), {}, gpus=0)))
    line = _refused("trainer.limit_val_batches=-1").one_line()
    assert line.startswith("trainer.limit_val_batches=-1: must be a finite number >= 0"), line
    assert "hint: trainer.limit_val_batches=0 turns validation off" in line, line


def test_a_range_reaches_the_config_reference() -> None:
    reference = (Path(__file__).resolve().parents[1] / "docs" / "config-reference.md").read_text()
    assert "| `optim.eps` | float | `1e-08` | AdamW epsilon" in reference
    assert "Allowed: > 0." in reference.split("`optim.eps`")[1].splitlines()[0]


# --------------------------------------------------------------------------- precision


H100 = "NVIDIA H100 80GB HBM3"


def _peak(*overrides: str) -> Any:
    from fsdp_cli.builders.callbacks import build_throughput

    return build_throughput(run_of(composed(*overrides), gpus=8), None, device_name=H100).peak_tflops


def test_mfu_peak_follows_the_compute_dtype_in_effect() -> None:
    """32-true with a bf16 mp_policy computes in bf16 (the all-gather casts the parameters):
    MFU is measured against the bf16 peak (989.5), not fp32's 66.9 (which read ~15x too high)."""
    assert _peak("precision=32-true", "strategy.mp_policy.param_dtype=bfloat16") == 989.5
    assert _peak("precision=32-true") == 66.9
    assert _peak("precision=bf16-mixed") == 989.5
    assert _peak("precision=bf16-true") == 989.5
    assert _peak("precision=64-true") is None


def test_every_consumer_reads_the_same_dtypes_for_an_explicit_policy() -> None:
    """The memory plan, MFU and the builders see one resolved precision."""
    from fsdp_cli.plan.memory import dtypes_of

    run = run_of(composed("precision=32-true", "strategy.mp_policy.param_dtype=bfloat16"), gpus=8)
    assert (run.precision.param, run.precision.compute, run.precision.reduce) == (
        "float32",
        "bfloat16",
        "bfloat16",  # FSDP reduces in the policy's param dtype when it names no reduce dtype
    )
    assert dataclasses.astuple(dtypes_of(run)) == (4, 2, 2)
    mixed = run_of(composed("precision=bf16-mixed"), gpus=8)
    assert (mixed.precision.compute, mixed.precision.reduce) == ("bfloat16", "float32")
    assert dataclasses.astuple(dtypes_of(mixed)) == (4, 2, 4)


def test_old_precision_names_are_aliases_in_the_table() -> None:
    from fsdp_cli.config.migrate import migrate

    cfg, notices = migrate(composed("precision='16'"))
    assert cfg.precision.name == "16-mixed" and "old name" in notices[0]
    with pytest.raises(ConfigError) as info:
        validate(
            checked_run(
                resolve_layout(dataclasses.replace(cfg, precision=schema.PrecisionConfig("fp8")), {}, gpus=0)
            )
        )
    line = info.value.one_line()
    assert line.startswith("precision=fp8: unknown precision; allowed: 32-true, bf16-mixed"), line
