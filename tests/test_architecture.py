"""The layout docs/architecture.md describes: no runtime import cycle inside hf_paged, no god file, and every module
importing only its own layer and those below it, as the layer table of docs/architecture.md lists them."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "hf_paged"


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


ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"


def layer_table() -> list[tuple[str, list[str]]]:
    """The layers of docs/architecture.md's table, lowest first: `(layer, [package or module, ...])`. The table
    lies between the `<!-- layers -->` and `<!-- /layers -->` markers; its second column names the packages and
    modules of the layer in backticks."""
    text = ARCHITECTURE.read_text()
    table = text[text.index("<!-- layers -->") : text.index("<!-- /layers -->")]
    layers = []
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[1].startswith("`"):
            layers.append((cells[0].strip("*"), re.findall(r"`([\w.]+)`", cells[1])))
    return layers


def layer_of(module: str, layers: list[tuple[str, list[str]]]) -> int:
    """Index of the layer a module belongs to: the longest package or module name of the table it is or lies in."""
    best, found = -1, None
    for index, (_, names) in enumerate(layers):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best:
                best, found = len(name), index
    assert found is not None, f"{module} is in no layer of docs/architecture.md's table"
    return found


def test_every_module_imports_only_its_layer_and_those_below():
    layers, graph = layer_table(), _graph()
    assert [name for name, _ in layers][:5] == ["base", "memory", "attention", "cache", "engine"], layers
    wrong = [
        f"{module} ({layers[layer_of(module, layers)][0]}) imports {target} ({layers[layer_of(target, layers)][0]})"
        for module, targets in graph.items()
        for target in targets
        if layer_of(target, layers) > layer_of(module, layers)
    ]
    assert not wrong, "\n".join(wrong)


def test_the_layer_check_finds_an_upward_import():
    layers = [("base", ["hf_paged.errors"]), ("memory", ["hf_paged.memory"]), ("cache", ["hf_paged.cache"])]
    assert layer_of("hf_paged.memory.pool", layers) == 1
    assert layer_of("hf_paged.cache.rows", layers) > layer_of("hf_paged.memory.pool", layers)


def test_the_plan_knows_no_backend():
    reached, todo, graph = set(), ["hf_paged.attention.plan"], _graph()
    while todo:
        for nxt in graph[todo.pop()]:
            if nxt not in reached:
                reached.add(nxt)
                todo.append(nxt)
    assert not reached & {"hf_paged.attention.torch_backend", "hf_paged.attention.triton_path"}
