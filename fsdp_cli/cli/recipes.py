"""``fsdp-recipe``: the recipes shipped with fsdp-train, listed, shown and copied to edit.

::

    fsdp-recipe ls                       # name, hardware and what each recipe trains
    fsdp-recipe show llama_8b_fsdp2_tp   # print it
    fsdp-recipe cp llama_8b_fsdp2_tp     # -> ./recipe/my_llama_8b_fsdp2_tp.yaml, and the command that runs it

A recipe is a YAML file of the ``recipe`` config group whose header says how to run it::

    # @package _global_
    # Command:  fsdp-train recipe=NAME
    # Hardware: 1 node x 8 GPUs (H100 80GB)
    # About:    one line: what it trains, how it is sharded

A copy lives in ``<dir>/recipe/`` so that ``fsdp-train --config-dir <dir> recipe=<new name>``
finds it. Hydra searches the shipped configs first, so a copy never takes a shipped recipe's name.

No torch, no Hydra: answers at once.
"""

from __future__ import annotations

import argparse
import importlib.resources
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from fsdp_cli.cli.console import OneLineParser, quiet_on_closed_pipe
from fsdp_cli.rundir.files import write_atomically
from fsdp_cli.rundir.status import EXIT_CONFIG_ERROR

PROG = "fsdp-recipe"
GROUP = "recipe"
FIELDS = ("Command", "Hardware", "About")
NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class Recipe:
    name: str
    path: Path
    command: str
    hardware: str
    about: str

    @property
    def text(self) -> str:
        return self.path.read_text()


def recipes_dir() -> Path:
    """The shipped recipes: ``fsdp_cli/configs/recipe`` in an installed package, else (a source
    checkout run with ``python -m``) the repository's ``recipes/``."""
    try:
        shipped = Path(str(importlib.resources.files("fsdp_cli.configs") / GROUP))
    except ModuleNotFoundError:
        shipped = None
    if shipped is not None and shipped.is_dir():
        return shipped
    return Path(__file__).resolve().parents[2] / "recipes"


def header(text: str) -> dict[str, str]:
    """``Command``, ``Hardware`` and ``About`` of a recipe's opening comment block."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        key, sep, value = line.lstrip("# ").partition(":")
        if sep and key in FIELDS and key not in fields:
            fields[key] = value.strip()
    return fields


def load(path: Path) -> Recipe:
    fields = header(path.read_text())
    return Recipe(
        name=path.stem,
        path=path,
        command=fields.get("Command", ""),
        hardware=fields.get("Hardware", ""),
        about=fields.get("About", ""),
    )


def all_recipes() -> list[Recipe]:
    return [load(p) for p in sorted(recipes_dir().glob("*.yaml"))]


def find(name: str) -> Recipe:
    path = recipes_dir() / f"{Path(name).stem}.yaml"
    if not path.is_file():
        names = ", ".join(r.name for r in all_recipes())
        _fail(f"{name}: no such recipe; allowed: {names}; hint: {PROG} ls lists them")
    return load(path)


def copy(recipe: Recipe, new_name: str, config_dir: Path) -> tuple[Path, str]:
    """Write ``config_dir/recipe/new_name.yaml`` (its Command line updated); return it and the
    command that runs it."""
    if not NAME.match(new_name):
        _fail(f"{new_name}: not a recipe name; allowed: letters, digits, _ . -")
    if (recipes_dir() / f"{new_name}.yaml").is_file():
        # Hydra looks in the shipped configs before --config-dir: the copy would never be read.
        _fail(f"{new_name}: a shipped recipe has this name and would hide the copy; hint: pick another name")
    if config_dir.exists() and not config_dir.is_dir():
        _fail(f"--dir={config_dir}: not a directory; allowed: a directory (made if missing)")
    target = config_dir / GROUP / f"{new_name}.yaml"
    if target.exists():
        _fail(
            f"{target}: exists; hint: remove it first, or give another name: {PROG} cp {recipe.name} NEW_NAME"
        )
    command = _rewrite(recipe.command, recipe.name, new_name, config_dir)
    text = recipe.text.replace(f"# Command:  {recipe.command}", f"# Command:  {command}", 1)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(target, text)  # an interrupted copy leaves no half recipe
    except OSError as err:
        _fail(f"--dir={config_dir}: cannot write {target} ({err.strerror or err}); hint: a writable --dir")
    return target, command


def _rewrite(command: str, old: str, new: str, config_dir: Path) -> str:
    """``[srun] fsdp-train recipe=OLD ...`` -> ``[srun] fsdp-train --config-dir DIR recipe=NEW ...``."""
    where = "." if config_dir == Path(".") else str(config_dir)
    rewritten = command.replace(
        f"fsdp-train recipe={old}", f"fsdp-train --config-dir {where} recipe={new}", 1
    )
    if rewritten == command:  # a command of another shape: the plain form still runs it
        return f"fsdp-train --config-dir {where} recipe={new}"
    return rewritten


def print_list(recipes: Sequence[Recipe]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(
        title="fsdp-train recipes (fsdp-recipe show NAME, fsdp-recipe cp NAME)", title_justify="left"
    )
    for column in ("recipe", "hardware", "what it trains"):
        table.add_column(column, overflow="fold")
    for recipe in recipes:
        table.add_row(recipe.name, escape(recipe.hardware), escape(recipe.about))
    console = Console()
    (console if console.is_terminal else Console(width=200)).print(table)


def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog=PROG,
        description="The recipes shipped with fsdp-train: whole runs to copy and edit.",
        epilog="A copy runs with: fsdp-train --config-dir DIR recipe=NEW_NAME",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "ls", aliases=["list"], help="list the recipes with their hardware and a one-line description"
    )
    show = sub.add_parser("show", help="print a recipe")
    show.add_argument("name")
    cp = sub.add_parser("cp", help="copy a recipe to DIR/recipe/ to edit it")
    cp.add_argument("name")
    cp.add_argument("new_name", nargs="?", help="name of the copy (default: my_NAME)")
    cp.add_argument("--dir", type=Path, default=Path("."), help="the config directory (default: .)")
    return parser


@quiet_on_closed_pipe
def main(argv: Sequence[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if args.command in ("ls", "list"):
        print_list(all_recipes())
    elif args.command == "show":
        sys.stdout.write(find(args.name).text)
    else:
        recipe = find(args.name)
        target, command = copy(recipe, args.new_name or f"my_{recipe.name}", args.dir)
        print(f"{PROG}: wrote {target}\nedit it, then run:\n  {command}")


def _fail(message: str) -> NoReturn:
    print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    sys.exit(EXIT_CONFIG_ERROR)


if __name__ == "__main__":
    main()
