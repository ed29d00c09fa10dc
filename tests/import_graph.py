"""kvforge's modules and what each imports (read with ast, function-level imports included), for the layer tests."""
from __future__ import annotations

import ast
import pathlib

import kvforge

PACKAGE = pathlib.Path(kvforge.__file__).parent
LEAF_TYPES = ("kvforge.errors", "kvforge.options", "kvforge.outputs", "kvforge.rope", "kvforge.sampling_params",
              "kvforge.speculative_config", "kvforge.units", "kvforge.version")


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES: dict[str, pathlib.Path] = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str) -> set[str]:
    """The kvforge modules `name` imports anywhere in its file (`from pkg import sub` names the module pkg.sub)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + [base]).strip(".")
            subs = {f"{base}.{a.name}" for a in node.names} & MODULES.keys()
            found |= subs or {base}
    return {m for m in found if m == "kvforge" or m.startswith("kvforge.")}


def under(package: str) -> list[str]:
    return [m for m in MODULES if m == package or m.startswith(package + ".")]


def is_in(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def reaches_outside(name: str, allowed: tuple[str, ...]) -> list[str]:
    """What `name` imports beyond the packages (and modules) in `allowed`."""
    return sorted(m for m in imports_of(name) if not is_in(m, allowed))


def reaches_into(name: str, forbidden: tuple[str, ...]) -> list[str]:
    """What `name` imports from the packages (and modules) in `forbidden`."""
    return sorted(m for m in imports_of(name) if is_in(m, forbidden))


def cycles(modules: list[str]) -> list[list[str]]:
    """Every import circle among `modules` (strongly connected groups of more than one, or a self import)."""
    inside = set(modules)
    edges = {m: sorted(imports_of(m) & inside) for m in modules}
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        order[v] = low[v] = len(order)
        stack.append(v)
        for w in edges[v]:
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
            if len(group) > 1 or v in edges[v]:
                found.append(sorted(group))

    for m in modules:
        if m not in order:
            visit(m)
    return found
