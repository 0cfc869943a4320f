"""A resumed run's settings against the ones it ran with: what may change, what must be allowed, and the
record of every change. MLflow cannot change a param once logged, so a run whose settings changed would
otherwise describe its first start forever; the record says which iteration each value took effect at and
where the current value lives.

The run folder's ``config.yaml`` holds the current config (what ``evaluate`` reloads); ``config-history.json``
beside it holds the config of the first start and every change after it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from horizonrl.config import CONFIG_FILE, TrainConfig, load_config
from horizonrl.files import write_json

HISTORY_FILE = "config-history.json"
CHANGES_TAG = "horizonrl.config_changes"  # one line: every change, its iteration, where current values live
CURRENT_TAG = "horizonrl.config."  # + field: the field's current value, where the param is the first start's

EXTENDING = ("iterations", "time_budget_s", "env_step_budget", "eval.every", "warmstart.epochs")
"""Fields whose change only extends or shortens the run (its length, budgets, evaluation cadence): the
iterations already trained stay what they were, so a resume takes them without being asked."""

UNSET = "(unset)"


class ConfigChangeRefused(ValueError):
    """A resume with changed settings that are not allowed; the message names each field, old and new."""


@dataclass(frozen=True)
class Change:
    field: str
    old: str
    new: str

    def __str__(self) -> str:
        return f"{self.field} {self.old} -> {self.new}"


def resume_changes(run_folder: str | Path, cfg: TrainConfig, allowed: Sequence[str] = ()) -> list[Change]:
    """The fields ``cfg`` changes against the config the run in ``run_folder`` last ran with (none for a new
    run). A change outside ``EXTENDING`` and not named in ``allowed`` (a field, or a section such as
    ``update``) raises ``ConfigChangeRefused`` naming every such field with its old and new value."""
    path = Path(run_folder) / CONFIG_FILE
    if not path.is_file():
        return []
    try:
        before = load_config(path, read_files=False)
    except ValueError as err:
        raise ConfigChangeRefused(
            f"run folder {run_folder}: its {CONFIG_FILE} no longer reads as a config ({' '.join(str(err).split())}), "
            "so a resume cannot be compared with it; move the folder away to start the run over"
        ) from err
    changes = config_changes(before, cfg)
    refused = [c for c in changes if not _covered(c.field, (*EXTENDING, *allowed))]
    if refused:
        flags = " ".join(f"--allow-change {c.field}" for c in refused)
        raise ConfigChangeRefused(
            f"run {cfg.run_name!r} resumes with changed settings: {'; '.join(map(str, refused))}; to train its "
            f"next iterations with them (recorded in {HISTORY_FILE} and MLflow) give {flags}, or use another run_name"
        )
    return changes


def check_allowed(cfg: TrainConfig, allowed: Sequence[str]) -> None:
    """Each ``--allow-change`` name is a field or a section of the config (``update.lr``, ``update``)."""
    fields = cfg.flat()
    for name in allowed:
        if not any(_covered(f, (name,)) for f in fields):
            raise ConfigChangeRefused(f"--allow-change {name}: not a field or section of the config")


def config_changes(before: TrainConfig, after: TrainConfig) -> list[Change]:
    """Every leaf field whose value differs, by its dotted name (an empty section counts as unset)."""
    old, new = _leaves(before), _leaves(after)
    return [
        Change(k, old.get(k, UNSET), new.get(k, UNSET))
        for k in sorted(old.keys() | new.keys())
        if old.get(k) != new.get(k)
    ]


def record(run_folder: str | Path, before: dict[str, Any], changes: list[Change], iteration: int) -> Path:
    """Add ``changes``, taking effect at ``iteration``, to the run folder's history (created with ``before``,
    the config of the run's first start, at its first change); returns the history file. An entry already
    there (a retried start) is not added twice."""
    path = Path(run_folder) / HISTORY_FILE
    history = json.loads(path.read_text()) if path.is_file() else {"first": before, "changes": []}
    new = [{"iteration": iteration, **asdict(c)} for c in changes]
    history["changes"] += [entry for entry in new if entry not in history["changes"]]
    write_json(history, path)
    return path


def current_config(run_folder: str | Path) -> dict[str, Any] | None:
    """The config the run last ran with (its ``config.yaml``, as read), or None for a new run."""
    path = Path(run_folder) / CONFIG_FILE
    return load_config(path, read_files=False).model_dump() if path.is_file() else None


def tags(history_file: Path) -> dict[str, str]:
    """MLflow tags for the history: each changed field's current value, and one line naming every change
    with its iteration and where current values live (the params hold the first start's)."""
    changes = json.loads(history_file.read_text())["changes"]
    latest = {c["field"]: c["new"] for c in changes}
    summary = "; ".join(f"iteration {c['iteration']}: {c['field']} {c['old']} -> {c['new']}" for c in changes)
    note = (
        f"{summary}. The params hold the first start's values; the current ones are the tags {CURRENT_TAG}<field> "
        f"and {CONFIG_FILE}, the history {HISTORY_FILE}"
    )
    return {CHANGES_TAG: note[:5000], **{CURRENT_TAG + k: v[:5000] for k, v in latest.items()}}


def _covered(field: str, names: Sequence[str]) -> bool:
    return any(field == n or field.startswith(n + ".") for n in names)


def _leaves(cfg: TrainConfig) -> dict[str, str]:
    return {k: v for k, v in cfg.flat().items() if v != "{}"}
