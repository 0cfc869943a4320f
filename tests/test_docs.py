"""The documentation against the code: docs/configuration.md against the typed config, the README as
a front door (short, linking every page), relative links that resolve, and no reference to files outside
the repository."""

from __future__ import annotations

import re
import subprocess
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from horizonrl.config import TrainConfig

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
CONFIG_PAGE = DOCS / "configuration.md"
README_MAX_LINES = 250

FIELD_TABLE_HEADER = "| field | type | default | meaning |"
SECTION_HEADING = re.compile(r"^## (?:`(?P<path>[^`]+)`|Top level) \((?P<cls>\w+)\)\s*$")


# ---------------------------------------------------------------------------------------------------
# the typed config: every section model reachable from TrainConfig, by its path in a YAML file


def _models_in(annotation: typing.Any) -> list[tuple[str, type[BaseModel]]]:
    """Section models inside a field's annotation, each with the path suffix it adds (``dict[str, X]``:
    ``.<name>``; ``X | None``: nothing)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [("", annotation)]
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is dict:
        return [(".<name>" + suffix, model) for suffix, model in _models_in(args[1])]
    return [found for arg in args for found in _models_in(arg)]


def config_sections(model: type[BaseModel] = TrainConfig, path: str = "") -> dict[str, type[BaseModel]]:
    """``{path: section model}``, recursively over pydantic's ``model_fields``; the top level is ``""``."""
    sections = {path: model}
    for name, field in model.model_fields.items():
        for suffix, sub in _models_in(field.annotation):
            sections.update(config_sections(sub, f"{path}.{name}{suffix}" if path else f"{name}{suffix}"))
    return sections


def render_default(value: typing.Any) -> str | None:
    """A default as the page writes it (YAML-like); None for a section (its own table says it)."""
    if isinstance(value, BaseModel):
        return None
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(str(render_default(v)) for v in value) + "]"
    if isinstance(value, dict):
        return "{}" if not value else repr(value)
    return repr(value) if isinstance(value, float) else str(value)


# ---------------------------------------------------------------------------------------------------
# the page: one "## `path` (Class)" heading per section, one field table under it


def _cells(row: str) -> list[str]:
    return [c.strip() for c in re.split(r"(?<!\\)\|", row.strip())[1:-1]]


def documented_sections(text: str) -> dict[str, tuple[str, dict[str, list[str]]]]:
    """``{path: (class name, {field: cells})}`` from the page's field tables."""
    out: dict[str, tuple[str, dict[str, list[str]]]] = {}
    current: str | None = None
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("## "):
            m = SECTION_HEADING.match(line)
            current = (m.group("path") or "") if m else None
            if m:
                assert current not in out, f"docs/configuration.md: section {current or 'Top level'!r} twice"
                out[current] = (m.group("cls"), {})
        elif line.strip() == FIELD_TABLE_HEADER:
            assert current is not None, f"docs/configuration.md line {i + 1}: a field table outside a config section"
            i += 2  # the header's separator row
            while i < len(lines) and lines[i].startswith("|"):
                cells = _cells(lines[i])
                name = cells[0].strip("`")
                assert name not in out[current][1], f"docs/configuration.md: {current}.{name} twice"
                out[current][1][name] = cells
                i += 1
            continue
        i += 1
    return out


def test_every_config_field_is_documented_under_its_section():
    documented = documented_sections(CONFIG_PAGE.read_text())
    sections = config_sections()
    problems = []
    for path, model in sections.items():
        label = path or "Top level"
        if path not in documented:
            problems.append(f"section {label} ({model.__name__}) has no '## ' heading with a field table")
            continue
        cls, fields = documented[path]
        if cls != model.__name__:
            problems.append(f"section {label}: heading names {cls}, the config has {model.__name__}")
        for name in model.model_fields:
            if name not in fields:
                problems.append(f"{label}: field {name!r} is not documented")
        for name in fields:
            if name not in model.model_fields:
                problems.append(f"{label}: documented field {name!r} is not in {model.__name__}")
    for path in documented:
        if path not in sections:
            problems.append(f"documented section {path!r} is not a section of TrainConfig")
    assert not problems, "docs/configuration.md against horizonrl.config:\n" + "\n".join(problems)


