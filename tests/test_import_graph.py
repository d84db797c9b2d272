"""The import graph keeps the architecture: no circles, rooms and packages in their order.

Every module under protos/, runtime/, kernels/, gpu_worker/, router/ and clients/ is parsed
(not imported) and each import of a pagoda module is an edge, function-level (lazy) imports
included; imports under `if TYPE_CHECKING:` are not, since they never run. Only explicit
imports count: `import pagoda.a.b` runs pagoda/a/__init__.py too, but a package's own
__init__ importing its submodules is not a circle.

Rules (DESIGN.md, "Layout"):
- no import cycle among modules;
- inside gpu_worker the rooms are ordered core < models < features < runner < engine < serving;
  a room imports only rooms below it (and protos, runtime, kernels); gpu_worker's own
  __init__/__main__ sit above all rooms; `testing` may import anything, nothing imports it;
- protos imports no other pagoda package, runtime only protos, kernels only itself; router and
  clients import no gpu_worker, kernels, torch or transformers; gpu_worker no router or clients;
- a function-level import of a pagoda module, torch or triton says why it is lazy, in a
  comment holding LAZY_MARK on its line or the line above, e.g.
  `from pagoda.kernels.triton_norm import rotary_triton  # lazy: triton, only with the triton backend`.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("protos", "runtime", "kernels", "gpu_worker", "router", "clients")
ROOMS = ("core", "models", "features", "runner", "engine", "serving")
LAZY_MARK = "# lazy:"
HEAVY = ("torch", "triton")                     # lazy imports of these need a reason too
NO_GPU_STACK = ("torch", "transformers")        # never in a router or client


@dataclass(frozen=True)
class Import:
    source: str          # importing module, pagoda.<...>
    target: str          # imported module: a scanned pagoda module, or a top-level package name
    line: int
    lazy: bool           # inside a function


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["pagoda", *parts])


def _modules() -> dict[str, Path]:
    found = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if "_pb2" not in path.name:
                found[_module_name(path)] = path
    return found


MODULES = _modules()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _resolve(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not MODULES[module].name == "__init__.py":
        base.pop()
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """What an import statement loads: scanned pagoda modules by name, anything else by its
    top-level package."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = _resolve(module, node)
        subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES]
        # `from pkg import submodule` loads the submodule; `from pkg import name` the package.
        names = subs if len(subs) == len(node.names) else [base, *subs]
    out = []
    for name in names:
        if name.startswith("pagoda."):
            while name not in MODULES and "." in name:     # an attribute: its module
                name = name.rsplit(".", 1)[0]
        else:
            name = name.split(".")[0]
        out.append(name)
    return out


def _walk(module: str, tree: ast.AST, lazy: bool = False):
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                yield from _walk(module, ast.Module(body=[child], type_ignores=[]), lazy)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for target in _targets(module, node):
                yield Import(module, target, node.lineno, lazy)
        yield from _walk(module, node, lazy or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                   ast.Lambda)))


def _imports() -> list[Import]:
    return [imp for module, path in MODULES.items()
            for imp in _walk(module, ast.parse(path.read_text(), str(path)))]


IMPORTS = _imports()


def _where(imp: Import) -> str:
    return f"{MODULES[imp.source].relative_to(ROOT)}:{imp.line} imports {imp.target}"


def _package(module: str) -> str:
    return module.split(".")[1] if module.startswith("pagoda.") else module


def _room(module: str) -> str | None:
    """gpu_worker's room of a module; None for gpu_worker's own __init__/__main__."""
    parts = module.split(".")
    return parts[2] if len(parts) > 3 or (len(parts) == 3 and parts[2] in ROOMS + ("testing",)) else None


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """A cycle [a, b, ..., a] of the graph, if it has one (iterative DFS)."""
    color: dict[str, int] = {}            # 1: on the current path, 2: done
    for start in sorted(edges):
        if color.get(start):
            continue
        path, stack = [start], [iter(sorted(edges.get(start, ())))]
        color[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                color[path.pop()] = 2
                stack.pop()
            elif color.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not color.get(nxt):
                color[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(edges.get(nxt, ()))))
    return None


def _edges(imports: list[Import]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for imp in imports:
        if imp.target in MODULES:
            edges.setdefault(imp.source, set()).add(imp.target)
    return edges


def test_scan_sees_the_tree():
    assert {"pagoda.gpu_worker.core.scheduler", "pagoda.kernels.reference", "pagoda.router",
            "pagoda.protos.block_hash"} <= set(MODULES)
    assert any(i.lazy for i in IMPORTS) and any(not i.lazy for i in IMPORTS)


def test_no_import_cycle():
    cycle = find_cycle(_edges(IMPORTS))
    if cycle is not None:
        lines = [next(_where(i) for i in IMPORTS if i.source == a and i.target == b)
                 for a, b in zip(cycle, cycle[1:])]
        raise AssertionError("import cycle: " + " -> ".join(cycle) + "\n  " + "\n  ".join(lines))


def test_find_cycle_reports_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"a"}}) == ["a", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}}) is None


def test_gpu_worker_rooms_import_only_rooms_below():
    bad = []
    for imp in IMPORTS:
        if not (imp.source.startswith("pagoda.gpu_worker") and imp.target.startswith("pagoda.gpu_worker.")):
            continue
        src, dst = _room(imp.source), _room(imp.target)
        if src == "testing" or dst is None or dst == "testing":     # testing: test_package_direction
            continue
        if src is None:
            continue        # gpu_worker/__init__ and __main__ stand above every room
        if ROOMS.index(dst) > ROOMS.index(src):
            bad.append(f"{_where(imp)}: room {src} may not import room {dst} (order: {' < '.join(ROOMS)})")
    assert not bad, "\n".join(bad)


def test_package_direction():
    allowed = {"protos": {"protos"}, "runtime": {"runtime", "protos"}, "kernels": {"kernels"}}
    forbidden = {"router": {"gpu_worker", "kernels", *NO_GPU_STACK},
                 "clients": {"gpu_worker", "kernels", *NO_GPU_STACK},
                 "gpu_worker": {"router", "clients"}}
    bad = []
    for imp in IMPORTS:
        src = _package(imp.source)
        dst = _package(imp.target)
        pagoda_target = imp.target.startswith("pagoda.")
        if src in allowed and pagoda_target and dst not in allowed[src]:
            bad.append(f"{_where(imp)}: {src} may import only {', '.join(sorted(allowed[src]))}")
        if dst in forbidden.get(src, ()):
            bad.append(f"{_where(imp)}: {src} must not import {dst}")
        if imp.target.startswith("pagoda.gpu_worker.testing") and _room(imp.source) != "testing":
            bad.append(f"{_where(imp)}: only tests and fixtures import gpu_worker.testing")
    assert not bad, "\n".join(bad)


def test_lazy_imports_say_why():
    bad = []
    for imp in IMPORTS:
        if not imp.lazy or not (imp.target.startswith("pagoda.") or imp.target in HEAVY):
            continue
        lines = MODULES[imp.source].read_text().splitlines()
        near = lines[imp.line - 1] + (lines[imp.line - 2] if imp.line > 1 else "")
        if LAZY_MARK not in near:
            bad.append(f"{_where(imp)} inside a function without a {LAZY_MARK!r} reason on its line or the one above")
    assert not bad, "\n".join(bad)
