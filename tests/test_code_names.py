"""docs/architecture.md names what the code has: every module, class, function, constant and config field it
cites in backticks still exists (with the parameters a cited call shows), so a rename or a removal that
leaves the page behind fails here instead of misleading the next reader."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from collections import defaultdict
from functools import cache
from pathlib import Path

from pydantic import BaseModel

from horizonrl.config import TrainConfig

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "architecture.md"
CODE = ("horizonrl", "tasks", "flows", "methods", "horizonrl_stack", "benchmarks", "scripts")
TOP = (*CODE, "tests", "docs", "configs")
ALIASES = {"pd": "pandas", "np": "numpy"}
IDENTIFIER = r"[A-Za-z_]\w*"


class Index:
    """What the code defines, from its syntax trees: names of functions, classes and module-level constants;
    each class's attributes; each function's parameters; every string constant; module paths by stem."""

    def __init__(self) -> None:
        self.names: set[str] = set()
        self.attrs: dict[str, set[str]] = defaultdict(set)
        self.params: dict[str, list[set[str]]] = defaultdict(list)  # a class: its __init__
        self.strings: set[str] = set()
        self.modules: dict[str, set[str]] = defaultdict(set)
        self.files: set[str] = set()
        for top in CODE:
            for path in (ROOT / top).rglob("*.py"):
                self._read(path)

    def _read(self, path: Path) -> None:
        dotted = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        self.files.add(path.name)
        for i in range(1, dotted.count(".") + 2):
            self.modules[dotted.split(".")[i - 1]].add(".".join(dotted.split(".")[:i]))
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.names.add(node.name)
                self.params[node.name].append(_params(node))
            elif isinstance(node, ast.ClassDef):
                self.names.add(node.name)
                for item in node.body:
                    self.attrs[node.name] |= _defined(item)
                    if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                        self.params[node.name].append(_params(item))
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] not in CODE:
                self.names |= {alias.asname or alias.name for alias in node.names}  # another package's
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                self.strings.add(node.value)
        for item in tree.body:
            self.names |= _defined(item)


def _params(node: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """A function's parameter names; ``*`` when it takes any positional arguments (``*parts``)."""
    a = node.args
    return {p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)} | ({"*"} if a.vararg else set())


def _defined(node: ast.stmt) -> set[str]:
    """Names a statement of a module or class body defines."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
    return {t.id for t in targets if isinstance(t, ast.Name)}


@cache
def index() -> Index:
    return Index()


def config_path_exists(parts: list[str], model: type[BaseModel] = TrainConfig) -> bool:
    """``rollout.max_staleness``: a field path of the typed config (a section's fields, recursively)."""
    field = model.model_fields.get(parts[0])
    if field is None:
        return False
    if len(parts) == 1:
        return True
    sub = field.annotation
    return isinstance(sub, type) and issubclass(sub, BaseModel) and config_path_exists(parts[1:], sub)


def attribute_exists(parts: list[str]) -> bool:
    """``horizonrl.rollout.loop.split_shards``, ``checkpoint.resume_checkpoint``, ``ray.init``: the longest
    importable module prefix (a project module by its dotted path or its stem, or a package installed), then
    attributes of it."""
    first = ALIASES.get(parts[0], parts[0])
    candidates = sorted(index().modules.get(first, set()))
    if not candidates and importlib.util.find_spec(first) is not None:
        candidates = [first]
    for start in candidates:
        for n in range(len(parts), 0, -1):
            name = ".".join([start, *parts[1:n]])
            try:
                obj = importlib.import_module(name)
            except ImportError:
                continue
            try:
                for attr in parts[n:]:
                    obj = getattr(obj, attr)
            except AttributeError:
                break
            return True
    return False


def class_attribute_exists(parts: list[str]) -> bool:
    """``Learner.reference``, ``StepBatch.gap_tokens``: a class the code defines, with that attribute."""
    return parts[0] in index().attrs and all(p in index().attrs[parts[0]] for p in parts[1:2])


def problem(token: str) -> str | None:
    """Why a cited ``token`` names nothing the repository has, or None (also for what is not a code name:
    commands, metric names, values, file patterns)."""
    code = index()
    call = re.fullmatch(rf"({IDENTIFIER}(?:\.{IDENTIFIER})*)\(([^()]*)\)", token)
    name = call.group(1) if call else token
    if re.fullmatch(rf"(?:{'|'.join(TOP)})/[\w/.-]*", token):
        return None if (ROOT / token).exists() else "no such file or folder"
    if re.fullmatch(r"\w+\.py", token):
        return None if token in code.files else "no such module"
    if re.fullmatch(r"[\w-]+\.(?:yaml|md|toml)", token):
        return None if (ROOT / token).is_file() else "no such file"
    if not re.fullmatch(rf"{IDENTIFIER}(?:\.{IDENTIFIER})*", name):
        return None  # a command, a metric name, a pattern or a value
    parts = name.split(".")
    if len(parts) == 1 and not (call or "_" in name or name[0].isupper()):
        return None  # a plain word: a stage, a mode, a value
    found = (
        (len(parts) == 1 and name in code.names)
        or config_path_exists(parts)
        or class_attribute_exists(parts)
        or attribute_exists(parts)
        or name in code.strings  # a tag or a file name
        or (len(parts) == 2 and all(p in code.strings for p in parts))  # a table's column: ``episodes.error``
        or (len(parts) == 1 and any(name in ps for pss in code.params.values() for ps in pss))  # a parameter
    )
    if not found:
        return "names nothing the code defines"
    if call and call.group(2).strip():
        args = [a.strip().partition("=") for a in call.group(2).split(",")]
        wanted = {a for a, _, _ in args if re.fullmatch(IDENTIFIER, a)}
        if not any(wanted <= ps or "*" in ps for ps in code.params[parts[-1]]):
            return f"no function {parts[-1]} takes {sorted(wanted)}"
    return None


def cited(text: str) -> list[str]:
    """The backticked spans of a page, code blocks left out."""
    return sorted(set(re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))))


def test_architecture_names_what_the_code_has():
    tokens = cited(PAGE.read_text())
    checked = [t for t in tokens if re.search(r"[/_.A-Z(]", t)]
    assert len(checked) >= 100, f"only {len(checked)} names cited: did the page's form change?"
    bad = {t: why for t in tokens if (why := problem(t)) is not None}
    assert not bad, "docs/architecture.md cites what the code no longer has:\n" + "\n".join(
        f"  `{t}`: {why}" for t, why in sorted(bad.items())
    )


def test_the_check_tells_a_stale_name_from_a_live_one():
    """The checker itself: names that exist pass, renamed or removed ones fail."""
    live = [
        "horizonrl/run/owners.py",
        "horizonrl.rollout.loop.split_shards",
        "Learner.reference",
        "rollout.max_staleness",
        "checkpoint.resume_checkpoint",
        "play(shard)",
        "pd.factorize",
        "horizonrl.git_commits",
    ]
    stale = ["horizonrl/run/runtime.py", "PolicyRuntime", "Learner.trains", "rollout.no_such", "sync(cfg, policy)"]
    assert [t for t in live if problem(t) is not None] == []
    assert [t for t in stale if problem(t) is None] == []
