"""The package's rooms and the imports allowed between them, as a table this test enforces.

A room is a folder of ``fsdp_cli`` (``config``, ``parallel``, ...), a top-level module
(``resolve``, ``precision``, ...), or ``hydra_plugins``. :data:`ALLOWED` lists, for each room,
the rooms it may import (at module level or inside a function; an import under
``if TYPE_CHECKING:`` is for annotations only and creates no dependency). An import by string is
an import too: ``importlib.import_module("fsdp_cli...")`` (an f-string's fixed prefix included)
and a string that names one of our modules, or an object in one (``module:attribute`` as
registries write it, or ``module.Attribute``), count as edges; only :data:`PROCESS_ENTRIES`, the
modules another process runs, are not imports of the room that names them. The table runs one
way: argv -> cli -> generate / sweep -> resolve -> plan -> worker -> builders -> callbacks / strategies ->
checkpoint -> launch -> config -> adapters -> models / data -> parallel -> the leaves. A new edge is added
to the table on purpose, and the table itself must stay free of cycles.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = (ROOT / "fsdp_cli", ROOT / "hydra_plugins")
MAX_FUNCTION_LINES = 45

LEAVES = {
    "errors",
    "dtypes",
    "precision",
    "ranges",
    "dotted",
    "compat",
    "rundir",
    "version",
    "extras",
    "library_noise",
    "checkpoint_format",
}
"""Depend on nothing of ours but the error type (``version``: the package's own ``__init__``)."""
ALLOWED: dict[str, set[str]] = {
    "hydra_plugins": {"sweep"},
    # (data: fsdp-data show renders one chat example with the run's own code)
    "cli": {
        "hydra_plugins",
        "generate",
        "sweep",
        "resolve",
        "plan",
        "worker",
        "checkpoint",
        "launch",
        "config",
        "data",
        *LEAVES,
    },
    # (fsdp-generate builds a run's model from its checkpoint's config as the run's factory did)
    "generate": {"checkpoint", "config", "adapters", "models", "data", "parallel", *LEAVES},
    "sweep": {"resolve", "launch", "config", *LEAVES},
    "resolve": {"plan", "checkpoint", "launch", "data", "config", "adapters", *LEAVES},
    # builders/strategies: a rehearsal (plan/rehearsal.py) builds one rank with the builders and
    # strategy classes a real rank uses, instead of a second copy of that logic.
    "plan": {
        "builders",
        "strategies",
        "launch",
        "config",
        "adapters",
        "models",
        "pipeline",
        "parallel",
        *LEAVES,
    },
    "worker": {"builders", "checkpoint", "launch", "config", *LEAVES},
    "builders": {
        "callbacks",
        "strategies",
        "checkpoint",
        "launch",
        "config",
        "adapters",
        "models",
        "data",
        "pipeline",
        "parallel",
        *LEAVES,
    },
    "callbacks": {"launch", "models", "parallel", *LEAVES},
    "strategies": {"checkpoint", "pipeline", "parallel", *LEAVES},
    # (the checkpoint callback asks how many steps a fit plans; full files number the optimizer
    # state by the model's parameter names as parallel.names reports them; a merged LoRA export
    # reads its base from the model folder through models.folder's checks)
    "checkpoint": {"callbacks", "config", "models", "pipeline", "parallel", *LEAVES},
    "launch": {"config", "pipeline", "parallel", *LEAVES},
    "config": {"adapters", "models", "data", "pipeline", "parallel", *LEAVES},
    # (adapters: LoRA injected into the models before parallel shards them)
    "adapters": {"models", "parallel", *LEAVES},
    "models": {"pipeline", "parallel", *LEAVES},
    "data": {*LEAVES},
    # (pipeline stages wrap parallel's sharding of each stage)
    "pipeline": {"parallel", *LEAVES},
    "parallel": {*LEAVES},
    **{leaf: {"errors"} for leaf in LEAVES - {"errors"}},
    "errors": set(),
}
PROCESS_ENTRIES: dict[tuple[str, str], str] = {
    (
        "fsdp_cli.launch.launcher",
        "fsdp_cli.launch.agent",
    ): "the agent runs as python -m fsdp_cli.launch.agent",
    ("fsdp_cli.launch.launcher", "fsdp_cli.worker"): "each rank runs python -m fsdp_cli.worker",
    (
        "fsdp_cli.launch.environment",
        "fsdp_cli.worker.preload",
    ): "what the agent process imports before it forks the ranks",
}
"""(module, the module a string in it names): started in another process, not imported here."""
LIBRARY = {"parallel", "pipeline", "adapters", "models", "strategies"}
"""Usable from Python without the CLI: nothing they import, however indirectly, is the CLI's."""
CLI_ROOMS = {"cli", "sweep", "resolve", "config"}


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in package.rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node except those under ``if TYPE_CHECKING:``."""
    skipped = {
        id(n)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for stmt in block.body
        for n in ast.walk(stmt)
    }
    return [n for n in ast.walk(tree) if id(n) not in skipped]


def _named_module(text: str, modules: dict[str, Path]) -> str | None:
    """The module of ours a string names: the module itself, or one attribute of it
    (``module:attr``, ``module.Attr``; not of the top package, whose data folders share the form)."""
    path, _, attr = text.partition(":")
    if attr and not attr.isidentifier():
        return None
    if path in modules:
        return path
    parent, _, last = path.rpartition(".")
    if not attr and parent in modules and "." in parent and last.isidentifier():
        return parent
    return None


def _string_imports(node: ast.AST, modules: dict[str, Path]) -> list[str]:
    """The modules of ours a string constant names, or an ``import_module`` call's fixed prefix
    (an f-string's leading text: the package it imports from)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        found = _named_module(node.value, modules)
        return [found] if found else []
    if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("import_module") and node.args:
        arg = node.args[0]
        if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
            prefix = str(arg.values[0].value).rstrip(".")
            return [prefix] if prefix in modules else []
    return []


def _imports() -> dict[str, set[str]]:
    """Every module of ours each module imports (our modules only; by string too), and
    third-party roots too (as ``ext:<name>``)."""
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for node in _runtime_nodes(ast.parse(path.read_text())):
            named = [t for t in _string_imports(node, modules) if (name, t) not in PROCESS_ENTRIES]
            graph[name].update(t for t in named if t != name)
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            for target in targets:
                if target in modules and target != name:
                    graph[name].add(target)
                elif not target.startswith(("fsdp_cli", "hydra_plugins")):
                    graph[name].add("ext:" + target.split(".")[0])
    return graph


def room(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "hydra_plugins":
        return "hydra_plugins"
    return "version" if len(parts) == 1 else parts[1]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                found.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def test_every_room_is_in_the_table() -> None:
    rooms = {room(m) for m in _modules()}
    assert rooms == set(ALLOWED), (sorted(rooms - set(ALLOWED)), sorted(set(ALLOWED) - rooms))


def test_the_table_runs_one_way() -> None:
    assert _cycles(ALLOWED) == []


def test_every_import_between_rooms_is_in_the_table() -> None:
    offending = sorted(
        f"{module} -> {target}"
        for module, targets in _imports().items()
        for target in targets
        if not target.startswith("ext:")
        and room(target) != room(module)
        and room(target) not in ALLOWED[room(module)]
    )
    assert offending == []


def test_no_module_imports_itself_back() -> None:
    graph = {m: {t for t in ts if not t.startswith("ext:")} for m, ts in _imports().items()}
    assert _cycles(graph) == []


def test_the_library_rooms_never_reach_the_cli_or_hydra() -> None:
    """``fsdp_cli.strategies``, ``.models``, ``.parallel``: everything they import, followed
    transitively, is neither the CLI's (its schema, resolution, entry points) nor Hydra."""
    graph = _imports()
    reached: set[str] = set()
    todo = [m for m in graph if room(m) in LIBRARY]
    while todo:
        module = todo.pop()
        if module in reached:
            continue
        reached.add(module)
        todo.extend(t for t in graph.get(module, ()) if not t.startswith("ext:"))
    bad = sorted(m for m in reached if room(m) in CLI_ROOMS)
    hydra = sorted(m for m in reached if graph[m] & {"ext:hydra", "ext:omegaconf"})
    assert (bad, hydra) == ([], [])


def test_the_parallel_layer_never_imports_a_concrete_model() -> None:
    offenders = {
        m: sorted(t for t in ts if t.startswith("fsdp_cli.models"))
        for m, ts in _imports().items()
        if m.startswith("fsdp_cli.parallel")
    }
    assert {m: ts for m, ts in offenders.items() if ts} == {}


def test_imports_by_string_are_edges() -> None:
    """A registry that names its builder by dotted path, or imports a module by string, depends
    on it as surely as an import statement does."""
    modules = _modules()
    registry = ast.parse(
        """ENTRY = Entry(builder="fsdp_cli.builders.strategy:build_ddp", block="fsdp_cli.models.llama.Llama")
importlib.import_module("fsdp_cli.plan.memory")
importlib.import_module(f"fsdp_cli.strategies.{name}")
NOT_MODULES = ("fsdp_cli.configs", "fsdp_cli.range", "fsdp_cli.models.llama:two words")"""
    )
    found = sorted({t for node in ast.walk(registry) for t in _string_imports(node, modules)})
    assert found == [
        "fsdp_cli.builders.strategy",
        "fsdp_cli.models.llama",
        "fsdp_cli.plan.memory",
        "fsdp_cli.strategies",
    ]
    assert "fsdp_cli.models.llama" in _imports()["fsdp_cli.plan.model"]  # its wrap class, by name
    assert "fsdp_cli.worker" not in _imports()["fsdp_cli.launch.launcher"]  # a process it starts


def test_every_package_is_in_the_wheel() -> None:
    """pyproject.toml lists the packages a wheel holds: a new room missing there imports from a
    checkout and fails from an installed wheel."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for package in PACKAGES
        for init in package.rglob("__init__.py")
        if "configs" not in init.parts or init.parent.name == "configs"
    }
    assert found - listed == set(), sorted(found - listed)


def test_every_function_fits_a_screen() -> None:
    """A function longer than a screen (45 lines, docstring included) holds more than one concern:
    split it where a seam shows."""
    import ast

    long = []
    for path in sorted(p for package in PACKAGES for p in package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, "\n".join(long)
