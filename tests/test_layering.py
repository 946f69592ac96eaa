"""The package's layering, read from the source: imports point down, no circles, modules stay small.

Every module of edgespec/ belongs to a layer (its top-level module or sub-package); a layer may import
only layers below it, lazy imports inside functions included. The applications (server, bench, train,
cli) sit above the runtime, so no runtime module imports them. The package's own __init__ (the public
facade: `edgespec.load`, `edgespec.serve`) is above everything and only the applications may import it.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "edgespec"
MAX_LINES = 400

# lowest first; a layer imports only layers listed before it
LAYERS = ["errors", "text", "gguf_file", "models", "sampling", "chat", "verify", "tree", "backends", "heads",
          "calibration", "drafters", "schedule", "stats", "generation", "tree_step", "engine", "session", "api",
          "server", "bench", "train", "cli", "edgespec"]
APPS = {"server", "bench", "train", "cli"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "edgespec"


def imports(path: Path, known: set[str]) -> set[str]:
    """The edgespec modules `path` imports anywhere in it (`from edgespec import x`: edgespec.x when
    x is a module, else the package itself)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "edgespec"}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] == "edgespec":
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.add(sub if sub in known else node.module)
    return out


def graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    files = {module_name(p): p for p in package.rglob("*.py")}
    return {m: imports(p, set(files)) - {m} for m, p in files.items()}


def upward(g: dict[str, set[str]]) -> list[str]:
    """Every import of a layer at or above the importer's (within a layer: free), as 'a -> b'."""
    bad = []
    for a, targets in g.items():
        la = layer(a)
        for b in sorted(targets):
            lb = layer(b)
            if la == lb and b != "edgespec":
                continue
            if lb not in LAYERS or la not in LAYERS:
                bad.append(f"{a} -> {b} (layer {la if la not in LAYERS else lb} is not in LAYERS)")
            elif (la not in APPS) if b == "edgespec" else LAYERS.index(lb) >= LAYERS.index(la):
                bad.append(f"{a} -> {b}")
    return bad


def circles(g: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles between modules (each found once, from its first module in sorted order)."""
    found, state, stack = [], defaultdict(int), []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(g.get(m, ())):
            if n not in g or n == "edgespec":  # the facade: checked by `upward`
                continue
            if state[n] == 1:
                found.append(stack[stack.index(n):] + [n])
            elif state[n] == 0:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(g):
        if state[m] == 0:
            visit(m)
    return found


def test_every_layer_is_known():
    assert {layer(m) for m in graph()} <= set(LAYERS)


def test_imports_point_down():
    assert upward(graph()) == []


def test_no_import_circles():
    assert circles(graph()) == []


def test_runtime_never_imports_the_applications():
    g = graph()
    bad = [f"{a} -> {b}" for a, bs in g.items() if layer(a) not in APPS | {"edgespec"}
           for b in bs if layer(b) in APPS]
    assert bad == []


def test_modules_stay_under_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in [*PACKAGE.rglob("*.py"), *(ROOT / "bench").rglob("*.py")]
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_the_checks_catch_what_they_name(tmp_path):
    """An upward import, a circle and the facade imported from the runtime are each reported."""
    pkg = tmp_path / "edgespec"
    (pkg / "drafters").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "drafters" / "__init__.py").write_text("")
    (pkg / "drafters" / "a.py").write_text("from edgespec.drafters import b\nfrom edgespec.schedule import x\n")
    (pkg / "drafters" / "b.py").write_text("def f():\n    from edgespec.drafters import a\n")
    (pkg / "schedule.py").write_text("import edgespec\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        g = graph(pkg)
    finally:
        ROOT = saved
    assert "edgespec.drafters.a -> edgespec.schedule" in upward(g)
    assert "edgespec.schedule -> edgespec" in upward(g)
    assert circles(g) == [["edgespec.drafters.a", "edgespec.drafters.b", "edgespec.drafters.a"]]
