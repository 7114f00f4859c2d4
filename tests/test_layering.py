"""The package as docs/design.md draws it: no import circles, and each package importing only what
its row of the design's "may import" table allows.

The graph is built statically (ast) from every import statement of pynccl/, wherever it stands:
at module level, inside a function (a lazy import), under `if TYPE_CHECKING:`. A lazy import still
makes the importer depend on the imported module; a circle closed by one only fails later, when
the first call reaches it, and is still a circle a reader must untangle. Not edges: the implicit
import of a package's __init__ when one of its submodules is imported (a package re-exporting its
children would otherwise be a circle with each of them), and importlib calls with computed names
(pynccl/__init__.py's lazy attribute table, which names only top-level packages).
"""
from __future__ import annotations

import ast
import pathlib
import re
from typing import Dict, List, Set, Tuple

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pynccl"
DESIGN = ROOT / "docs" / "design.md"

# Lazy edges allowed to close a circle: (importer, imported) -> why. Empty: there are none, and an
# entry here needs a reason a reviewer would accept.
ALLOWED_CIRCLE_EDGES: Dict[Tuple[str, str], str] = {}


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> Dict[str, pathlib.Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(importer: str, is_package: bool, node: ast.AST, known: Set[str]) -> List[Tuple[str, int]]:
    """The pynccl modules one import statement names, each with its line."""
    targets = []
    if isinstance(node, ast.Import):
        for alias in node.names:
            targets.append(alias.name)
    else:
        assert isinstance(node, ast.ImportFrom)
        if node.level:
            base = importer.split(".") if is_package else importer.split(".")[:-1]
            base = base[:len(base) - (node.level - 1)]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        for alias in node.names:
            # `from pkg import mod` names the submodule; `from mod import name` names mod.
            targets.append(f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source)
    found = []
    for target in targets:
        while target and target not in known:   # `import pynccl.comm.distributed as d`: the module itself
            target = target.rpartition(".")[0]
        if target:
            found.append((target, node.lineno))
    return found


def import_graph() -> Dict[str, Dict[str, int]]:
    """{importer: {imported: first line}} over pynccl's own modules."""
    mods = modules()
    known = set(mods)
    graph: Dict[str, Dict[str, int]] = {m: {} for m in mods}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target, line in _resolve(name, path.name == "__init__.py", node, known):
                    if target != name:
                        graph[name].setdefault(target, line)
    return graph


def strongly_connected(graph: Dict[str, Dict[str, int]]) -> List[List[str]]:
    """Tarjan's algorithm, iteratively: the components of more than one module."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
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
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _path_of(name: str) -> str:
    return str(modules()[name].relative_to(ROOT))


def test_the_graph_sees_lazy_and_relative_imports():
    # What the checks below rely on, on known lines of the tree: a relative import of a submodule
    # by name, a relative import of a package's function, and a lazy import inside a function.
    graph = import_graph()
    assert "pynccl.comm.distributed" in graph["pynccl.mesh"]                 # from .comm import distributed
    assert "pynccl.comm.backends.gloo" in graph["pynccl.comm.groups"]        # lazy, in _make_backend
    assert "pynccl.zero.clip" in graph["pynccl.zero"]                        # from .clip import clip_grad_norm_
    assert "pynccl._ext" in graph["pynccl"]


def test_strongly_connected_finds_a_circle_and_only_circles():
    graph = {"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}, "e": {}}
    assert strongly_connected(graph) == [["a", "b", "c"]]
    assert strongly_connected({"a": {"b": 1}, "b": {}}) == []


def test_no_import_circles():
    graph = import_graph()
    problems = []
    for component in strongly_connected(graph):
        members = set(component)
        edges = [(a, b) for a in component for b in sorted(graph[a]) if b in members]
        if all((a, b) in ALLOWED_CIRCLE_EDGES for a, b in edges):
            continue
        lines = [f"  {_path_of(a)}:{graph[a][b]} imports {b}" for a, b in edges]
        problems.append(f"circle {' <-> '.join(component)}:\n" + "\n".join(lines))
    assert not problems, "import circles in pynccl/:\n" + "\n".join(problems)


# ----------------------------------------------------------------------------- layer rules
def layer_rules() -> Dict[str, Set[str]]:
    """docs/design.md's table under "may import": {package: the packages it may import}."""
    text = DESIGN.read_text()
    section = text.split("<!-- layer rules: tests/test_layering.py reads this table -->", 1)
    assert len(section) == 2, "docs/design.md lost the layer-rules table that tests/test_layering.py reads"
    rules = {}
    lines = section[1].strip().splitlines()
    assert lines[0].startswith("| package") and lines[1].startswith("|---"), lines[:2]
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        package = re.match(r"`([\w.]+)`", cells[0]).group(1)
        allowed = set(re.findall(r"`([\w.]+)`", cells[1]))
        rules[package] = allowed
    return rules


def _owner(module: str, rules: Dict[str, Set[str]]) -> str:
    """The most specific rule row a module falls under."""
    best = ""
    for package in rules:
        # The root's row is its __init__.py alone: a new top-level module needs a row of its own.
        covers = module == package or (package != "pynccl" and module.startswith(package + "."))
        if covers and len(package) > len(best):
            best = package
    return best


def test_every_module_is_under_a_layer_rule():
    rules = layer_rules()
    unowned = [m for m in modules() if not _owner(m, rules)]
    assert not unowned, f"modules that no row of docs/design.md's layer table covers: {unowned}"
    unknown = {a for allowed in rules.values() for a in allowed if not _owner(a, rules) and a != "pynccl._C"}
    assert not unknown, f"the layer table allows imports of packages that do not exist: {sorted(unknown)}"


def test_layers_import_only_what_the_design_allows():
    rules = layer_rules()
    graph = import_graph()
    problems = []
    for importer, targets in sorted(graph.items()):
        own = _owner(importer, rules)
        for target, line in sorted(targets.items()):
            theirs = _owner(target, rules)
            if theirs != own and theirs not in rules[own]:
                problems.append(f"  {_path_of(importer)}:{line} imports {target} "
                                f"({own} may import {sorted(rules[own]) or 'nothing of pynccl'})")
    assert not problems, "imports against docs/design.md's layer table:\n" + "\n".join(problems)


@pytest.mark.parametrize("package, forbidden", [
    ("pynccl.comm", {"pynccl.ddp", "pynccl.zero", "pynccl.tensor_parallel", "pynccl.pipeline", "pynccl.mesh"}),
    ("pynccl.pipeline", {"pynccl.ddp", "pynccl.zero", "pynccl.tensor_parallel"}),
    ("pynccl.tensor_parallel", {"pynccl.ddp", "pynccl.zero", "pynccl.pipeline"}),
    ("pynccl.ddp", {"pynccl.zero", "pynccl.tensor_parallel", "pynccl.pipeline"}),
])
def test_the_design_table_keeps_the_training_layers_apart(package, forbidden):
    # The rules the design states in prose, checked against the table itself, so that widening a
    # row of the table cannot quietly undo them.
    allowed = layer_rules()[package]
    assert not allowed & forbidden, f"docs/design.md lets {package} import {sorted(allowed & forbidden)}"
