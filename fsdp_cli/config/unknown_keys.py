"""A key the schema does not have: found before launch, answered with where the setting lives.

Two ways in. ``trainer.check_val_every_n_epoch=2`` is refused by Hydra's composition (the key is
not in the schema), and :mod:`fsdp_cli.cli.hydra_errors` prints the line.
``+trainer.check_val_every_n_epoch=2`` is accepted by Hydra (``+`` appends) but a typed section
has no field to hold it: :func:`unknown_keys` finds it in :mod:`fsdp_cli.config.convert`, which
refuses it rather than letting the conversion drop it. In fsdp-train's own sections, ``+`` adds
keys only where the config takes free keyword arguments: a custom model (``model=custom``), a
DataModule (``data=datamodule``) and ``callbacks``.

Our users come from Lightning scripts, so a key that is one of Lightning ``Trainer``'s arguments
gets the way to say the same thing here, or is named as one fsdp-train does not take; any other
gets the nearest keys of its section.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Iterator, Mapping
from typing import Any

LIGHTNING_TRAINER_ARGUMENTS: dict[str, str] = {
    "precision": "precision=NAME is a config group of its own; fsdp-train --help lists the names",
    "devices": "devices=N, a top-level key",
    "num_nodes": "num_nodes=N, a top-level key",
    "accelerator": "accelerator=cpu or accelerator=gpu, a top-level key",
    "strategy": "strategy=NAME is a config group of its own (fsdp2, fsdp, model_parallel, ddp, ...)",
    "check_val_every_n_epoch": (
        "trainer.val_check_interval=N validates every N optimizer steps; null (the default) validates "
        "a module's own val_dataloader after every epoch"
    ),
    "callbacks": "+callbacks.NAME._target_=dotted.Class adds a callback",
    "logger": "logger=csv, tensorboard, mlflow or wandb is a config group of its own",
    "default_root_dir": "hydra.run.dir=PATH chooses the run directory",
    "enable_checkpointing": (
        "checkpoint.save_last=false checkpoint.save_on_sigterm=false (with checkpoint.every_n_steps "
        "unset) saves no checkpoint"
    ),
    "fast_dev_run": "trainer.max_steps=1 checkpoint.save_last=false",
    "limit_train_batches": "trainer.max_steps bounds training",
}
"""Lightning ``Trainer`` arguments that ``trainer`` has no key of that name for -> how to say it here."""

LIGHTNING_TRAINER_ONLY = frozenset(
    {
        "barebones",
        "benchmark",
        "detect_anomaly",
        "enable_autolog_hparams",
        "enable_model_summary",
        "inference_mode",
        "limit_predict_batches",
        "limit_test_batches",
        "max_time",
        "min_epochs",
        "min_steps",
        "model_registry",
        "overfit_batches",
        "plugins",
        "reload_dataloaders_every_n_epochs",
        "sync_batchnorm",
        "use_distributed_sampler",
    }
)
"""The other Lightning ``Trainer`` arguments: fsdp-train sets them itself or has no use for them
(tests/test_config.py checks that every argument of the installed Lightning is ours, answered
above or listed here)."""

FOREIGN_NAMES: dict[str, str] = {
    "learning_rate": "optim.lr",
    "lr_scheduler_type": "optim.scheduler",
    "scheduler_type": "optim.scheduler",
    "adam_beta1": "optim.betas",
    "adam_beta2": "optim.betas",
    "adam_epsilon": "optim.eps",
    "num_warmup_steps": "optim.warmup_steps",
    "max_grad_norm": "trainer.gradient_clip_val",
    "clip_grad_norm": "trainer.gradient_clip_val",
    "num_train_epochs": "trainer.max_epochs",
    "epochs": "trainer.max_epochs",
    "gradient_accumulation_steps": "trainer.accumulate_grad_batches",
    "logging_steps": "trainer.log_every_n_steps",
    "save_steps": "checkpoint.every_n_steps",
    "per_device_train_batch_size": "data.micro_batch_size",
    "batch_size": "data.global_batch_size (all ranks together) or data.micro_batch_size (one forward)",
    "train_batch_size": "data.global_batch_size",
    "num_epochs": "trainer.max_epochs",
    "max_seq_length": "data.seq_len",
    "max_length": "data.seq_len",
    "seq_length": "data.seq_len",
    "sequence_len": "data.seq_len",
    "lora_r": "peft.r (with peft=lora)",
    "lora_rank": "peft.r (with peft=lora)",
    "lora_alpha": "peft.alpha (with peft=lora)",
    "lora_dropout": "peft.dropout (with peft=lora)",
    "lora_target_modules": "peft.targets (with peft=lora)",
    "gradient_checkpointing": "strategy.activation_checkpointing=full",
    "context_parallel_size": "cp",
    "expert_parallel_size": "ep",
    "tensor_parallel_size": "tp",
    "pipeline_parallel_size": "pp",
}
"""Names other tools give a setting (Hugging Face's TrainingArguments, torch's optimizers,
torchtune's recipes) -> the key that holds it here, wherever the user put them."""

PLUS_NOTE = "+ adds keys only to the arguments of a custom model and a data=datamodule, and to callbacks"


def field_names(schema: type) -> list[str]:
    return [f.name for f in dataclasses.fields(schema)]


def unknown_key_hint(
    schema: type, key: str, full_key: str, groups: Mapping[str, Mapping[str, type]] | None = None
) -> str:
    """How to say what ``full_key`` (whose last part ``key`` is not a field of ``schema``) meant.
    ``groups``: the config groups' option schemas (``convert.GROUP_SCHEMAS``), for a top-level key
    that one of them has."""
    note = f" ({PLUS_NOTE})" if schema.__module__.startswith("fsdp_cli.") else ""
    section = full_key.rpartition(".")[0]
    if section == "trainer" and key in LIGHTNING_TRAINER_ARGUMENTS:
        return f"{LIGHTNING_TRAINER_ARGUMENTS[key]}{note}"
    if section == "trainer" and key in LIGHTNING_TRAINER_ONLY:
        return f"a Lightning Trainer argument that fsdp-train sets itself or does not take{note}"
    if key in FOREIGN_NAMES and FOREIGN_NAMES[key] != full_key:
        return f"did you mean {FOREIGN_NAMES[key]}? ({key} is its name elsewhere){note}"
    if not section:  # a top-level key: a section may have it (max_steps -> trainer.max_steps)
        owners = [
            f"{name}.{key}"
            for name, schemas in section_schemas(schema, groups or {})
            if any(key in field_names(c) for c in schemas)
        ]
        if owners:
            return f"did you mean {' or '.join(owners)}?{note}"
    close = difflib.get_close_matches(key, field_names(schema), n=2)
    if close:
        prefix = f"{section}." if section else ""
        return f"did you mean {' or '.join(prefix + c for c in close)}?{note}"
    return f"fsdp-train --cfg job prints every key{note}"


def section_schemas(schema: type, groups: Mapping[str, Mapping[str, type]]) -> list[tuple[str, list[type]]]:
    """Each section of ``schema`` with the schemas it can hold: the field's own dataclass, or for
    a config group (typed ``Any``) each option's schema."""
    hints = typing.get_type_hints(schema)
    found = []
    for name in field_names(schema):
        own = dataclass_of(hints[name])
        options = [own] if own is not None else list(groups[name].values()) if name in groups else []
        if options:
            found.append((name, options))
    return found


def unknown_keys(schema: type, node: Mapping[str, Any], prefix: str) -> Iterator[tuple[str, str, type, Any]]:
    """``(full key, key, schema, value)`` for each key of ``node`` (and of its nested sections)
    that ``schema`` has no field for."""
    names, hints = field_names(schema), typing.get_type_hints(schema)
    for key in node.keys():
        full = f"{prefix}.{key}"
        if key not in names:
            yield full, str(key), schema, _value(node, key)
            continue
        nested = dataclass_of(hints[key])
        if nested is not None and isinstance(child := _value(node, key), Mapping):
            yield from unknown_keys(nested, child, full)


def _value(node: Mapping[str, Any], key: str) -> Any:
    try:
        return node.get(key)
    except Exception:  # noqa: BLE001 - a missing or unresolvable value: its own check reports it
        return None


def dataclass_of(hint: Any) -> type | None:
    """The dataclass a field holds (``X`` or ``X | None``), else None."""
    candidates = (
        typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    )
    for candidate in candidates:
        if isinstance(candidate, type) and dataclasses.is_dataclass(candidate):
            return candidate
    return None
