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
from horizonrl.run.runlock import LOCK_FILE

HISTORY_FILE = "config-history.json"
CHANGES_TAG = "horizonrl.config_changes"  # one line: every change, its iteration, where current values live
CURRENT_TAG = "horizonrl.config."  # + field: the field's current value, where the param is the first start's

EXTENDING = ("iterations", "time_budget_s", "env_step_budget", "eval.every", "warmstart.epochs")
"""Fields whose change only extends or shortens the run (its length, budgets, evaluation cadence): the
iterations already trained stay what they were, so a resume takes them without being asked."""

UNSET = "(unset)"

FAILED_STARTS = "failed-starts"
"""Where a start that finished no iteration is moved when the run starts afresh with other settings."""


class ConfigChangeRefused(ValueError):
    """A resume with changed settings that are not allowed; the message names each field, old and new."""


@dataclass(frozen=True)
class Change:
    field: str
    old: str
    new: str

    def __str__(self) -> str:
        return f"{self.field} {self.old} -> {self.new}"


def resume_changes(
    run_folder: str | Path, cfg: TrainConfig, allowed: Sequence[str] = (), length: str = "iterations"
) -> list[Change]:
    """The fields ``cfg`` changes against the config the run in ``run_folder`` last ran with (none for a new
    run, and none for a start that finished no iteration: ``failed_start``). A change outside ``EXTENDING``
    and not named in ``allowed`` (a field, or a section such as ``update``) raises ``ConfigChangeRefused``
    naming every such field with its old and new value; so does a ``length`` (``iterations``, or a warm
    start's ``warmstart.epochs``) below the iterations the run has finished."""
    before = last_config(run_folder)
    if before is None:
        return []
    changes, done = config_changes(before, cfg), finished_iterations(run_folder)
    if _starts_afresh(changes, done):
        return []
    asked = int(cfg.flat()[length])
    if asked < done:
        raise ConfigChangeRefused(
            f"{length} = {asked}: run {cfg.run_name!r} has finished {done} already, and a run is not shortened below "
            f"what it trained; give {length} >= {done}, or another run_name (its checkpoint of any iteration can be "
            "evaluated with horizonrl evaluate --model <run folder>/checkpoints/iter=<n> --config <config>)"
        )
    refused = [c for c in changes if not _covered(c.field, (*EXTENDING, *allowed))]
    if refused:
        flags = " ".join(f"--allow-change {c.field}" for c in refused)
        raise ConfigChangeRefused(
            f"run {cfg.run_name!r} resumes with changed settings: {'; '.join(map(str, refused))}; to train its "
            f"next iterations with them (recorded in {HISTORY_FILE} and MLflow) give {flags}, or use another run_name"
        )
    return changes


def last_config(run_folder: str | Path) -> TrainConfig | None:
    """The config the run in ``run_folder`` last ran with (its ``config.yaml``), or None for a new run."""
    path = Path(run_folder) / CONFIG_FILE
    if not path.is_file():
        return None
    try:
        return load_config(path, read_files=False)
    except ValueError as err:
        raise ConfigChangeRefused(
            f"run folder {run_folder}: its {CONFIG_FILE} no longer reads as a config ({' '.join(str(err).split())}), "
            "so a resume cannot be compared with it; move the folder away to start the run over"
        ) from err


def finished_iterations(run_folder: str | Path) -> int:
    """The iterations (a warm start's epochs) the run in ``run_folder`` has finished: its newest checkpoint's."""
    from horizonrl.training.checkpoint import checkpoints

    found = checkpoints(Path(run_folder))
    return found[-1].iteration if found else 0


def failed_start(run_folder: str | Path, cfg: TrainConfig) -> list[Change]:
    """The settings ``cfg`` changes against a start of the run that finished no iteration (it failed in its
    start or first iteration), or [] (a new run, a run with a finished iteration, or the same settings, or
    only ``EXTENDING`` ones, which resume as they are). Such a start is not a resume: the changed run starts
    afresh (``set_aside``)."""
    before = last_config(run_folder)
    if before is None:
        return []
    changes = config_changes(before, cfg)
    return changes if _starts_afresh(changes, finished_iterations(run_folder)) else []


def _starts_afresh(changes: list[Change], done: int) -> bool:
    """A start that finished no iteration, run again with settings beyond ``EXTENDING`` changed: not a resume."""
    return not done and any(not _covered(c.field, EXTENDING) for c in changes)


def set_aside(run_folder: str | Path) -> Path:
    """Move everything of a failed start in ``run_folder`` (but the lock, held by the caller, and earlier
    failed starts) into ``failed-starts/<n>/`` there, nothing deleted; returns that folder. Call under the
    run's lock."""
    run_folder = Path(run_folder)
    aside = run_folder / FAILED_STARTS
    n = 1 + max((int(p.name) for p in aside.glob("*") if p.name.isdigit()), default=0)
    dest = aside / str(n)
    dest.mkdir(parents=True)
    for p in sorted(run_folder.iterdir()):
        if p.name not in (LOCK_FILE, FAILED_STARTS):
            p.rename(dest / p.name)
    return dest


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
    before = last_config(run_folder)
    return None if before is None else before.model_dump()


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
