"""The config reference (``docs/config-reference.md``), generated from the schemas.

``python -m fsdp_cli.config.reference > docs/config-reference.md`` regenerates it; a test fails
when the file differs from what this prints, so a new key is documented the moment it exists.

Every key of every schema: its type, its default and the docstring under its field (read from
the source, where Python keeps no attribute docstrings), plus each group's options with the
first comment line of their YAML file. Torch-free and Hydra-free, like the rest of ``config/``.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import importlib.resources
import inspect
import re
import sys
import types
import typing
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

from fsdp_cli import checkpoint_format
from fsdp_cli.config import schema
from fsdp_cli.config.convert import GROUP_SCHEMAS
from fsdp_cli.config.schema import CustomModelConfig, DataModuleConfig, TrainConfig
from fsdp_cli.models import args
from fsdp_cli.parallel import options
from fsdp_cli.ranges import field_range

COMMAND = "python -m fsdp_cli.config.reference > docs/config-reference.md"

INTRO = f"""# Config reference

Every key of `fsdp-train`'s config: its type, its default and what it does. Generated from the
schemas in `fsdp_cli/config/schema.py` by `{COMMAND}`
(a test fails when this file is stale). Set any key on the command line (`fsdp-train KEY=VALUE`),
in a recipe, or see the composed result with `fsdp-train ... --cfg job`. Group options
(`strategy=fsdp2`) pick a YAML file from `configs/<group>/`, which fills the group's keys.
Hydra's own keys (`hydra.run.dir`, `hydra.sweep.dir`, `hydra/launcher`, `hydra/sweeper`) are in
[sweeps.md](sweeps.md) and [clusters.md](clusters.md).
"""


# --------------------------------------------------------------------------- docstrings


SCHEMA_MODULES = (schema, args, options, checkpoint_format)
"""Where the schema's types are defined: the CLI's own, and the library types it composes."""


@cache
def field_docs(module: types.ModuleType = schema) -> dict[str, dict[str, str]]:
    """``{class name: {field or member name: the string literal under it}}`` for one module."""
    tree = ast.parse(inspect.getsource(module))
    docs: dict[str, dict[str, str]] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            docs[node.name] = dict(_documented(node.body))
    return docs


def _documented(body: list[ast.stmt]) -> Iterator[tuple[str, str]]:
    for stmt, after in zip(body, body[1:]):
        target = None
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            target = stmt.target.id
        elif isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Name):
            target = stmt.targets[0].id
        if target and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            if isinstance(after.value.value, str):
                yield target, inspect.cleandoc(after.value.value)


def doc_of(cls: type, name: str) -> str:
    """The docstring under a field, with its allowed range when it declares one."""
    text = ""
    for klass in cls.__mro__:  # a subclass (fsdp_native) inherits its parent's field docs
        module = sys.modules.get(klass.__module__)
        found = field_docs(module).get(klass.__name__, {}).get(name) if module in SCHEMA_MODULES else None
        if found:
            text = found
            break
    fields = {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
    allowed = field_range(fields[name]) if name in fields else None
    return f"{text} Allowed: {allowed.describe()}." if allowed is not None else text


def class_doc(cls: type) -> str:
    doc = inspect.cleandoc(vars(cls).get("__doc__") or "")
    return "" if doc.startswith(f"{cls.__name__}(") else doc  # the signature @dataclass writes


# --------------------------------------------------------------------------- types and defaults


def type_name(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return "any"
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(type_name(a) for a in args)
    if hint is type(None):
        return "null"
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return " \\| ".join(m.value for m in hint)
    if origin in (list, dict):
        return f"{origin.__name__}[{', '.join(type_name(a) for a in args)}]"
    return getattr(hint, "__name__", str(hint))


def default_of(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return "???"


def show(value: Any) -> str:
    if isinstance(value, enum.Enum):
        value = value.value
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if value == "???":
        return "required"
    if isinstance(value, (list, dict)):
        return f"`{value}`" if value else ("`[]`" if isinstance(value, list) else "`{}`")
    return f"`{value}`"


def cell(text: str) -> str:
    """One Markdown table cell: one line, pipes escaped, Sphinx roles (``:class:``) dropped."""
    return re.sub(r":\w+:`", "`", " ".join(text.split())).replace("|", "\\|")


# --------------------------------------------------------------------------- tables


def rows(cls: type, prefix: str) -> Iterator[str]:
    """One table row per key of ``cls`` (nested dataclasses flattened to dotted keys)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint, key = hints[f.name], f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hint) and isinstance(hint, type):
            yield from rows(hint, f"{key}.")
            continue
        yield f"| `{key}` | {type_name(hint)} | {show(default_of(f))} | {cell(doc_of(cls, f.name))} |"


