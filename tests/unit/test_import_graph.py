"""The import graph, read from the source with `ast` (nothing is imported).

Rules: no import cycle among the product's modules (producer_sdk/, gateway/, worker/, pagedq_kernels/),
nor among ops/'s; the top-level packages import only downward (ops -> worker and gateway -> producer_sdk;
worker -> pagedq_kernels; `worker.cli`, the `pagedq` command in front of both, also starts the gateway);
the product never imports `ops` (a source checkout's tooling, not installed) and never edits `sys.path`;
the SDK stays torch-free: producer_sdk/ imports only the standard library and the base install's
packages; the gateway imports only the standard library, producer_sdk and the packages of the `gateway`
extra. No top-level package of the checkout has the import name of an installed distribution: the
checkout is first on `sys.path`, so it would shadow it (transformers 5.25 imports Hugging Face's
`kernels`, which the old top-level `kernels/` hid).

Every import counts, at module level or inside a function, those under `if TYPE_CHECKING:` too: a
type-only import is still a dependency, and a circle through one means a shared type sits on the wrong
side of a seam. An edge goes to the module an import names: `from a.b import c` to `a.b.c` when that
is a module, else to `a.b`; parent packages' `__init__` are not added (every import would then close a
loop through its own package).
"""

from __future__ import annotations

import ast
import itertools
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("producer_sdk", "gateway", "worker", "pagedq_kernels")
TOOLING = ("ops",)
SDK_MUST_NOT_IMPORT = ("torch", "worker", "pagedq_kernels", "gateway")
# The top-level packages each may import: only the layers below it.
LAYERS: dict[str, set[str]] = {
    "producer_sdk": set(),
    "pagedq_kernels": set(),
    "gateway": {"producer_sdk"},
    "worker": {"producer_sdk", "pagedq_kernels"},
    "ops": {"producer_sdk", "pagedq_kernels", "gateway", "worker"},
}
# The `pagedq` command (worker/cli.py) fronts the gateway too: `pagedq gateway` runs it in-process.
# `producer_sdk.gateway`, where the gateway lived before it became its own package: a deprecated
# re-export of `gateway` for one release, so old imports and `python -m producer_sdk.gateway` still work.
DEPRECATED_SHIMS = ("producer_sdk.gateway", "producer_sdk.gateway.__main__")
LAYER_EXCEPTIONS = {("worker.cli", "gateway"), *((shim, "gateway") for shim in DEPRECATED_SHIMS)}
SDK_DEPENDENCIES = ("redis", "msgspec")  # the base install
# import name -> distribution in the `gateway` extra of pyproject.toml
GATEWAY_DEPENDENCIES = {
    "starlette": "starlette",
    "uvicorn": "uvicorn",
    "prometheus_client": "prometheus-client",
    "tqdm": "tqdm",
}


@dataclass(frozen=True)
class Import:
    importer: str  # the importing module, dotted
    name: str  # the absolute dotted name imported (`from a.b import c` -> "a.b.c")
    base: str  # for `from a.b import c`: "a.b"; for `import a.b`: "a.b"
    line: int


# --- reading the source ----------------------------------------------------------------------------


