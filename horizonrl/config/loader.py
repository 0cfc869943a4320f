"""Reading a run's config: a YAML file (safe loader, YAML 1.2 floats) plus ``--set key.sub=value`` overrides,
validated into the typed ``TrainConfig`` (``horizonrl.config.schema``)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from horizonrl.config.problems import ConfigError, key_lines, validation_lines, yaml_line
from horizonrl.config.schema import TrainConfig

CONFIG_FILE = "config.yaml"  # a run's config as it ran: in its data folder and among its MLflow artifacts


def _set_path(d: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = d
    for p in parts[:-1]:
        if node.get(p) is None:  # absent, or an empty section in the file
            node[p] = {}
        node = node[p]
        if not isinstance(node, dict):
            raise ConfigError([f"config: --set {dotted}: {p!r} is not a section"])
    node[parts[-1]] = value


class _YAMLLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that also reads ``3e-4`` and ``1.0e5`` as floats (YAML 1.2). PyYAML follows
    YAML 1.1, where they are strings, and an untyped field (``loss_params``) would keep the string."""


_YAMLLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789")
)


def _parse_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_YAMLLoader)  # noqa: S506 (a SafeLoader subclass)


def train_config(
    config_path: str | None, overrides: list[str] | None, config: dict[str, Any] | None, read_files: bool = True
) -> TrainConfig:
    """The train flow's config from its parameters: a whole ``config`` dict, else a file plus overrides."""
    if config is not None:
        return validated(config, read_files)
    return load_config(config_path, overrides, read_files)


def validated(raw: dict[str, Any], read_files: bool = True, where: dict[str, str] | None = None) -> TrainConfig:
    """``raw`` validated into a ``TrainConfig``; its problems raised as one ``ConfigError``, a line per field,
    each naming where its value came from (``where``: dotted key -> ``in config.yaml line 3``, ``from --set``)."""
    try:
        return TrainConfig.model_validate(raw, context={"read_files": read_files})
    except ValidationError as err:
        raise ConfigError(validation_lines(err, TrainConfig, (where or {}).get)) from err


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None, read_files: bool = True
) -> TrainConfig:
    """Read a YAML file (safe loader, YAML 1.2 floats), apply ``key.sub=value`` overrides, validate.

    Raises ``ConfigError`` (a ``ValueError``), one ``config: ...`` line per problem naming the field, its
    value and the file's line or the ``--set`` it came from. ``read_files=False`` leaves out the checks
    that open files beyond the config itself (every game of ``env.games``): a failure hook only needs the
    run's names, and must not fail again on the file that failed the run.
    """
    raw: dict[str, Any] = {}
    where: dict[str, str] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError([f"config: file {str(p)!r} does not exist"])
        text = p.read_text()
        try:
            raw = _parse_yaml(text) or {}
        except yaml.YAMLError as err:
            raise ConfigError([yaml_line(f"file {str(p)!r}", err)]) from err
        if not isinstance(raw, dict):
            raise ConfigError([f"config: file {str(p)!r} must hold a mapping at the top level"])
        where = {key: f"in {p} line {n}" for key, n in key_lines(text).items()}
    apply_overrides(raw, overrides or [])
    where.update(dict.fromkeys(override_keys(overrides or []), "from --set"))
    return validated(raw, read_files, where)


def override_keys(overrides: list[str]) -> list[str]:
    """The dotted keys of ``key=value`` overrides; one without ``=`` or with an empty part is a
    ``ValueError`` naming it."""
    keys = []
    for item in overrides:
        key, eq, _ = item.partition("=")
        if not eq or not all(key.strip().split(".")):
            raise ConfigError([f"config: --set {item!r}: expected key=value"])
        keys.append(key.strip())
    return keys


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set each ``key.sub=value`` of ``overrides`` in the raw config ``raw`` (values read as YAML, safe
    loader); returns ``raw``. Errors name the override."""
    for item, key in zip(overrides, override_keys(overrides)):
        text = item.partition("=")[2]
        try:
            value = _parse_yaml(text)
        except yaml.YAMLError as err:
            raise ConfigError([yaml_line(f"--set {item!r}", err)]) from err
        _set_path(raw, key, value)
    return raw
