"""A config's problems as one line each: ``config: <field> <problem> (got <value>)``.

pydantic prints a validation error in three to five lines ending with a documentation URL, and a check
across fields with a dump of the whole input; PyYAML ends a syntax error with a ``^`` under its column.
A user reads one line per field instead, naming where the value came from (the file and line, or the
``--set``) where that is known.
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Callable
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

NO_VALUE: Any = object()
"""``FieldProblem``'s value when the problem is not one value's (a section's, or several fields')."""

SHOWN_CHARS = 200
"""A value longer than this is cut in the line (a whole section given where a number belongs; a path is
shorter)."""


class FieldProblem(ValueError):
    """What the config's own checks raise: the dotted ``field``, the ``problem`` (a phrase that follows the
    field's name) and the ``value`` it has. pydantic keeps the exception, so the line is built from it."""

    def __init__(self, field: str, problem: str, value: Any = NO_VALUE) -> None:
        self.field, self.problem, self.value = field, problem, value
        super().__init__(line(field, problem, value))


class ConfigError(ValueError):
    """Every problem of one config, a ``config: ...`` line each (``lines``); its message is those lines."""

    def __init__(self, lines: list[str]) -> None:
        self.lines = lines
        super().__init__("\n".join(lines))


def line(field: str, problem: str, value: Any = NO_VALUE, where: str | None = None) -> str:
    """``<field> <problem> (got <value> <where>)``, the parenthesis only with what is known; ``where`` is a
    phrase such as ``in config.yaml line 3`` or ``from --set``."""
    notes = ([f"got {shown(value)}"] if value is not NO_VALUE else []) + ([where] if where else [])
    return f"{field} {problem}" + (f" ({' '.join(notes)})" if notes else "")


def shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."


def validation_lines(
    err: ValidationError, model: type[BaseModel], where: Callable[[str], str | None] = lambda field: None
) -> list[str]:
    """One ``config: ...`` line per error of ``err`` (raised validating ``model``); ``where(field)`` says
    where a field's value came from (``config.yaml line 3``, ``--set update.lr=-1``), or None."""
    out = []
    for e in err.errors(include_url=False):
        cause = (e.get("ctx") or {}).get("error")
        if isinstance(cause, FieldProblem):
            field, problem, value = cause.field, cause.problem, cause.value
        elif not e["loc"]:  # a check across fields that raised a plain ValueError: its message names them
            out += [f"config: {text}" for text in _message(e).splitlines() if text.strip()]
            continue
        else:
            field, value = ".".join(map(str, e["loc"])), e["input"]
            problem = _phrase(e, model)
        out.append("config: " + line(field, problem, value, where(field)))
    return out


def _message(e: dict[str, Any]) -> str:
    return e["msg"].removeprefix("Value error, ")


def _phrase(e: dict[str, Any], model: type[BaseModel]) -> str:
    """pydantic's message for one field as a phrase after the field's name."""
    if e["type"] == "extra_forbidden":
        *section, key = map(str, e["loc"])
        known = _field_names(model, section)
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.7)
        hint = f"; did you mean {close[0]!r}?" if close else f"; fields there: {', '.join(known)}" if known else ""
        return f"is not a field of {'.'.join(section) or 'the config'}{hint}"
    if e["type"] == "model_type":
        return "must be a section (a mapping of its fields)"
    text = _message(e)
    if text.startswith("Input should be "):
        return "must be " + text.removeprefix("Input should be ")
    return text[:1].lower() + text[1:]


def _field_names(model: type[BaseModel], path: list[str]) -> list[str]:
    """The field names of the section at ``path`` of ``model`` (a dict's keys skipped), or [] if it is none."""
    node: Any = model
    parts = iter(path)
    for part in parts:
        if not (isinstance(node, type) and issubclass(node, BaseModel)) or part not in node.model_fields:
            return []
        node = _section(node.model_fields[part].annotation)
        if typing.get_origin(node) is dict:  # per_method.<name>: the next part is a key, then the values' type
            node = _section(typing.get_args(node)[1]) if next(parts, None) is not None else None
    return sorted(node.model_fields) if isinstance(node, type) and issubclass(node, BaseModel) else []


def _section(annotation: Any) -> Any:
    """``X`` of ``X | None``; anything else as it is."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        kinds = [a for a in typing.get_args(annotation) if a is not type(None)]
        return kinds[0] if len(kinds) == 1 else annotation
    return annotation


def yaml_line(source: str, err: yaml.YAMLError) -> str:
    """A YAML syntax error as one line: ``config: <source> line L, column C: <problem>`` (PyYAML's own
    message repeats the text with a ``^`` under the column)."""
    mark = getattr(err, "problem_mark", None)
    at = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    context = getattr(err, "context", None)
    return f"config: {source}{at}: {problem}" + (f" ({context})" if context else "")


def key_lines(text: str) -> dict[str, int]:
    """Each dotted key of a YAML mapping's text with the line (1-based) its value starts on; the YAML
    parser's positions, so a field's problem can name its line. Empty for text that is not a mapping."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return {}
    out: dict[str, int] = {}

    def walk(node: yaml.Node, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                name = f"{prefix}{key.value}"
                out[name] = value.start_mark.line + 1
                walk(value, name + ".")

    if root is not None:
        walk(root, "")
    return out
