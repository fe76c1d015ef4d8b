"""Issue 36: no import circles between cfrun's modules, and no lower floor importing a higher
one (DESIGN §3: the torch-free contract at the bottom, the codec above it, the processes'
packages on top). Read from the source (every ``import`` and ``from ... import``, at module
level or inside a function), so a lazy import cannot hide a circle."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "cfrun"
FLOOR = {"contract": 0, "policy": 0, "storage": 1, "codec": 1, "peer": 2, "agent": 2,
         "rank": 2, "supervisor": 3, "cli": 4}
"""A package may import packages on its own floor or below (``entry``/``__main__`` aside)."""


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _graph() -> dict[str, set[str]]:
    modules = {_module(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                    + ([base] if base else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            for name in names:
                while name and name not in modules:
                    name = name.rsplit(".", 1)[0] if "." in name else ""
                if name and name != mod and name.startswith("cfrun"):
                    graph[mod].add(name)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if n.startswith(m + ".") or m.startswith(n + "."):
                continue  # a package and its own modules
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_no_import_circles():
    assert _cycle(_graph()) is None, " -> ".join(_cycle(_graph()) or [])


def test_no_lower_floor_imports_a_higher_one():
    bad = []
    for mod, deps in _graph().items():
        floor = FLOOR.get(mod.split(".")[1] if "." in mod else "")
        if floor is None:
            continue
        for dep in deps:
            dep_floor = FLOOR.get(dep.split(".")[1] if "." in dep else "")
            if dep_floor is not None and dep_floor > floor:
                bad.append(f"{mod} -> {dep}")
    assert not bad, bad
