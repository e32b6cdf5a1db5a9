"""``fsdp-train --help`` without composing anything.

Hydra renders ``$APP_CONFIG_GROUPS`` by loading every config group through a fresh copy of the
config repository, once per group (its own and its plugins', about a hundred), which takes
seconds with this project's schemas. The same listing comes from the config files themselves
and the schema names, so ``--help`` reads those and Hydra's help template (``hydra.help`` in
``train.yaml``) and prints the same text. ``--hydra-help`` is still Hydra's.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path
from typing import Any

SCHEMA_GROUPS = ("strategy", "model", "data")


def config_groups(root: Any) -> dict[str, list[str]]:
    """Group -> option names, from the files under the config root (schemas: their registry)."""
    from fsdp_cli.config.convert import DATA_SCHEMAS, MODEL_SCHEMAS, STRATEGY_SCHEMAS

    groups = {
        entry.name: sorted(Path(f.name).stem for f in entry.iterdir() if f.name.endswith(".yaml"))
        for entry in root.iterdir()
        if entry.is_dir() and not entry.name.startswith("_")
    }
    for group, schemas in zip(SCHEMA_GROUPS, (STRATEGY_SCHEMAS, MODEL_SCHEMAS, DATA_SCHEMAS)):
        groups[f"schema/{group}"] = sorted(schemas)
    return {g: opts for g, opts in sorted(groups.items()) if opts}


def help_text(config_path: str) -> str:
    import yaml

    root = (
        files(config_path.removeprefix("pkg://")) if config_path.startswith("pkg://") else Path(config_path)
    )
    template = yaml.safe_load(root.joinpath("train.yaml").read_text())["hydra"]["help"]["template"]
    listing = "\n".join(f"{group}: {', '.join(options)}" for group, options in config_groups(root).items())
    return template.replace("$APP_CONFIG_GROUPS", listing)
