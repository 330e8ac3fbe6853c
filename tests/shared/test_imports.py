"""The import structure the architecture promises: services never import each other, ``shared/``
imports no service and nothing of ``banyan/``, and no import circle inside ``services/`` or ``shared/``
(imports under ``if TYPE_CHECKING:`` and inside functions count too)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("services", "shared")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """Every module ``path`` imports (absolute names; relative imports resolved)."""
    tree = ast.parse(path.read_text(), str(path))
    pkg = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)  # (``from pkg import module``)
    return out


def graph() -> dict[str, set[str]]:
    mods = {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py") if "proto" not in p.parts}
    return {m: {i for i in imports_of(p) if i in mods and i != m} for m, p in mods.items()}


def test_services_never_import_each_other_and_shared_imports_neither_services_nor_banyan():
    bad = []
    for pkg in PACKAGES:
        for p in (ROOT / pkg).rglob("*.py"):
            me = module_name(p)
            for imp in imports_of(p):
                top = imp.split(".")
                if me.startswith("shared") and top[0] in ("services", "banyan"):
                    bad.append(f"{me} imports {imp}")
                if me.startswith("services.") and top[0] == "banyan":
                    bad.append(f"{me} imports {imp}")
                if me.startswith("services.") and top[0] == "services" and len(top) > 1 and \
                        top[1] != me.split(".")[1]:
                    bad.append(f"{me} imports {imp}")
    assert not bad, "\n".join(bad)


def test_no_import_circle_in_services_or_shared():
    g = graph()
    # a module imported from a package counts as importing the package's __init__ too (it runs first)
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(g.get(m, ())):
            if state.get(n) == 1:
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m)
    # a package importing its own submodules (``__init__`` re-exports) is not a circle of modules
    real = [c for c in cycles if not any(a.startswith(b + ".") or b.startswith(a + ".") for a, b in zip(c, c[1:]))]
    assert not real, "import circles:\n" + "\n".join(" -> ".join(c) for c in real)
