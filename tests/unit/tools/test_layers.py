"""The import graph of gemini_ckpt: no module imports itself back through others (no circles,
counting imports inside functions and under ``TYPE_CHECKING``), and the packages stand in
layers, each importing only from the layers below it (or its own), and no package imports
itself back through another either."""

from __future__ import annotations

import ast
import pathlib
import sys

import pytest

import gemini_ckpt
import paths

PACKAGE = pathlib.Path(gemini_ckpt.__file__).parent
NAME = "gemini_ckpt"
PLACEMENT = PACKAGE.parent / "placement"  # the planner: pure, a package of its own

LAYERS = [
    # base: stdlib (and numpy) only, no torch, nothing of ours above
    {
        "errors",
        "_version",
        "faults",
        "events",
        "attempts",
        "checksum",
        "signing",
        "unpickle",
        "lineage",
        "health",
        "results",
        "retention",
        "timeouts",
        "config",
        "settings",
    },
    # the data plane (authenticated TCP streams, stdlib only) and the commit protocol (sans-I/O)
    {"dataplane", "commit"},
    # the format: shard plans and records, segments, checksums with the health check, DCP framing,
    # the durable tier's manifest; torch-free
    {"format"},
    # the live training state; the broadcast from rank 0
    {"state", "collective"},
    # reading what we did not just produce: allow-lists, manifests, signatures
    {"trust"},
    # the snapshot: planning and staging a version on the trainer
    {"save"},
    # the tiers' storage and the verified views restore reads
    {"stores"},
    # the durable tier: backends by URI scheme, the layout and its atomic commit, the tier restore
    # reads, the writer that persists a memory version as a DCP checkpoint
    {"durable"},
    # restoring, seeding from stock checkpoints, the host stores (their client side and actors)
    {"restore", "init_from", "hoststore"},
    {"checkpointer"},
    # what users call: the package facade, Ray Train, the command line
    {"__init__", "integrations", "cli"},
    # the toy training setup the tools, examples, tests and benchmarks share (torch only); the
    # rig only they use (a local cluster, network namespaces, the commit simulator)
    {"toy", "testing"},
    # tools built on all of it
    {"chaos", "demo", "__main__"},
]


def _modules(package: pathlib.Path = PACKAGE) -> dict[str, pathlib.Path]:
    out = {}
    for path in package.rglob("*.py"):
        parts = (package.name,) + path.relative_to(package).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(modules: dict[str, pathlib.Path], name_of: str = NAME) -> dict[str, set[str]]:
    """module -> the modules of ours (``name_of``'s) it imports, anywhere in its text."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([node.module] if node.module else []))
                # ``from .pkg import module`` imports the module; ``from .module import name``, the module
                found = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
            else:
                continue
            for target in found:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                # a package's own ``__init__`` runs before any of its modules anyway: not an edge
                if target.startswith(name_of + ".") and target != name and not name.startswith(target + "."):
                    targets.add(target)
        graph[name] = targets
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

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
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Top-level package -> the top-level packages it imports (a package's ``__init__`` that only
    re-exports its modules is counted as the package)."""
    out: dict[str, set[str]] = {}
    for source, targets in graph.items():
        for target in targets:
            if target == NAME:
                continue  # the facade: a lazy table, no imports of its own
            a, b = _top(source), _top(target)
            if a != b:
                out.setdefault(a, set()).add(b)
    return out


@pytest.mark.parametrize("package", [PACKAGE, PLACEMENT], ids=lambda p: p.name)
def test_no_module_imports_itself_back(package):
    circles = _circles(_imports(_modules(package), package.name))
    assert not circles, f"import circles: {circles}"


def test_the_planner_imports_nothing_but_the_standard_library_and_itself():
    # placement/ is pure: the planner and advise run where neither torch nor Ray is installed
    allowed = set(sys.stdlib_module_names) | {"placement", "matplotlib"}  # matplotlib: --plot only, imported late
    found = []
    for name, path in _modules(PLACEMENT).items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                roots = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                roots = [(node.module or "").split(".")[0]]
            else:
                continue
            found += [f"{name}: {root}" for root in roots if root not in allowed]
    assert not found, f"placement/ imports outside the standard library: {found}"


def test_every_package_has_a_layer():
    packages = {_top(m) for m in _modules()}
    layered = set().union(*LAYERS)
    assert packages == layered, f"not in LAYERS: {sorted(packages - layered)}; gone: {sorted(layered - packages)}"


def test_packages_import_only_from_their_layer_or_below():
    layer_of = {p: i for i, layer in enumerate(LAYERS) for p in layer}
    graph = _imports(_modules())
    upward = sorted(
        f"{source} -> {target}"
        for source, targets in graph.items()
        for target in targets
        if target != NAME and layer_of[_top(target)] > layer_of[_top(source)]
    )
    assert not upward, f"imports from a higher layer: {upward}"


def test_no_package_imports_itself_back():
    packages = _package_graph(_imports(_modules()))
    circles = _circles(packages)
    assert not circles, f"package circles: {circles}"


def test_the_graph_is_read_the_way_python_imports():
    # the reader must see relative, absolute, function-level and TYPE_CHECKING imports alike
    graph = _imports(_modules())
    assert "gemini_ckpt.hoststore.names" in graph["gemini_ckpt.hoststore.cluster"]  # from .names import (...)
    assert "gemini_ckpt.errors" in graph["gemini_ckpt.commit.host"]  # from ..errors import
    assert "gemini_ckpt.timeouts" in graph["gemini_ckpt.hoststore.actors.serving"]  # from ...timeouts import
    assert "gemini_ckpt.hoststore.client" in graph["gemini_ckpt.checkpointer.tiers"]  # inside a function
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("package", [PACKAGE, PLACEMENT], ids=lambda p: p.name)
def test_no_private_name_is_imported_from_another_module(package):
    # ``from .dcp import _uint8`` couples two modules through a name the first may change at will;
    # a private module of a package (``from . import _wire``) is that package's business
    modules = _modules(package)
    found = []
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith(package.name)):
                here = name if path.name == "__init__.py" else name.rpartition(".")[0]
                base = node.module or ""
                if node.level:
                    up = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([node.module] if node.module else []))
                for alias in node.names:
                    private = alias.name.startswith("_") and not alias.name.startswith("__")
                    if private and f"{base}.{alias.name}" not in modules:
                        found.append(f"{name}: from {base} import {alias.name}")
    assert not found, f"private names imported across modules: {found}"


MAX_LINES = 400


@pytest.mark.parametrize("package", [PACKAGE, PLACEMENT], ids=lambda p: p.name)
def test_no_library_module_over_400_lines(package):
    # a module past this holds more than one job (split it by concept, not by count)
    long = sorted(
        f"{path.relative_to(package)}: {n}"
        for path in package.rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    )
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_no_test_module_over_400_lines():
    # tests are laid out by what they test; a file past this tests more than one thing
    tests = paths.TESTS
    long = sorted(
        f"{path.relative_to(tests)}: {n}"
        for path in tests.rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    )
    assert not long, f"test modules over {MAX_LINES} lines: {long}"