def find_modules(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under the given top-level packages."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _resolve_relative(module: str, is_package: bool, level: int, name: str | None) -> str:
    package = module.split(".") if is_package else module.split(".")[:-1]
    if level > 1:
        package = package[: len(package) - (level - 1)]
    return ".".join([*package, *([name] if name else [])])


def imports_of(module: str, path: Path) -> list[Import]:
    """Every import statement of a module (and `importlib.import_module("...")` with a literal name)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    found: list[Import] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.extend(Import(module, a.name, a.name, node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_relative(module, is_package, node.level, node.module) if node.level else node.module or ""
            for a in node.names:
                name = base if a.name == "*" else f"{base}.{a.name}"
                found.append(Import(module, name, base, node.lineno))
        elif isinstance(node, ast.Call) and _is_dynamic_import(node):
            name = node.args[0].value
            found.append(Import(module, name, name, node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _is_dynamic_import(call: ast.Call) -> bool:
    func = call.func
    called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    return (
        called in ("import_module", "__import__")
        and bool(call.args)
        and isinstance(call.args[0], ast.Constant)
        and isinstance(call.args[0].value, str)
    )


def target_module(imp: Import, modules: dict[str, Path]) -> str | None:
    """The module of `modules` an import loads: the name itself, else its longest known prefix."""
    for candidate in (imp.name, imp.base):
        parts = candidate.split(".")
        for n in range(len(parts), 0, -1):
            prefix = ".".join(parts[:n])
            if prefix in modules:
                return prefix
    return None


def import_graph(root: Path, packages: Iterable[str]) -> dict[str, dict[str, int]]:
    """module -> {imported module of the same set: first line}."""
    modules = find_modules(root, packages)
    graph: dict[str, dict[str, int]] = {m: {} for m in modules}
    for module, path in modules.items():
        for imp in imports_of(module, path):
            target = target_module(imp, modules)
            if target is not None and target != module:
                graph[module].setdefault(target, imp.line)
    return graph


# --- cycles ------------------------------------------------------------------------------------------


def strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
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
                    out.append(sorted(component))
    return out


def a_cycle(graph: dict[str, dict[str, int]], component: list[str]) -> list[str]:
    """One shortest cycle through the first module of a strongly connected component."""
    inside = set(component)
    start = component[0]
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node]):
                if child not in inside:
                    continue
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"no cycle through {start}")  # cannot happen in a component


def cycles(root: Path, packages: Iterable[str]) -> list[str]:
    """Each cycle as `a -> b (line) -> a (line)`, one per strongly connected component."""
    graph = import_graph(root, packages)
    shown = []
    for component in strongly_connected(graph):
        cycle = a_cycle(graph, component)
        steps = [cycle[0]] + [f"{b} (line {graph[a][b]} of {a})" for a, b in itertools.pairwise(cycle)]
        extra = f" [component: {', '.join(component)}]" if len(component) > len(cycle) - 1 else ""
        shown.append(" -> ".join(steps) + extra)
    return shown


# --- the rules ---------------------------------------------------------------------------------------


def test_the_product_has_no_import_cycle():
    found = cycles(ROOT, PRODUCT)
    assert not found, "import cycles in the product:\n  " + "\n  ".join(found)


def test_ops_has_no_import_cycle():
    found = cycles(ROOT, TOOLING)
    assert not found, "import cycles in ops/:\n  " + "\n  ".join(found)


def _all_imports(packages: Iterable[str]) -> list[Import]:
    return [imp for m, p in find_modules(ROOT, packages).items() for imp in imports_of(m, p)]


def test_the_product_never_imports_ops():
    bad = [i for i in _all_imports(PRODUCT) if i.name.split(".")[0] in TOOLING]
    assert not bad, "the product imports ops/ (not installed):\n  " + "\n  ".join(
        f"{i.importer} line {i.line}: {i.name}" for i in bad
    )


def test_the_product_never_edits_sys_path():
    bad = []
    for module, path in find_modules(ROOT, PRODUCT).items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Attribute)
                and node.attr == "path"
                and isinstance(node.value, ast.Name)
                and node.value.id == "sys"
            ):
                bad.append(f"{module} line {node.lineno}")
    assert not bad, "sys.path used in the product:\n  " + "\n  ".join(bad)


def test_the_sdk_imports_no_torch_worker_gateway_or_kernels():
    sdk = [i for i in _all_imports(["producer_sdk"]) if i.importer not in DEPRECATED_SHIMS]
    bad = [i for i in sdk if i.name.split(".")[0] in SDK_MUST_NOT_IMPORT]
    assert not bad, "producer_sdk must stay torch-free and server-free:\n  " + "\n  ".join(
        f"{i.importer} line {i.line}: {i.name}" for i in bad
    )


def upward_imports(root: Path, layers: dict[str, set[str]], exceptions=frozenset()) -> list[str]:
    """Imports of a top-level package by one that is not above it (`LAYERS`)."""
    bad = []
    for module, path in find_modules(root, layers).items():
        top = module.split(".")[0]
        for imp in imports_of(module, path):
            target = imp.name.split(".")[0]
            upward = target in layers and target != top and target not in layers[top]
            if upward and (module, target) not in exceptions:
                bad.append(f"{module} line {imp.line}: {imp.name}")
    return bad


def test_the_top_level_packages_import_only_downward():
    bad = upward_imports(ROOT, LAYERS, LAYER_EXCEPTIONS)
    assert not bad, "imports against the layering (ops -> worker, gateway -> producer_sdk):\n  " + "\n  ".join(bad)


def test_the_gateway_imports_only_the_sdk_and_its_extra():
    allowed = {*sys.stdlib_module_names, "gateway", "producer_sdk", *SDK_DEPENDENCIES, *GATEWAY_DEPENDENCIES}
    gateway = _all_imports(["gateway"])
    assert gateway, "gateway/ not found"
    bad = [i for i in gateway if i.name.split(".")[0] not in allowed]
    assert not bad, "the gateway imports outside the SDK and its extra:\n  " + "\n  ".join(
        f"{i.importer} line {i.line}: {i.name}" for i in bad
    )


def test_the_sdk_needs_no_gateway_package():
    bad = [i for i in _all_imports(["producer_sdk"]) if i.name.split(".")[0] in GATEWAY_DEPENDENCIES]
    assert not bad, "an SDK-only install lacks these:\n  " + "\n  ".join(
        f"{i.importer} line {i.line}: {i.name}" for i in bad
    )


def test_the_gateway_extra_lists_what_the_gateway_imports():
    tomllib = pytest.importorskip("tomllib")
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gateway"]
    names = {re.split(r"[<>=;\[ ]", spec, maxsplit=1)[0].lower() for spec in extra}
    assert set(GATEWAY_DEPENDENCIES.values()) <= names


# --- the machinery, on made-up packages --------------------------------------------------------------


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_a_cycle_through_a_function_level_import_is_found(tmp_path):
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from pkg import b\n",
            "pkg/b.py": "def f():\n    from . import c\n",
            "pkg/c.py": "import pkg.a\n",
            "pkg/d.py": "import pkg.a\n",  # leads into the cycle, is not part of it
        },
    )
    found = cycles(tmp_path, ["pkg"])
    assert len(found) == 1
    assert found[0].startswith("pkg.a -> pkg.b (line 1 of pkg.a) -> pkg.c (line 2 of pkg.b) -> pkg.a (line 1 of pkg.c)")
    assert "pkg.d" not in found[0]


def test_a_cycle_through_type_checking_imports_is_found(tmp_path):
    """A planted circle: a type-only import closes it."""
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n",
            "pkg/b.py": "import typing\nif typing.TYPE_CHECKING:\n    pass\nelse:\n    from .a import x\n",
        },
    )
    assert import_graph(tmp_path, ["pkg"]) == {"pkg": {}, "pkg.a": {"pkg.b": 3}, "pkg.b": {"pkg.a": 5}}
    assert cycles(tmp_path, ["pkg"]) == ["pkg.a -> pkg.b (line 3 of pkg.a) -> pkg.a (line 5 of pkg.b)"]


def test_an_upward_import_is_found(tmp_path):
    """A planted import against the layering, and the one exception that lets a module through."""
    _write(
        tmp_path,
        {
            "low/__init__.py": "",
            "low/m.py": "def f():\n    from high import thing\n",
            "high/__init__.py": "import low.m\n",
            "high/cli.py": "import side\n",
            "side/__init__.py": "import low\n",
        },
    )
    layers = {"low": set(), "side": {"low"}, "high": {"low"}}
    assert upward_imports(tmp_path, layers) == ["low.m line 2: high.thing", "high.cli line 1: side"]
    assert upward_imports(tmp_path, layers, {("high.cli", "side")}) == ["low.m line 2: high.thing"]


def test_relative_and_package_imports_resolve(tmp_path):
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "from .sub import thing\n",
            "pkg/sub/__init__.py": "from ..top import x\nfrom . import leaf\n",
            "pkg/sub/leaf.py": "from pkg.sub import thing\nimport importlib\nimportlib.import_module('pkg.top')\n",
            "pkg/top.py": "import os.path\n",
        },
    )
    graph = import_graph(tmp_path, ["pkg"])
    assert graph["pkg"] == {"pkg.sub": 1}
    assert graph["pkg.sub"] == {"pkg.top": 1, "pkg.sub.leaf": 2}
    assert graph["pkg.sub.leaf"] == {"pkg.sub": 1, "pkg.top": 3}
    assert graph["pkg.top"] == {}
    assert cycles(tmp_path, ["pkg"]) == [
        "pkg.sub -> pkg.sub.leaf (line 2 of pkg.sub) -> pkg.sub (line 1 of pkg.sub.leaf)"
    ]


@pytest.mark.parametrize("source", ["import ops.bench\n", "def f():\n    from ops.bench.cli import main\n"])
def test_an_import_of_ops_is_seen(tmp_path, source):
    _write(tmp_path, {"pkg/__init__.py": "", "pkg/m.py": source})
    names = [i.name for m, p in find_modules(tmp_path, ["pkg"]).items() for i in imports_of(m, p)]
    assert any(n.split(".")[0] == "ops" for n in names)


def test_no_top_level_package_shadows_an_installed_distribution():
    from importlib.metadata import packages_distributions

    provided = packages_distributions()
    for top in PRODUCT + TOOLING:
        others = sorted(d for d in provided.get(top, ()) if d.lower() != "pagedq")
        assert not others, f"{top}/ hides the import name of the installed {others}"
