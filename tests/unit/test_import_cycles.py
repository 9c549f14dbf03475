"""No two of rlmesh's own modules import each other, directly or around a longer loop: two modules
that do are one concept split wrongly, or a callback that belongs to the caller.

The graph is read from the source with `ast`, folders mapped to import names as test_layering.py
maps them. Every import statement is an edge: a lazy one inside a function (deferring an import
does not remove the loop), and one under `if TYPE_CHECKING:` too (it never runs, but a module that
names another's types knows that module; a loop that runs only through such imports is still two
modules that know each other). An edge goes to the module the statement names: `from rlmesh.x
import y` to `rlmesh.x.y` where that is a module, else to `rlmesh.x`; the parent packages Python
also initialises on the way are not edges."""

import ast

from tests.unit.test_layering import REPO, ROOTS, _module_name


def _imported(tree: ast.AST, modules: set[str]) -> set[str]:
    """The project modules that the import statements anywhere in `tree` name."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                target = f"{node.module}.{a.name}"
                if target in modules:
                    out.add(target)
                elif node.module in modules:
                    out.add(node.module)
    return out


def import_graph() -> dict[str, set[str]]:
    """dotted module name -> the project modules it imports (generated code excluded)."""
    paths = {_module_name(p): p for folder in ROOTS for p in (REPO / folder).rglob("*.py")
             if "_pb2" not in p.name}
    names = set(paths)
    return {name: _imported(ast.parse(path.read_text()), names) for name, path in paths.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (or a module importing itself),
    by Tarjan's algorithm; each sorted, and the list sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def _describe(component: list[str], graph: dict[str, set[str]]) -> str:
    edges = [f"{a} -> {b}" for a in component for b in sorted(graph[a]) if b in component]
    return "{" + ", ".join(component) + "}: " + "; ".join(edges)


def test_no_import_cycles():
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(_describe(c, graph) for c in found)


def test_a_planted_cycle_is_caught():
    """The check can fail: a back-import from a component into the controller closes a loop,
    whether it is lazy (inside a function) or only for type checking."""
    graph = import_graph()
    assert "rlmesh.learner.rl.issuer" in graph["rlmesh.learner.rl.controller"]
    for back in ("def f():\n    from rlmesh.learner.rl import controller\n",
                 "if TYPE_CHECKING:\n    from rlmesh.learner.rl.controller import Controller\n"):
        planted = {**graph, "rlmesh.learner.rl.issuer":
                   graph["rlmesh.learner.rl.issuer"] | _imported(ast.parse(back), set(graph))}
        found = cycles(planted)
        assert len(found) == 1 and {"rlmesh.learner.rl.controller", "rlmesh.learner.rl.issuer"} <= set(found[0]), back
