"""The layering of arborspec's modules: no import cycles, and model backends that never reach up.

The graph is read from the source with `ast`, so imports inside functions count as much as those at the top of a
module (a function-level import is still a dependency; hiding one there only delays the cycle to the first call).
Relative imports are resolved against the importing module's package. `from X import a` depends on X.a when that is a
module, and on X itself (its __init__ runs first). A package's __init__ importing its own submodules (a registry such
as drafting/__init__.py's POLICIES) is not counted: Python initialises a package before any of its submodules
anyway, so that edge adds no order between modules, and counting it would make every module that reads a name from
its package (e.g. `from . import __version__`) look circular.
"""
from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "arborspec"


def find_modules(src: Path = SRC, package: str = PACKAGE) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, whether it is a package's __init__)."""
    out = {}
    for path in sorted((src / package).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


def imported_names(name: str, path: Path, is_package: bool) -> set[str]:
    """Every module name `name` imports anywhere in its file (absolute; may name attributes, resolved later)."""
    base = name if is_package else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                module = f"{anchor}.{node.module}" if node.module else anchor
            else:
                module = node.module or ""
            out.add(module)
            out.update(f"{module}.{alias.name}" for alias in node.names)
    return out


def import_graph(modules: dict[str, tuple[Path, bool]]) -> dict[str, set[str]]:
    """Module -> the package modules it imports (outside modules dropped; see the module docstring for __init__s)."""

    def resolve(target: str) -> str | None:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        return target or None

    graph = {}
    for name, (path, is_package) in modules.items():
        edges = {resolve(t) for t in imported_names(name, path, is_package)} - {None, name}
        if is_package:
            edges = {e for e in edges if not e.startswith(name + ".")}
        graph[name] = edges
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One concrete cycle [a, b, ..., a] per strongly connected component of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_through(min(c), c, graph) for c in components]


def _cycle_through(start: str, component: set[str], graph: dict[str, set[str]]) -> list[str]:
    """The shortest path start -> ... -> start inside `component` (breadth first)."""
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start] + path[::-1][1:] + [start] if len(path) > 1 else [start, start]
                if w not in came_from:
                    came_from[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{start} is on no cycle of its component")  # unreachable for a real component


# ---- the checks ------------------------------------------------------------------------------------------------------
def test_the_cycle_finder_reports_real_cycles_only():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"d"}}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []
    assert find_cycles({"x": {"y"}, "y": {"x"}}) == [["x", "y", "x"]]


def test_imports_are_resolved_relative_to_their_package(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .sub import low\n__version__ = '1'\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "low.py").write_text("def f():\n    from .. import top\n")
    (pkg / "top.py").write_text("from .sub.low import f\nfrom . import __version__\n")
    modules = find_modules(tmp_path, "pkg")
    graph = import_graph(modules)
    assert graph["pkg.sub.low"] == {"pkg", "pkg.top"}  # the function-level import counts
    assert graph["pkg.top"] == {"pkg.sub.low", "pkg"}  # a name from a package's __init__ depends on the package
    assert graph["pkg"] == set()  # its own submodules: a registry, not a dependency
    assert find_cycles(graph) == [["pkg.sub.low", "pkg.top", "pkg.sub.low"]]


def test_arborspec_has_no_import_cycles():
    cycles = find_cycles(import_graph(find_modules()))
    assert not cycles, "import cycles (function-level imports included):\n" + "\n".join(
        " -> ".join(cycle) for cycle in cycles)


# The floors, lowest first: a module imports only from its own floor and the floors below it (docs/layout.md says why).
FLOORS = [
    ("core", "viz"),  # the token tree, sampling, the disk cache, option parsing; matplotlib set-up and drawings
    ("kernels",),  # the C++ GGUF kernels and their build
    ("backends",),  # sessions over transformers, Mamba2, llama.cpp and the native kernels
    ("tuning",),  # what is measured on this machine: forward costs, runtime model, draft variants
    ("verify",),  # acceptance rules
    ("drafting",),  # tree policies and free branches
    ("engine",),  # the draft -> verify -> commit loop
    ("loading",),  # aliases, one model, the backend plan, the pair loader
    ("runspec", "flags"),  # the method grammar; the shared flags
    ("console", "cli", "chat", "server", "bench", "__main__"),  # the front ends; console: what needs no model
]
MAX_LINES = 400


def floor_of(module: str) -> int | None:
    """The floor of `arborspec.X...` (None for the package root, whose __init__ re-exports the public API)."""
    top = module.split(".")[1] if module.count(".") else None
    for level, names in enumerate(FLOORS):
        if top in names:
            return level
    return None


def test_every_module_sits_on_a_floor():
    lost = sorted(m for m in find_modules() if m != PACKAGE and floor_of(m) is None)
    assert not lost, "modules on no floor (add them to FLOORS): " + ", ".join(lost)


def test_no_module_imports_from_a_floor_above_its_own():
    graph = import_graph(find_modules())
    bad = sorted(f"{m} ({FLOORS[floor_of(m)][0]}) -> {t} ({FLOORS[floor_of(t)][0]})" for m in graph for t in graph[m]
                 if floor_of(m) is not None and floor_of(t) is not None and floor_of(t) > floor_of(m))
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_the_floor_check_catches_an_upward_import():
    assert floor_of(f"{PACKAGE}.core.tree") < floor_of(f"{PACKAGE}.backends.hf") < floor_of(f"{PACKAGE}.engine")
    assert floor_of(f"{PACKAGE}.engine.decoder") < floor_of(f"{PACKAGE}.cli") and floor_of(PACKAGE) is None


def test_long_modules_say_why_in_their_docstring():
    """A module over MAX_LINES lines says why it is one file: its docstring holds "over 400 lines" and the reason."""
    long = []
    for name, (path, _) in find_modules().items():
        text = path.read_text()
        lines = text.count("\n")
        doc = ast.get_docstring(ast.parse(text)) or ""
        if lines > MAX_LINES and f"over {MAX_LINES} lines" not in doc.lower():
            long.append(f"{name} ({lines} lines)")
    assert not long, "long modules with no reason in their docstring: " + ", ".join(sorted(long))
