"""The import rules docs/architecture.md states, checked on the source: one-way layers and no import circle.

Every import counts, deferred ones too (an import inside a function is still a dependency)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("flows", "tasks", "methods", "horizonrl", "horizonrl_stack")

# The library's parts, lowest first: a part imports only parts at or below its own rank.
LIBRARY_RANKS = [
    ("horizonrl.seeding", "horizonrl.faults", "horizonrl.files"),
    ("horizonrl.envs",),
    ("horizonrl.config",),
    ("horizonrl.models",),
    ("horizonrl.engines",),
    ("horizonrl.rollout",),
    ("horizonrl.store", "horizonrl.shared_eval"),
    ("horizonrl.training",),
    ("horizonrl.tracking",),
    ("horizonrl.run",),
    ("horizonrl.audit",),
]
# Top-level layers: flows -> tasks -> library and methods; methods import nothing of ours.
ALLOWED = {
    "flows": {"flows", "tasks", "horizonrl", "methods", "horizonrl_stack"},
    "tasks": {"tasks", "horizonrl", "methods"},
    "horizonrl": {"horizonrl", "methods"},
    "methods": {"methods"},
    "horizonrl_stack": {"horizonrl_stack", "horizonrl"},
}
FORBIDDEN_THIRD_PARTY = {"methods": {"prefect", "mlflow", "pyarrow", "transformers"}, "horizonrl": {"prefect"}}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")}


def imports_of(path: Path, known: set[str]) -> set[str]:
    """Modules of ours (and top-level third-party names) that ``path`` imports, resolved to the longest
    known module: ``from horizonrl.tracking import report`` is an import of ``horizonrl.tracking.report``."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        else:
            continue
        for name in names:
            while name and name not in known and "." in name:
                name = name.rsplit(".", 1)[0]
            out.add(name)
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {m: imports_of(p, known) - {m} for m, p in mods.items()}


def library_rank(module: str) -> int | None:
    for rank, prefixes in enumerate(LIBRARY_RANKS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return rank
    return None


def test_every_library_module_has_a_rank():
    unranked = [m for m in modules() if m.startswith("horizonrl.") and library_rank(m) is None]
    assert not unranked, f"library modules outside LIBRARY_RANKS (add them to a layer): {unranked}"


def test_layers_point_down_only():
    bad = []
    for m, deps in graph().items():
        top = m.split(".")[0]
        for d in deps:
            dtop = d.split(".")[0]
            if dtop in ALLOWED and dtop not in ALLOWED[top]:
                bad.append(f"{m} imports {d}")
            if dtop in FORBIDDEN_THIRD_PARTY.get(top, set()):
                bad.append(f"{m} imports {d}")
            rm, rd = library_rank(m), library_rank(d)
            if rm is not None and rd is not None and rd > rm:
                bad.append(f"{m} (rank {rm}) imports {d} (rank {rd})")
    assert not bad, "imports against the layers of docs/architecture.md:\n" + "\n".join(sorted(bad))


def test_no_import_circle():
    g = {m: {d for d in deps if d in modules()} for m, deps in graph().items()}
    circles, state = [], {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = "open"
        for d in sorted(g[m]):
            if state.get(d) == "open":
                circles.append(path[path.index(d) :] + [d] if d in path else [m, d])
            elif d not in state:
                visit(d, path + [d])
        state[m] = "done"

    for m in sorted(g):
        if m not in state:
            visit(m, [m])
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)
