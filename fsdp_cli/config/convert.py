"""Conversion between the composed config and the typed :class:`TrainConfig`.

The same functions serve the parent (Hydra's composed DictConfig) and every rank (the
resolved ``config.yaml`` in the run directory), so a rank sees exactly what the parent
validated. Only OmegaConf is used here, never Hydra.
"""

from __future__ import annotations

import enum
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from fsdp_cli.adapters.options import AdapterOptions
from fsdp_cli.config.model_kinds import KINDS, kind_of
from fsdp_cli.config.schema import (
    ChatDataConfig,
    CheckpointConfig,
    CustomModelConfig,
    DataModuleConfig,
    JsonlDataConfig,
    LauncherConfig,
    LoggerConfig,
    OptimConfig,
    PrecisionConfig,
    SweepConfig,
    SyntheticDataConfig,
    TextDataConfig,
    TokensDataConfig,
    TrainConfig,
    TrainerConfig,
    WrapConfig,
)
from fsdp_cli.config.strategies import SCHEMAS as STRATEGY_SCHEMAS
from fsdp_cli.config.unknown_keys import field_names, unknown_key_hint, unknown_keys
from fsdp_cli.errors import ConfigError
from fsdp_cli.pipeline.options import PipelineOptions

# The `name` key of each group's node selects its schema (strategies: their registry entries).
MODEL_SCHEMAS: dict[str, type] = {k.name: k.schema for k in KINDS.values() if not k.target_decides}
DATA_SCHEMAS: dict[str, type] = {
    "synthetic": SyntheticDataConfig,
    "text": TextDataConfig,
    "tokens": TokensDataConfig,
    "jsonl": JsonlDataConfig,
    "chat": ChatDataConfig,
}
GROUP_SCHEMAS: dict[str, dict[str, type]] = {
    "strategy": STRATEGY_SCHEMAS,
    "model": MODEL_SCHEMAS,
    "data": DATA_SCHEMAS,
}
"""The config groups whose option (its ``name``) selects the schema."""
SECTION_SCHEMAS: dict[str, type] = {
    "precision": PrecisionConfig,
    "wrap": WrapConfig,
    "checkpoint": CheckpointConfig,
    "trainer": TrainerConfig,
    "logger": LoggerConfig,
    "optim": OptimConfig,
    "launcher": LauncherConfig,
    "sweep": SweepConfig,
    "pipeline": PipelineOptions,
    "peft": AdapterOptions,
}
_MISSING = "???"


def to_train_config(cfg: DictConfig | Mapping[str, Any]) -> TrainConfig:
    """Turn a composed (or loaded) config into a :class:`TrainConfig`, resolving interpolations."""
    if isinstance(cfg, DictConfig):
        # Sections stay nodes: those Hydra composed against their schema convert directly.
        raw: dict[str, Any] = {k: _section(cfg, k) for k in cfg if k != "hydra"}
    else:
        plain = OmegaConf.to_container(OmegaConf.create(dict(cfg)), resolve=True)
        assert isinstance(plain, dict)
        raw = {k: v for k, v in plain.items() if k != "hydra"}

    fields: dict[str, Any] = {}
    fields["strategy"] = _by_name("strategy", raw.get("strategy"), STRATEGY_SCHEMAS)
    fields["model"] = _model(raw.get("model"))
    fields["data"] = _data(raw.get("data"))
    if "callbacks" in raw:
        fields["callbacks"] = _callbacks(raw["callbacks"])
    for key, schema in SECTION_SCHEMAS.items():
        node = raw.get(key)
        fields[key] = _typed(key, schema, node if node is not None else {})
    hints = typing.get_type_hints(TrainConfig)
    for key, value in raw.items():
        if key in fields:
            continue
        if key not in hints:
            raise ConfigError(key, value, "unknown top-level key", allowed=", ".join(sorted(hints)))
        fields[key] = _coerce(key, hints[key], value)
    return TrainConfig(**fields)


def _coerce(key: str, hint: Any, value: Any) -> Any:
    if isinstance(hint, type) and issubclass(hint, enum.Enum) and not isinstance(value, hint):
        try:
            return hint[str(value)]
        except KeyError:
            raise ConfigError(key, value, "unknown value", allowed=", ".join(hint.__members__)) from None
    return value


def load_train_config(path: str | Path) -> TrainConfig:
    """Read a resolved ``config.yaml`` written by the entry point."""
    return to_train_config(OmegaConf.to_container(OmegaConf.load(path)))  # type: ignore[arg-type]


def to_yaml(cfg: TrainConfig) -> str:
    """The resolved config as YAML; :func:`load_train_config` reads it back to an equal object."""
    return OmegaConf.to_yaml(OmegaConf.create(to_container(cfg)))


def to_container(cfg: TrainConfig) -> dict[str, Any]:
    """Plain dict of the typed config (enums as their values); custom models keep ``_target_``."""
    out = OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True)
    assert isinstance(out, dict)
    node = kind_of(cfg.model).yaml_node
    if node is not None:
        out["model"] = node(cfg.model)
    if isinstance(cfg.data, DataModuleConfig):
        out["data"] = {"name": cfg.data.name, "_target_": cfg.data.target, **cfg.data.kwargs}
    return out


