"""The package layers of docs/design.md §1, from every product module's imports (parsed with `ast`: `import x`,
`from x import y`, relative imports, and imports inside functions alike), with no import cycle between product
modules, and one reader of the process environment (`actors/environment.py`)."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("graphrunner", "parallel", "modeling", "actors", "engine", "launch")
PROJECT = PRODUCT + ("bench", "tests")
# which project packages each package may import (itself always)
ALLOWED = {
    "graphrunner": set(),
    "parallel": set(),
    "modeling": {"parallel", "graphrunner"},
    "actors": {"modeling", "parallel", "graphrunner"},
    "engine": {"actors"},
    "launch": {"graphrunner", "parallel", "modeling", "actors", "engine"},
}
# third-party packages a layer must not import
FORBIDDEN_THIRD_PARTY = {
    "graphrunner": {"ray", "triton"},
    "parallel": {"ray"},
    "modeling": {"ray"},
    "engine": {"torch", "triton"},
}
ENVIRONMENT_READER = "actors.environment"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def product_modules() -> dict[str, Path]:
    out = {}
    for pkg in PRODUCT:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            out[_module_name(path)] = path
    return out


MODULES = product_modules()


def imports_of(name: str, path: Path) -> list[tuple[str, int]]:
    """(imported module, line) for every import statement of the module, at any depth; `from a import b` names
    the submodule a.b when it is one, else a."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append((sub if sub in MODULES or (ROOT / sub.replace(".", "/")).is_dir() else base,
                              node.lineno))
    return found


def _top(name: str) -> str:
    return name.split(".", 1)[0]


def test_every_package_imports_only_the_layers_below_it():
    bad = []
    for name, path in MODULES.items():
        pkg = _top(name)
        for target, line in imports_of(name, path):
            top = _top(target)
            if top in PROJECT and top != pkg and top not in ALLOWED[pkg]:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {target} ({pkg} may import "
                           f"{sorted(ALLOWED[pkg]) or 'no other project package'})")
            if top in FORBIDDEN_THIRD_PARTY.get(pkg, ()):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {target} ({pkg} must not import {top})")
    assert not bad, "layering violations:\n" + "\n".join(bad)


def _import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for name, path in MODULES.items():
        for target, _ in imports_of(name, path):
            if target in MODULES and target != name:
                graph[name].add(target)
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module (iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
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
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    comp.append(top)
                    if top == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_the_cycle_search_finds_a_cycle():
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert strongly_connected({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_between_product_modules():
    cycles = strongly_connected(_import_graph())
    assert not cycles, "import cycles (function-level imports count):\n" + "\n".join(" <-> ".join(c) for c in cycles)


def _reads_environment(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os" \
                and node.attr in ("environ", "getenv", "putenv", "unsetenv", "environb"):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os" \
                and any(a.name in ("environ", "getenv", "environb") for a in node.names):
            lines.append(node.lineno)
    return lines


def test_only_the_environment_module_reads_the_environment():
    readers = {name: lines for name, path in MODULES.items() if (lines := _reads_environment(ast.parse(path.read_text())))}
    assert set(readers) == {ENVIRONMENT_READER}, readers


def test_the_engine_imports_no_torch():
    code = "import sys, engine, engine.block_manager; print(sorted(m for m in ('torch', 'modeling') if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr[-2000:]
