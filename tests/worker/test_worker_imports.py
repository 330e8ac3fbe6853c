"""The worker's packages import each other one way (issue 60): ``numerics`` (FP8 constants, integer helpers) is a
leaf; ``kernels`` (our kernels, the per-shape choices, the kernel sets of ``kernels/ops.py``) imports nothing of
``quant`` or ``models``; ``quant`` nothing of ``models``; and the start-up checks and tunings that need all three
live above them (``startup.py``). Counted with every import — inside functions and under ``TYPE_CHECKING`` too:
a lazy import is still a dependency, and a circle of them works only by the order things run in."""

from __future__ import annotations

from tests.shared.test_imports import graph

WORKER = "services.worker."


def unit(module: str) -> str:
    """A worker module's package (``kernels``, ``quant``, ``models``, ``attention``, ``sampling``) or, for a module
    at the top of the worker, itself."""
    return module.removeprefix(WORKER).split(".")[0]


def unit_graph() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for m, deps in graph().items():
        if m.startswith(WORKER):
            out.setdefault(unit(m), set()).update(unit(d) for d in deps if d.startswith(WORKER) and unit(d) != unit(m))
    return out


def test_numerics_is_a_leaf() -> None:
    deps = graph()["services.worker.numerics"]
    assert not {d for d in deps if d.startswith("services.")}, deps


def test_kernels_import_neither_quant_nor_models_and_quant_not_models() -> None:
    g = unit_graph()
    assert not g["kernels"] & {"quant", "models", "startup", "runner"}, g["kernels"]
    assert not g["quant"] & {"models", "startup", "runner"}, g["quant"]
    assert "kernels" in g["quant"] and "kernels" in g["models"]  # (the direction the dependency runs)


def test_no_circle_between_the_workers_packages_and_modules() -> None:
    g = unit_graph()
    state: dict[str, int] = {}
    circles: list[list[str]] = []

    def visit(u: str, path: list[str]) -> None:
        state[u] = 1
        for v in sorted(g.get(u, ())):
            if state.get(v) == 1:
                circles.append(path[path.index(v):] + [u, v] if v in path else [u, v])
            elif v not in state:
                visit(v, path + [u])
        state[u] = 2

    for u in sorted(g):
        if u not in state:
            visit(u, [])
    assert not circles, "circles between the worker's packages: " + "; ".join(" -> ".join(c) for c in circles)
