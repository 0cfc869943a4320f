"""The shape docs/architecture.md promises, read off the syntax trees: the whole config stops where a run's
owners are built, no owner's method takes it, flows only orchestrate (no MLflow of their own, no
asynchronous bookkeeping), tasks are a few lines, and the command line is a table of short subcommands."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG_BOUND = 0
"""Library functions below the construction point that may still take TrainConfig: 4 before issue 50
(``update_policy``, ``turn_horizon``, ``iteration_shards``, ``collect_seed``), at most 2 asked, none now; raise
it only with a reason."""
TASK_LINES = 40
MAIN_LINES = 60


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _functions(tree: ast.AST):
    return (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))


def _takes_config(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    a = node.args
    return any(p.annotation is not None and "TrainConfig" in ast.unparse(p.annotation) for p in
               (*a.posonlyargs, *a.args, *a.kwonlyargs))  # fmt: skip


def _code_lines(node: ast.AST, source: list[str]) -> int:
    """Lines of a function's body that hold code: its docstring, blank lines and comments left out."""
    body = node.body[1:] if ast.get_docstring(node) is not None else node.body
    lines = range(body[0].lineno, node.end_lineno + 1) if body else range(0)
    return sum(1 for i in lines if source[i - 1].strip() and not source[i - 1].strip().startswith("#"))


def config_takers(root: Path = ROOT / "horizonrl") -> list[str]:
    """Functions of the library outside ``config/`` and ``run/`` with a parameter annotated ``TrainConfig``,
    ``*from_config`` constructors left out: ``path:line name``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).parts[0] in ("config", "run"):
            continue
        for node in _functions(_tree(path)):
            if _takes_config(node) and not node.name.endswith("from_config"):
                found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name}")
    return found


def test_below_the_construction_point_nothing_takes_the_whole_config():
    """The whole config goes to ``config/``, the construction point and the checks in ``run/``, and the flows
    and tasks; the library below takes its own section or plain values (``*from_config`` builds them)."""
    found = config_takers()
    assert len(found) <= CONFIG_BOUND, "library functions that take the whole TrainConfig:\n" + "\n".join(found)


def test_the_walk_finds_a_function_that_takes_the_config(tmp_path):
    """The walk itself: an annotated parameter is found (also as a string or an optional), a constructor
    named ``*from_config`` is not."""
    (tmp_path / "rollout").mkdir()
    (tmp_path / "rollout" / "x.py").write_text(
        "def a(cfg: TrainConfig): ...\n"
        "def b(x: int, *, cfg: 'TrainConfig | None' = None): ...\n"
        "class S:\n    @classmethod\n    def from_config(cls, cfg: TrainConfig): ...\n"
        "def c(env: EnvConfig): ...\n"
    )
    assert [f.rsplit(" ", 1)[1] for f in config_takers(tmp_path)] == ["a", "b"]


def test_no_owner_method_takes_the_config_or_keys_a_cache_by_it():
    """After construction the owners take checkpoints, shards and rows: none of their methods has a config
    parameter, and none reads a config (no ``cfg`` name, no ``.digest()`` key)."""
    for name in ("learner.py", "player.py", "cluster.py"):
        for cls in (n for n in ast.walk(_tree(ROOT / "horizonrl" / "run" / name)) if isinstance(n, ast.ClassDef)):
            for method in _functions(cls):
                where = f"{name}: {cls.name}.{method.name}"
                assert not _takes_config(method), where
                names = {n.id for n in ast.walk(method) if isinstance(n, ast.Name)}
                attrs = {n.attr for n in ast.walk(method) if isinstance(n, ast.Attribute)}
                assert "cfg" not in names and "digest" not in attrs, where


def test_flows_hold_no_mlflow_calls_and_no_asynchronous_bookkeeping():
    """Every MLflow read and write of a flow is a task's; the train flow's asynchronous schedule is the
    library's (``AsyncSchedule``) driven by the tasks layer (``Collects``)."""
    for path in sorted((ROOT / "flows").glob("*.py")):
        tree = _tree(path)
        imported = {
            alias.name if isinstance(node, ast.Import) else f"{node.module}.{alias.name}"
            for node in ast.walk(tree)
            if isinstance(node, (ast.Import, ast.ImportFrom))
            for alias in node.names
        }
        assert not {m for m in imported if m.split(".")[0] == "mlflow" or m.endswith(("client", "_runs"))}, path
        calls = {ast.unparse(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
        mlflow = {c for c in calls if c.endswith(".mlflow") or "client" in c.lower() or "mlflow" in c}
        assert not mlflow, f"{path.name}: {mlflow}"
    train = _tree(ROOT / "flows" / "train.py")
    assert not [n for n in ast.walk(train) if isinstance(n, ast.ClassDef)], "a class in the train flow"
    used = {ast.unparse(n) for n in ast.walk(train) if isinstance(n, (ast.Attribute, ast.Name))}
    assert not used & {"time.time", "PrefectFuture", "submit", "wait_for"}, used & {"time.time", "submit"}


def test_tasks_are_a_few_lines_and_the_command_line_a_table():
    """No Prefect task is longer than ``TASK_LINES`` code lines; ``flows/cli.py:main`` is at most
    ``MAIN_LINES`` lines, and every subcommand runs through its table."""
    long = []
    for path in sorted((ROOT / "tasks").glob("*.py")):
        source = path.read_text().splitlines()
        for node in _functions(_tree(path)):
            is_task = any("task" in ast.unparse(d).split("(")[0] for d in node.decorator_list)
            if is_task and _code_lines(node, source) > TASK_LINES:
                long.append(f"{path.name}:{node.name} ({_code_lines(node, source)} lines)")
    assert not long, "tasks over the limit: " + ", ".join(long)
    cli = _tree(ROOT / "flows" / "cli.py")
    main = next(n for n in _functions(cli) if n.name == "main")
    assert main.end_lineno - main.lineno + 1 <= MAIN_LINES
    from flows.cli import COMMANDS

    assert len(COMMANDS) >= 10 and all(callable(c.run) and callable(c.arguments) for c in COMMANDS.values())
