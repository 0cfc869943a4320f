"""Every hand-written list of the methods against the registry of presets (``methods.presets.METHODS``):
the README's sentence and table, docs/configuration.md's ``method`` field, the CLI's help and
pyproject.toml's description. A method added to the presets fails here until each list names it."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from flows.cli import main
from methods.presets import METHODS

ROOT = Path(__file__).resolve().parent.parent
NUMBERS = {"six": 6, "seven": 7, "eight": 8, "nine": 9, "ten": 10, "eleven": 11, "twelve": 12}
NAMES = sorted(METHODS)
TITLES = sorted(preset.title for preset in METHODS.values())


def _flat(text: str) -> str:
    """``text`` with every run of whitespace as one space (wrapped lines read as one)."""
    return " ".join(text.split())


def _items(listed: str) -> list[str]:
    """The comma-separated names of a list, backticks dropped, sorted (a name listed twice stays twice)."""
    return sorted(item.strip().strip("`") for item in listed.split(","))


def test_readme_sentence_names_every_method_by_its_title_and_counts_them():
    found = re.search(r"(\w+) methods \(([^)]*)\)", _flat((ROOT / "README.md").read_text()))
    assert found, "README.md: the sentence '<N> methods (...)' is gone"
    assert _items(found.group(2)) == TITLES
    assert NUMBERS[found.group(1).lower()] == len(METHODS)


def test_readme_methods_table_has_one_row_per_method():
    text = (ROOT / "README.md").read_text()
    table = text.split("| `method` | advantage | loss (preset) |", 1)[1].split("\n\n", 1)[0]
    rows = re.findall(r"^\| `([a-z_]+)` \|", table, flags=re.M)
    assert sorted(rows) == NAMES


def test_configuration_page_lists_every_method_for_the_method_field():
    text = (ROOT / "docs" / "configuration.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `method` |"))
    found = re.search(r"The method preset: ([^(]*) \(", row)
    assert found, "docs/configuration.md: the method field's row no longer lists the presets"
    assert _items(found.group(1)) == NAMES


def test_cli_help_lists_every_method(capsys):
    with pytest.raises(SystemExit):
        main(["recompute", "--help"])
    found = re.search(r"--method METHOD method \(([^)]*)\) or estimator name", _flat(capsys.readouterr().out))
    assert found, "horizonrl recompute --help no longer lists the methods"
    assert _items(found.group(1)) == NAMES


def test_pyproject_description_names_every_method_by_its_title():
    description = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["description"]
    found = re.search(r"\(([^)]*)\)$", description)
    assert found, "pyproject.toml: the description no longer ends with the methods in parentheses"
    assert _items(found.group(1)) == TITLES
