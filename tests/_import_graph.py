"""The package's import graph, read from source with ``ast``: every import, including those inside functions
and those under ``if TYPE_CHECKING:``.

An import under ``if TYPE_CHECKING:`` never runs, so it cannot form a loop at run time, but a reader still has
to hold the circle in mind: its edge is kept and marked ``typing_only``.  A ``from package import name`` counts as an import of ``package.name`` when that is a module, else of
``package`` itself; the implicit import of a module's parent packages is not counted (every module would
otherwise depend on ``shardwise/__init__``, which imports most of them).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional


@dataclass(frozen=True)
class Edge:
    """One import statement: ``source`` imports ``target`` at ``line``; ``deferred`` when inside a function,
    ``typing_only`` when under ``if TYPE_CHECKING:`` (it never runs)."""

    source: str
    target: str
    line: int
    deferred: bool
    typing_only: bool = False


def module_names(root: Path, package: str) -> dict[str, Path]:
    """Every module under ``root`` (the package's directory) by dotted name."""
    names: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join([package, *parts])] = path
    return names


def edges(root: Path, package: str) -> list[Edge]:
    """All imports between modules of the package: module-level, deferred and typing-only alike."""
    modules = module_names(root, package)
    found: list[Edge] = []
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), filename=str(path))
        for node, deferred, typing_only in _imports(tree):
            for target in _targets(node, name, is_package, modules):
                found.append(Edge(name, target, node.lineno, deferred, typing_only))
    return found


def run_time(found: list[Edge]) -> list[Edge]:
    """The edges of imports that can run (not under ``if TYPE_CHECKING:``)."""
    return [edge for edge in found if not edge.typing_only]


def cycles(found: list[Edge]) -> list[list[str]]:
    """The strongly connected groups of more than one module (or a module importing itself), sorted."""
    graph: dict[str, set[str]] = {}
    for edge in found:
        graph.setdefault(edge.source, set()).add(edge.target)
        graph.setdefault(edge.target, set())
    groups = _strongly_connected(graph)
    loops = [sorted(group) for group in groups if len(group) > 1 or next(iter(group)) in graph[next(iter(group))]]
    return sorted(loops)


Found = tuple[ast.Import | ast.ImportFrom, bool, bool]


def _imports(tree: ast.Module) -> Iterator[Found]:
    """(import node, inside a function?, under ``if TYPE_CHECKING:``?) for every import."""

    def walk(node: ast.AST, deferred: bool, typing_only: bool) -> Iterator[Found]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                yield from (found for branch in child.body for found in walk_one(branch, deferred, True))
                yield from (found for branch in child.orelse for found in walk_one(branch, deferred, typing_only))
                continue
            yield from walk_one(child, deferred, typing_only)

    def walk_one(node: ast.AST, deferred: bool, typing_only: bool) -> Iterator[Found]:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, deferred, typing_only
        inner = deferred or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        yield from walk(node, inner, typing_only)

    return walk(tree, False, False)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _targets(node: ast.Import | ast.ImportFrom, name: str, is_package: bool, modules: dict[str, Path]) -> list[str]:
    """The package's modules that one import statement loads (outside modules are dropped)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name in modules]
    base = _absolute(node, name, is_package)
    if base is None or base not in modules:
        return []
    return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]


def _absolute(node: ast.ImportFrom, name: str, is_package: bool) -> Optional[str]:
    """The dotted module a ``from ... import`` reads from."""
    if node.level == 0:
        return node.module
    anchor = name.split(".") if is_package else name.split(".")[:-1]
    anchor = anchor[: len(anchor) - (node.level - 1)]
    return ".".join([*anchor, node.module] if node.module else anchor)


def _strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's algorithm, iterative so a deep package cannot hit the recursion limit."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    groups.append(_pop_group(stack, on_stack, node))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return groups


def _pop_group(stack: list[str], on_stack: set[str], root: str) -> set[str]:
    group: set[str] = set()
    while True:
        member = stack.pop()
        on_stack.discard(member)
        group.add(member)
        if member == root:
            return group


def uncommented_deferred(root: Path, package: str) -> list[str]:
    """``module:line`` of every import inside a function (of any module, the package's or not) with no comment
    saying why: on its line, on the line above, or on another line of the same block of imports."""
    found: list[str] = []
    for name, path in module_names(root, package).items():
        lines = path.read_text().splitlines()
        for node, deferred, _ in _imports(ast.parse("\n".join(lines), filename=str(path))):
            if deferred and not _explained(lines, node.lineno - 1):
                found.append(f"{name}:{node.lineno}")
    return found


def _explained(lines: list[str], index: int) -> bool:
    start = index
    while start > 0 and lines[start - 1].strip().startswith(("import ", "from ")):
        start -= 1
    block = lines[max(start - 1, 0) : index + 1]
    return any("#" in line for line in block)
