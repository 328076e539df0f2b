"""No import cycles in the package, lazy (function-level) imports included: modules import one way."""

from __future__ import annotations

import ast
from pathlib import Path

import infer_tune

ROOT = Path(infer_tune.__file__).parent


def module_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports anywhere in its source (`from pkg import sub` counts as sub)."""
    files = {}
    for file in ROOT.rglob("*.py"):
        parts = list(file.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        files[".".join(parts)] = file
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, file in files.items():
        package = name if file.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            elif isinstance(node, ast.Call) and _imported_by_name(node):
                targets = [node.args[0].value]  # importlib.import_module("infer_tune.x"): an import all the same
            else:
                continue
            graph[name].update(t for t in targets if t in files and t != name)
    return graph


def _imported_by_name(call: ast.Call) -> bool:
    """`importlib.import_module("...")`, `import_module("...")` or `__import__("...")` with a literal name."""
    func = call.func
    called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    return (called in ("import_module", "__import__") and bool(call.args)
            and isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str))


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycles_lazy_imports_included():
    assert cycles(module_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_graph_sees_imports_by_name():
    """A module that imports another through importlib with a literal name depends on it like any import."""
    source = "import importlib\n\ndef f():\n    return importlib.import_module('infer_tune.tuners')\n"
    tree = ast.parse(source)
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and _imported_by_name(n)]
    assert [c.args[0].value for c in calls] == ["infer_tune.tuners"]


# --------------------------------------------------------------------------- layers
ARCHITECTURE = ROOT.parent / "docs" / "architecture.md"


def layer_order(text: str | None = None) -> list[list[str]]:
    """The layers of docs/architecture.md's ```layers block, top first: each line's names (after `#`: a comment)."""
    text = ARCHITECTURE.read_text(encoding="utf-8") if text is None else text
    block = text.split("```layers\n", 1)[1].split("```", 1)[0]
    return [line.split("#", 1)[0].split() for line in block.splitlines() if line.split("#", 1)[0].strip()]


def layer_of(module: str, layers: list[list[str]]) -> int | None:
    """The layer of the longest name in `layers` that is `module` or a package above it (None: no layer)."""
    best: tuple[int, int] | None = None
    for i, names in enumerate(layers):
        for name in names:
            full = "infer_tune" if name == "infer_tune" else f"infer_tune.{name}"
            if (module == full or module.startswith(full + ".")) and (best is None or len(full) > best[1]):
                best = (i, len(full))
    return best[0] if best else None


def upward_imports(graph: dict[str, set[str]], layers: list[list[str]]) -> list[str]:
    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets
                  if layer_of(b, layers) is not None and layer_of(a, layers) is not None
                  and layer_of(b, layers) < layer_of(a, layers))


def test_every_module_has_a_layer():
    layers = layer_order()
    assert [m for m in module_graph() if layer_of(m, layers) is None] == []


def test_no_import_points_up_the_layers():
    """docs/architecture.md's layer order, as written there: no module imports one of a higher layer."""
    assert upward_imports(module_graph(), layer_order()) == []


def test_the_layer_check_finds_an_upward_import():
    layers = layer_order("```layers\ncli  # top\nengines\nengines.base errors\n```\n")
    assert layers == [["cli"], ["engines"], ["engines.base", "errors"]]
    graph = {"infer_tune.engines.base": {"infer_tune.engines.slots"}, "infer_tune.engines.slots": {"infer_tune.errors"},
             "infer_tune.cli": {"infer_tune.engines.slots"}}
    assert upward_imports(graph, layers) == ["infer_tune.engines.base -> infer_tune.engines.slots"]
