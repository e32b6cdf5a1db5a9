"""Hydra internals: its error reporter, which has no public hook, its run-mode probe, the
config ``--cfg job`` prints, the ConfigStore's repository (schemas stored unconverted), and the
defaults tree's map of interpolations (built only where a defaults list has one)."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from hydra._internal import defaults_list as _defaults_list
from hydra._internal import utils as _hydra_utils
from hydra._internal.hydra import Hydra as _Hydra
from hydra.core.config_store import ConfigNode, ConfigStore
from omegaconf import DictConfig, OmegaConf, open_dict

from fsdp_cli.compat import require

Reporter = Callable[[Callable[[], Any]], Any]

ENTRIES = [
    (_hydra_utils, "run_and_report"),
    (_Hydra, "get_mode"),
    (_Hydra, "get_sanitized_cfg"),
    (ConfigStore.instance(), "repo"),
    (_defaults_list, "_create_interpolation_map"),
]
for _owner, _name in ENTRIES:
    require(_owner, _name, "hydra-core")


def wrap_run_and_report(make_reporter: Callable[[Reporter], Reporter]) -> None:
    """Replace ``hydra._internal.utils.run_and_report`` (which ``@hydra.main`` calls around
    composing and running) with ``make_reporter(original)``."""
    _hydra_utils.run_and_report = make_reporter(_hydra_utils.run_and_report)


class _Unconverted:
    """A schema dataclass in the ConfigStore as it is: Hydra deep-copies a stored node each time
    a composition loads it (``ConfigStore.load``: the node alone), and this copy is the conversion.

    Hydra 1.3.8 also deep-copies its whole config repository once per composition
    (``CachingConfigRepository``), the ConfigStore and every stored node with it: copied as a
    part of that (a copy already under way, so ``memo`` holds its parents), a node stays as it is,
    unconverted, to be converted when that copy of the store loads it (14 schemas converted where
    a command loads 4 of them: some 40 ms of every config-only command)."""

    def __init__(self, schema: type) -> None:
        self.schema = schema

    def __deepcopy__(self, memo: dict[int, Any]) -> DictConfig | _Unconverted:
        if memo:  # a part of a larger copy (the repository's): nothing to copy, it never changes
            return self
        return OmegaConf.structured(self.schema)


def store_schema(name: str, schema: type, group: str | None = None) -> None:
    """``ConfigStore.instance().store(name, schema, group)``, converting the dataclass to a config
    when a composition loads it rather than now: ``store`` converts every schema at once (a
    command composes 4 of the 15: about 40 ms of every config-only command), and ``load``
    deep-copies the converted config again."""
    folder = ConfigStore.instance().repo
    for part in group.split("/") if group else ():
        folder = folder.setdefault(part, {})
    file = f"{name}.yaml"
    folder[file] = ConfigNode(name=file, node=_Unconverted(schema), group=group, package=None, provider=None)  # type: ignore[arg-type]


def interpolation_maps_only_where_used() -> None:
    """Hydra builds, for every node of the defaults tree, a config of every group's choice (an
    ``OmegaConf.create`` of some 20 keys, about 2 ms) to resolve the interpolations among the
    node's defaults (``db: ${db_type}``), and uses it only when one of them is an interpolation:
    fsdp-train's config has none, and 23 nodes (40-50 ms of every config-only command). Where a
    defaults list holds no interpolation the map is not built."""
    original = _defaults_list._create_interpolation_map
    if getattr(original, "only_where_used", False):
        return

    def only_where_used(overrides: Any, defaults: list[Any], self_added: bool) -> Any:
        if any(d.is_interpolation() for d in defaults):
            return original(overrides, defaults, self_added)
        return None  # (read only to resolve an interpolation among ``defaults``)

    only_where_used.only_where_used = True  # type: ignore[attr-defined]
    _defaults_list._create_interpolation_map = only_where_used


def mode_from_command_line() -> None:
    """Let ``-m``/``--multirun`` alone decide the run mode, without Hydra's extra compose.

    ``@hydra.main`` composes the whole config once just to read ``hydra.mode`` (set in a config
    file, a run would become a sweep), then again to run: with typed groups that first compose
    is about a fifth of a config-only command. ``fsdp-train`` decides sweeps by ``-m`` (its
    run-directory names and exit status do too), so the probe answers "not set": Hydra then runs
    one job, or a sweep with ``-m``. Callers keep Hydra's probe when ``hydra.mode`` is on the
    command line."""
    _Hydra.get_mode = _mode_not_set  # type: ignore[method-assign]


def _mode_not_set(self: Any, config_name: str | None, overrides: list[str]) -> None:
    return None


def hide_from_printed_config(keys: Collection[str]) -> None:
    """``--cfg job`` (and ``--cfg all``, ``--info``) print the composed config without ``keys``:
    the values the entry point sets for the ranks (``run_dir`` ...), which a user neither sets
    nor can read anything from before the run. Hydra prints the config it gets from
    ``Hydra.get_sanitized_cfg``, which has no hook; the run itself never calls it."""
    original = _Hydra.get_sanitized_cfg
    if getattr(original, "hides", None) == tuple(keys):
        return  # (main() runs once per command; a test runs many commands in one process)

    def sanitized(self: Any, cfg: DictConfig, cfg_type: str) -> DictConfig:
        cfg = original(self, cfg, cfg_type)
        if cfg_type in ("job", "all"):
            with open_dict(cfg):
                for key in keys:
                    cfg.pop(key, None)
        return cfg

    sanitized.hides = tuple(keys)  # type: ignore[attr-defined]
    _Hydra.get_sanitized_cfg = sanitized  # type: ignore[method-assign]
