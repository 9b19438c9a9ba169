"""The layout docs/architecture.md describes: no runtime import cycle inside hf_paged, no god file, and the pool
below the caches."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "hf_paged"
#: A guard against god files, not a target: a module is one responsibility, however many lines that takes (the
#: Engine with its incremental API is one), and is never squeezed or split only to stay under this.
MAX_LINES = 500


def _module_name(path: Path) -> str:
    parts = path.with_suffix("").relative_to(PACKAGE.parent).parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(path: Path, modules: set[str]) -> set[str]:
    """hf_paged modules a module imports when it runs (module level and inside functions), leaving out
    imports under `if TYPE_CHECKING:`."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(sub)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for sub in ast.walk(node)
    }
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                child = f"{target}.{alias.name}"
                found.add(child if child in modules else target)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in modules and m != name}


def _graph() -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: _runtime_imports(path, set(paths)) for name, path in paths.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_runtime_import_cycle():
    graph = _graph()
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_cycle_check_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_lower_layers_import_nothing_above_them():
    graph = _graph()

    def reaches(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    above = {"hf_paged.cache", "hf_paged.kvpool", "hf_paged.forward", "hf_paged.attention", "hf_paged.engine"}
    for lower in ("hf_paged.allocator", "hf_paged.pool", "hf_paged.rows", "hf_paged.plan", "hf_paged.growth"):
        assert not reaches(lower) & above, f"{lower} imports {sorted(reaches(lower) & above)}"
    assert not reaches("hf_paged.plan") & {"hf_paged.torch_backend", "hf_paged.triton_path"}, "the plan knows a backend"


def test_no_module_is_over_the_size_limit():
    sizes = {p.relative_to(PACKAGE.parent).as_posix(): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert sizes and not {p: n for p, n in sizes.items() if n > MAX_LINES}