def _by_name(group: str, node: Any, schemas: Mapping[str, type]) -> Any:
    if not isinstance(node, Mapping):
        raise ConfigError(group, node, "no option selected", allowed=", ".join(schemas))
    name = node.get("name")
    if name not in schemas:
        raise ConfigError(f"{group}.name", name, "unknown option", allowed=", ".join(schemas))
    return _typed(group, schemas[name], node)


def _section(cfg: DictConfig, key: str) -> Any:
    """A top-level value of a composed config, resolved; a mapping stays a node (converted later
    against its schema, interpolations resolved against the whole config)."""
    value = OmegaConf.select(cfg, key, default=_MISSING, throw_on_missing=False)
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_list(value) else value


def _typed(key: str, schema: type, node: Mapping[str, Any]) -> Any:
    try:
        if isinstance(node, DictConfig) and OmegaConf.get_type(node) is schema:
            # Composed against this schema: types checked. A key Hydra appended to it
            # (`+trainer.check_val_every_n_epoch=2`) to_object would drop without a word.
            # (The merge below refuses such keys itself.)
            for full, name, owner, value in unknown_keys(schema, node, key):
                raise ConfigError(
                    full,
                    _plain(value),
                    "not a key of this config",
                    allowed=", ".join(field_names(owner)),
                    hint=unknown_key_hint(owner, name, full, GROUP_SCHEMAS),
                )
            return OmegaConf.to_object(node)
        merged = OmegaConf.merge(OmegaConf.structured(schema), node)
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        bad = str(getattr(err, "full_key", None) or "?")
        problem = str(err).splitlines()[0]
        if bad == "?":
            raise ConfigError(key, _plain(node), problem) from None
        where = bad if bad.startswith(f"{key}.") else f"{key}.{bad}"
        raise ConfigError(where, _plain(node), problem) from None


def _plain(node: Any, *, resolve: bool = False) -> Any:
    return OmegaConf.to_container(node, resolve=resolve) if isinstance(node, DictConfig) else node


def _callbacks(node: Any) -> dict[str, Any]:
    """``callbacks``: ``{name: {_target_: ..., arg: value}}`` as plain containers (instantiated in
    the ranks); null entries stay null (switched off, e.g. one a recipe defines)."""
    plain = _plain(node, resolve=True)
    if plain is None:
        return {}
    if not isinstance(plain, Mapping):
        raise ConfigError(
            "callbacks", plain, "must map names to callbacks", hint="+callbacks.NAME._target_=dotted.Class"
        )
    for name, entry in plain.items():
        if entry is not None and (not isinstance(entry, Mapping) or "_target_" not in entry):
            raise ConfigError(
                f"callbacks.{name}",
                entry,
                "a callback needs the class to build",
                allowed="a mapping with _target_ (and the class's keyword arguments), or null",
                hint=f"+callbacks.{name}._target_=lightning.pytorch.callbacks.LearningRateMonitor",
            )
    return dict(plain)


def _model(node: Any) -> Any:
    # (`in` on a DictConfig skips keys whose value is missing: ask its keys.)
    if isinstance(node, Mapping) and ("_target_" in node.keys() or node.get("name") == "custom"):
        node = _plain(node, resolve=True)
        if "_target_" in node:
            target = node["_target_"]
            kwargs = {k: v for k, v in node.items() if k != "_target_"}
        else:
            target, kwargs = node.get("target"), dict(node.get("kwargs") or {})
        if not target or target == _MISSING:
            raise ConfigError(
                "model._target_",
                None,
                "model=custom needs the class or factory to build",
                allowed="an importable dotted path",
                hint="model._target_=my_pkg.my_module.MyModel +model.hidden=256",
            )
        vocab = kwargs.get("vocab_size")
        return CustomModelConfig(target=str(target), kwargs=kwargs, vocab_size=vocab)
    return _by_name("model", node, MODEL_SCHEMAS)


def _data(node: Any) -> Any:
    """The ``data`` group: a token data option by its schema, or ``data=datamodule`` (a
    LightningDataModule of the user's, its free keys its constructor's arguments)."""
    if not (isinstance(node, Mapping) and node.get("name") == DataModuleConfig.name):
        return _by_name("data", node, DATA_SCHEMAS)
    plain = _plain(node, resolve=True)
    target = plain.get("_target_")
    if not target or target == _MISSING:
        raise ConfigError(
            "data._target_",
            None,
            "data=datamodule needs the LightningDataModule class to build",
            allowed="an importable dotted path",
            hint="data._target_=my_pkg.my_module.MyDataModule +data.batch_size=32",
        )
    kwargs = {k: v for k, v in plain.items() if k not in ("_target_", "name")}
    return DataModuleConfig(target=str(target), kwargs=kwargs)
