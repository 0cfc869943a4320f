"""A starting evaluation played once and read by every run that starts from the same policy.

A study's methods share one warm start per seed (``warmstart.share_as``), so their first evaluations play
the same weights on the same held-out tasks with the same sampling seeds: the same episodes. The first run
to evaluate its checkpoint 0 stores the tables here as well as in its own folder; the others read them.

    <data_dir>/<experiment>/shared-evals/<key>/{<kind>-turns,<kind>-episodes}.parquet, played_by.json

The key is a digest of the policy (``checkpoint.policy_digest``: weights and tokenizer, not the run's own
files) and of every setting that decides what an evaluation plays (``settings``). Two runs that differ in
any of them never share; a setting included needlessly only shares less.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pyarrow as pa

from horizonrl.store import StoreError, read_table, write_table

PLAYED_BY = "played_by.json"


def shared_dir(data_dir: str | Path, experiment: str, policy: str, settings: dict[str, Any]) -> Path:
    """The folder of the evaluation of ``policy`` (a ``policy_digest``) under ``settings`` (JSON values:
    the config sections and seeds that decide what is played)."""
    key = hashlib.sha256(json.dumps({"policy": policy, **settings}, sort_keys=True).encode()).hexdigest()[:20]
    return Path(data_dir) / experiment / "shared-evals" / key


def read_shared(folder: Path, kind: str) -> tuple[pa.Table, pa.Table, dict[str, Any]] | None:
    """(episodes, turns, who played them) of a ``kind`` evaluation stored in ``folder``; None if not stored
    whole (the episodes file is written last and marks it complete)."""
    try:
        episodes = read_table(folder / f"{kind}-episodes.parquet", "episodes")
        turns = read_table(folder / f"{kind}-turns.parquet", "turns")
        played_by = json.loads((folder / PLAYED_BY).read_text())
    except (StoreError, OSError, ValueError):
        return None
    return episodes, turns, played_by


def publish(folder: Path, kind: str, episodes: pa.Table, turns: pa.Table, played_by: dict[str, Any]) -> None:
    """Store a ``kind`` evaluation for the runs that start from the same policy: who played it first, then
    the turns, then the episodes (the mark that it is whole)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / PLAYED_BY).write_text(json.dumps(played_by, indent=1, sort_keys=True))
    write_table(turns, folder / f"{kind}-turns.parquet", "turns")
    write_table(episodes, folder / f"{kind}-episodes.parquet", "episodes")
