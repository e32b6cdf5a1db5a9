"""The package's imports run one way: no module imports itself back through others, and no
folder (``config``, ``parallel``, ``launch``, ...) depends on one that depends on it."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "fsdp_cli"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node except those under ``if TYPE_CHECKING:`` (imports for annotations only, which
    never run and so create no dependency)."""
    skipped = {
        id(n)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for stmt in block.body
        for n in ast.walk(stmt)
    }
    return [n for n in ast.walk(tree) if id(n) not in skipped]


def _imports() -> dict[str, set[str]]:
    """Every ``fsdp_cli`` module each module imports, at top level or inside a function."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for node in _runtime_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fsdp_cli"):
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


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


def _folder(module: str) -> str:
    return ".".join(module.split(".")[:2])


def test_no_module_imports_itself_back() -> None:
    assert _cycles(_imports()) == []


def test_no_two_folders_import_each_other() -> None:
    folders: dict[str, set[str]] = {}
    for module, targets in _imports().items():
        folders.setdefault(_folder(module), set()).update(
            _folder(t) for t in targets if _folder(t) != _folder(module)
        )
    assert _cycles(folders) == []


def test_the_parallel_layer_never_imports_a_concrete_model() -> None:
    graph = _imports()
    offenders = {
        m: sorted(t for t in ts if t.startswith("fsdp_cli.models"))
        for m, ts in graph.items()
        if m.startswith("fsdp_cli.parallel")
    }
    assert {m: ts for m, ts in offenders.items() if ts} == {}