def table(cls: type, prefix: str) -> list[str]:
    return ["| key | type | default | description |", "|---|---|---|---|", *rows(cls, prefix)]


def top_level() -> list[str]:
    hints = typing.get_type_hints(TrainConfig)
    scalar = [f for f in dataclasses.fields(TrainConfig) if not _is_section(hints[f.name], f.name)]
    lines = ["## Top-level keys", "", "| key | type | default | description |", "|---|---|---|---|"]
    for f in scalar:
        lines.append(
            f"| `{f.name}` | {type_name(hints[f.name])} | {show(default_of(f))} | {cell(doc_of(TrainConfig, f.name))} |"
        )
    return [*lines, ""]


def _is_section(hint: Any, name: str) -> bool:
    return name in GROUP_SCHEMAS or (dataclasses.is_dataclass(hint) and isinstance(hint, type))


def sections() -> list[str]:
    hints = typing.get_type_hints(TrainConfig)
    lines: list[str] = []
    for f in dataclasses.fields(TrainConfig):
        if f.name in GROUP_SCHEMAS:
            lines += group_section(f.name)
        elif _is_section(hints[f.name], f.name):
            cls = hints[f.name]
            options = options_of(f.name)
            lines += [f"## `{f.name}`", ""]
            if class_doc(cls):
                lines += [cell(class_doc(cls)), ""]
            if options:
                lines += [f"Options (`{f.name}=NAME`): " + ", ".join(f"`{o}`" for o, _ in options), ""]
            lines += [*table(cls, f"{f.name}."), ""]
    return lines


def group_section(group: str) -> list[str]:
    """A group whose options have different schemas: the options, then one table per schema."""
    lines = [f"## `{group}`", "", f"| option (`{group}=...`) | description |", "|---|---|"]
    lines += [f"| `{name}` | {cell(about)} |" for name, about in options_of(group)]
    lines.append("")
    for name, cls in GROUP_SCHEMAS[group].items():
        lines += [f"### `{group}.name={name}` ({cls.__name__})", ""]
        if class_doc(cls):
            lines += [cell(class_doc(cls)), ""]
        lines += [*table(cls, f"{group}."), ""]
    if group == "model":
        lines += _target_section(
            "model", "custom", CustomModelConfig, "class or factory that builds the model"
        )
    if group == "data":
        lines += _target_section(
            "data", "datamodule", DataModuleConfig, "LightningDataModule class or factory"
        )
    return lines


def options_of(group: str) -> list[tuple[str, str]]:
    """``(option, the first comment line of its YAML file)`` for each file of a config group."""
    folder = configs_dir() / group
    if not folder.is_dir():
        return []
    return [(p.stem, _first_comment(p)) for p in sorted(folder.glob("*.yaml"))]


def _first_comment(path: Path) -> str:
    """A recipe's ``About:`` line, else the first line of the file's opening comment."""
    comments = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        text = line.lstrip("#").strip()
        if text and not text.startswith("@"):
            comments.append(text)
    about = [c.removeprefix("About:").strip() for c in comments if c.startswith("About:")]
    return (about or comments or [""])[0]


def configs_dir() -> Path:
    try:
        return Path(str(importlib.resources.files("fsdp_cli.configs")))
    except ModuleNotFoundError:  # a source checkout whose package is installed elsewhere
        return Path(__file__).resolve().parents[2] / "configs"


def enums() -> list[str]:
    lines = ["## Values", "", "What the choices of the enumerated keys mean.", ""]
    for name, cls in sorted(
        {(n, c) for m in SCHEMA_MODULES for n, c in inspect.getmembers(m, inspect.isclass)},
        key=lambda nc: nc[0],
    ):
        module = sys.modules.get(cls.__module__)
        if not issubclass(cls, enum.Enum) or module not in SCHEMA_MODULES:
            continue
        member_docs = field_docs(module).get(name, {})
        if not member_docs:
            continue
        lines += [f"**{name}**", ""]
        lines += [f"* `{m.value}`: {cell(member_docs[m.name])}" for m in cls if m.name in member_docs]
        lines.append("")
    return lines


def recipes() -> list[str]:
    lines = [
        "## `recipe`",
        "",
        "Whole runs (`recipes/`, `fsdp-recipe ls`); a recipe sets any of the keys below.",
        "",
    ]
    lines += ["| option (`recipe=...`) | what it trains |", "|---|---|"]
    lines += [f"| `{name}` | {cell(about)} |" for name, about in options_of("recipe")]
    return [*lines, ""]