def test_documented_defaults_are_the_configs():
    documented = documented_sections(CONFIG_PAGE.read_text())
    problems = []
    for path, model in config_sections().items():
        fields = documented.get(path, ("", {}))[1]
        for name, field in model.model_fields.items():
            expected = render_default(field.default)
            if expected is None or name not in fields:
                continue
            cell = fields[name][2]
            if cell != f"`{expected}`":
                problems.append(f"{path or 'top level'}.{name}: page says {cell}, the config's default is `{expected}`")
    assert not problems, "docs/configuration.md defaults:\n" + "\n".join(problems)


# ---------------------------------------------------------------------------------------------------
# README and links


def test_readme_is_a_short_front_door_linking_every_page():
    text = README.read_text()
    assert len(text.splitlines()) < README_MAX_LINES, (
        f"README.md has {len(text.splitlines())} lines (< {README_MAX_LINES}): move detail into docs/"
    )
    linked = set(re.findall(r"\]\((docs/[^)#\s]+\.md)", text))
    missing = sorted(f"docs/{p.name}" for p in DOCS.glob("*.md") if f"docs/{p.name}" not in linked)
    assert not missing, f"README.md does not link {', '.join(missing)}"


def _pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def _without_code_blocks(text: str) -> str:
    return re.sub(r"```.*?```", "", text, flags=re.S)


def _anchors(page: Path) -> set[str]:
    """The page's heading anchors as GitHub makes them: lower case, punctuation dropped, spaces to
    hyphens, ``-1``, ``-2`` ... after repeats."""
    anchors: set[str] = set()
    repeats: dict[str, int] = {}
    for line in _without_code_blocks(page.read_text()).splitlines():
        m = re.match(r"^#{1,6} (.*)", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            anchors.add(f"{slug}-{repeats[slug]}" if slug in repeats else slug)
            repeats[slug] = repeats.get(slug, 0) + 1
    return anchors


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path):
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", _without_code_blocks(page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        linked = page.parent / path if path else page
        if not linked.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{page.relative_to(ROOT)}: broken links: {', '.join(broken)}"


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_pages_cite_the_repositorys_own_documents(page: Path):
    """The design documents outside the repository are not where a reader can follow: cite docs/."""
    found = re.findall(r"\b(?:ALGORITHMS|ARCHITECTURE|STACK)\.md\b", page.read_text())
    assert not found, (
        f"{page.relative_to(ROOT)} cites {', '.join(sorted(set(found)))}: cite docs/algorithms.md or "
        "docs/architecture.md"
    )


def test_no_tracked_file_points_outside_the_repository():
    outside = "../" + "shared"  # written in two parts, so this file does not match itself
    listed = (
        subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    )
    names = [
        n for n in listed if n and (n.endswith((".py", ".md", ".yaml", ".yml", ".toml")) or Path(n).name == "Makefile")
    ]
    assert names, "git ls-files listed no text files"
    hits = []
    for name in names:
        path = ROOT / name
        if not path.is_file():  # deleted in the work tree, not yet in the index
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if outside in line:
                hits.append(f"{name}:{number}: {line.strip()[:120]}")
    assert not hits, f"tracked files that reference {outside}:\n" + "\n".join(hits)


CITATION = re.compile(r"docs/algorithms\.md((?:[ ,]*§\d+(?:\.\d+)?(?:\s*[-–]\s*\d+(?:\.\d+)?)?)+)")


def algorithm_sections() -> set[str]:
    """Section numbers of docs/algorithms.md: ``## 1. LOOP`` gives "1", ``### 1.3 Advantage`` gives "1.3"."""
    text = (ROOT / "docs" / "algorithms.md").read_text()
    return set(re.findall(r"^#{2,3} (\d+(?:\.\d+)?)\.? ", text, flags=re.M))


def test_every_algorithm_citation_in_code_names_a_section_of_the_page():
    sections = algorithm_sections()
    assert {"0", "1", "1.3", "2", "3", "4"} <= sections, (
        f"docs/algorithms.md lost its numbered headings: {sorted(sections)}"
    )
    cited, missing = 0, []
    for path in ROOT.rglob("*.py"):
        if any(part.startswith(".venv") for part in path.parts):
            continue
        for m in CITATION.finditer(path.read_text()):
            for number in re.findall(r"\d+(?:\.\d+)?", m.group(1)):
                cited += 1
                if number not in sections:
                    missing.append(f"{path.relative_to(ROOT)}: §{number}")
    assert cited >= 40, f"only {cited} citations found: did the citation form change?"
    assert not missing, "citations without a heading in docs/algorithms.md:\n" + "\n".join(sorted(set(missing)))