def render() -> str:
    lines = [INTRO, *top_level(), *recipes(), *sections(), *enums()]
    return "\n".join(lines).rstrip() + "\n"


def _target_section(group: str, option: str, cls: type, what: str) -> list[str]:
    """A group option whose keys are a ``_target_`` and that target's own keyword arguments."""
    return [
        f"### `{group}={option}` ({cls.__name__})",
        "",
        cell(class_doc(cls)),
        "",
        "| key | type | default | description |",
        "|---|---|---|---|",
        f"| `{group}._target_` | str | required | Dotted path of the {what}. |",
        f"| `{group}.NAME` (`+{group}.NAME=VALUE`) | any | | A keyword argument of the target. |",
        "",
    ]


# --------------------------------------------------------------------------- the README's table


README_COMMAND = "python -m fsdp_cli.config.reference --readme"
README_START = f"<!-- generated by `{README_COMMAND}`: edit the schemas and YAML comments, not this -->"
README_END = "<!-- end of the generated table -->"
README_GROUPS = ("strategy", "precision", "wrap", "checkpoint", "model", "data", "peft", "logger", "recipe")
"""The groups the README's table shows, in its order."""


def _clause(text: str) -> str:
    """The first clause of ``text``: up to the first ``: `` ``; `` or sentence end outside parentheses."""
    depth = 0
    for i, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0 and char in ".:;" and (i + 1 == len(text) or text[i + 1] == " "):
            return text[:i].strip()
    return text.strip()


def _opening_paragraph(path: Path) -> str:
    """The YAML file's opening comment up to its first blank comment line, as one line."""
    lines = []
    for line in path.read_text().splitlines():
        text = line.lstrip("#").strip() if line.startswith("#") else None
        if not text:
            if lines or text is None:
                break
            continue
        if not text.startswith("@"):
            lines.append(text)
    return " ".join(lines)


def readme_table() -> str:
    """The README's configuration table: each group's options with their YAML comments' first
    clause (old names that map to a current option left to the reference), then the top-level
    keys and sections with the first sentence of their docstrings."""
    lines = ["| group | options |", "|---|---|"]
    for group in README_GROUPS:
        if group == "recipe":
            names = ", ".join(f"`{name}`" for name, _ in options_of(group))
            lines.append(f"| `recipe` | whole runs: {names} (`fsdp-recipe ls`, `show`, `cp`) |")
            continue
        shown = []
        for path in sorted((configs_dir() / group).glob("*.yaml")):
            name, about = path.stem, _opening_paragraph(path)
            if about.startswith(("Old ", "Lightning 1.x", "lightning_fairscale")):
                continue
            brief = _clause(about) if about and not about.startswith(f"{group}=") else ""
            shown.append(f"`{name}`" + (f" ({cell(brief)})" if brief else ""))
        lines.append(f"| `{group}` | {'; '.join(shown)} |")
    hints = typing.get_type_hints(TrainConfig)
    keys, parts = [], []
    for f in dataclasses.fields(TrainConfig):
        if f.name in schema.SET_BY_THE_ENTRY_POINT or f.name in README_GROUPS or f.name in GROUP_SCHEMAS:
            continue
        doc = _sentence(
            doc_of(TrainConfig, f.name) or class_doc(hints[f.name])
            if _is_section(hints[f.name], f.name)
            else doc_of(TrainConfig, f.name)
        )
        target = parts if _is_section(hints[f.name], f.name) else keys
        target.append(f"`{f.name}{'.*' if target is parts else ''}` ({cell(doc)})" if doc else f"`{f.name}`")
    lines += ["", "Top-level keys: " + "; ".join(keys) + ".", "", "Sections: " + "; ".join(parts) + "."]
    return "\n".join(lines)


def _sentence(text: str) -> str:
    first = re.split(r"(?<=[a-z0-9)`])\.\s", " ".join(text.split()), maxsplit=1)[0].rstrip(".")
    return first


def readme_with_table(text: str) -> str:
    """``text`` (the README) with its generated block replaced by :func:`readme_table`."""
    start, end = text.index(README_START), text.index(README_END)
    return text[: start + len(README_START)] + "\n" + readme_table() + "\n" + text[end:]


if __name__ == "__main__":
    if sys.argv[1:] == ["--readme"]:
        readme = Path(__file__).resolve().parents[2] / "README.md"
        readme.write_text(readme_with_table(readme.read_text()))
    else:
        sys.stdout.write(render())
