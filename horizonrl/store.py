"""The trajectory store: Parquet tables per iteration, written atomically, schema-versioned.

Layout: ``<data_dir>/<experiment>/<run_name>/iter=<n>/{episodes,turns,advantages-<method>}.parquet``
(and ``estimator_state-<method>.json`` for a stateful estimator); a credit audit's folder holds the same
tables of the groups it played, its continuations (episodes of kind ``audit``) and its decision points (table
kind ``audit``, ``horizonrl.audit``). The Arrow schemas below are the only
place a stored column's type is defined, and the ``*_table`` functions the only place tables are built. Rollout tables
are immutable once written; advantages are a separate table keyed by (rollout_id, turn), so several methods
can be computed over the same rollouts.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from horizonrl.engines.base import Generation
from horizonrl.envs.base import Task
from horizonrl.files import file_digest, remove_temporary, write_json
from horizonrl.rollout.records import EpisodeRecord, TurnRecord

SCHEMA_VERSION = "2"  # 2: turns carry policy_version
# The versions this code still reads, and the columns each lacks by kind: those are filled on reading with
# -1 (a version-1 turn's policy is its episode's ``policy_version``), so runs stored before resume and recompute.
_LACKS: dict[str, dict[str, tuple[str, ...]]] = {"1": {"turns": ("policy_version",)}, SCHEMA_VERSION: {}}
_META_VERSION = b"horizonrl.schema_version"
_META_TABLE = b"horizonrl.table"

EPISODES = pa.schema(
    [
        ("run_name", pa.string()),
        ("iteration", pa.int32()),
        ("policy_version", pa.int32()),
        ("rollout_id", pa.int64()),
        ("group_id", pa.int64()),
        ("task_id", pa.string()),
        ("env", pa.string()),
        ("split", pa.string()),
        ("tier", pa.string()),
        ("family", pa.string()),
        ("task_seed", pa.int64()),
        ("kind", pa.string()),
        ("parent_rollout", pa.int64()),
        ("branch_token", pa.int64()),
        ("branch_score", pa.float64()),
        ("context", pa.string()),
        ("sample_seed", pa.int64()),
        ("n_turns", pa.int32()),
        ("episode_return", pa.float64()),
        ("won", pa.bool_()),
        ("score", pa.float64()),
        ("n_invalid", pa.int32()),
        ("gen_tokens", pa.int64()),
        ("status", pa.string()),
        ("error", pa.string()),
    ]
)

TURNS = pa.schema(
    [
        ("policy_version", pa.int32()),
        ("rollout_id", pa.int64()),
        ("group_id", pa.int64()),
        ("turn", pa.int32()),
        ("observation", pa.string()),
        ("action", pa.string()),
        ("prompt_ids", pa.list_(pa.int32())),
        ("action_ids", pa.list_(pa.int32())),
        ("logprobs", pa.list_(pa.float32())),
        ("entropy", pa.list_(pa.float32())),
        ("policy_mask", pa.list_(pa.bool_())),
        ("allowed", pa.list_(pa.list_(pa.int32()))),
        ("finished", pa.bool_()),
        ("reward", pa.float64()),
        ("done", pa.bool_()),
        ("won", pa.bool_()),
        ("valid", pa.bool_()),
        ("format_valid", pa.bool_()),
        ("score", pa.float64()),
        ("progress_key", pa.string()),
        ("abstract_action", pa.string()),
        ("n_admissible", pa.int32()),
        ("gen_s", pa.float32()),
        ("env_s", pa.float32()),
    ]
)

ADVANTAGES = pa.schema(
    [
        ("rollout_id", pa.int64()),
        ("turn", pa.int32()),
        ("adv", pa.float64()),
        ("keep", pa.bool_()),
        ("adv_tokens", pa.list_(pa.float64())),
    ]
)

AUDIT = pa.schema(
    [
        ("point", pa.int32()),
        ("rollout_id", pa.int64()),
        ("group_id", pa.int64()),
        ("turn", pa.int32()),
        ("n_turns", pa.int32()),
        ("task_id", pa.string()),
        ("family", pa.string()),
        ("phase", pa.string()),  # early | middle | late: the turn's third of its episode
        ("anchor", pa.int64()),  # anchor state shared with another point that left it by another action; -1 none
        ("action", pa.string()),
        ("q_returns", pa.list_(pa.float64())),  # M returns from s_t with a_t fixed (NaN: failed); empty: not played
        ("v_returns", pa.list_(pa.float64())),  # M returns from s_t with a fresh action
        ("q_mc", pa.float64()),
        ("v_mc", pa.float64()),
        ("a_mc", pa.float64()),  # Q - V (docs/algorithms.md §8.2)
        ("se", pa.float64()),
        ("a_half1", pa.float64()),  # A_MC of each half of the continuations (the noise ceiling)
        ("a_half2", pa.float64()),
    ]
)
"""The credit audit's decision points and their Monte Carlo truth (``horizonrl.audit``), one row per point."""

_SCHEMAS = {"episodes": EPISODES, "turns": TURNS, "advantages": ADVANTAGES, "audit": AUDIT}


class StoreError(RuntimeError):
    """A stored file is missing, truncated or of another schema version; the message names the file."""


def iteration_dir(data_dir: str | Path, experiment: str, run_name: str, iteration: int) -> Path:
    return Path(data_dir) / experiment / run_name / f"iter={iteration:05d}"


def episodes_table(records: list[EpisodeRecord], run_name: str, iteration: int, policy_version: int) -> pa.Table:
    rows = {name: [] for name in EPISODES.names}
    for r in records:
        values = dict(
            run_name=run_name,
            iteration=iteration,
            policy_version=policy_version,
            rollout_id=r.rollout_id,
            group_id=r.group_id,
            task_id=r.task.task_id,
            env=r.task.env,
            split=r.task.split,
            tier=r.task.tier,
            family=r.task.family,
            task_seed=r.task.seed,
            kind=r.kind,
            parent_rollout=r.parent_rollout,
            branch_token=r.branch_token,
            branch_score=r.branch_score,
            context=r.context,
            sample_seed=r.sample_seed,
            n_turns=len(r.turns),
            episode_return=r.episode_return,
            won=r.won,
            score=r.turns[-1].score if r.turns else 0.0,
            n_invalid=sum(not t.valid for t in r.turns),
            gen_tokens=sum(len(t.gen.token_ids) for t in r.turns),
            status=r.status,
            error=r.error,
        )
        for k, v in values.items():
            rows[k].append(v)
    return pa.table(rows, schema=EPISODES)


def select_rollouts(table: pa.Table, rollout_ids: list[int]) -> pa.Table:
    """The rows of ``table`` (episodes, turns or advantages) whose ``rollout_id`` is one of ``rollout_ids``."""
    return table.filter(pc.is_in(table["rollout_id"], value_set=pa.array(rollout_ids, pa.int64())))


def turns_table(records: list[EpisodeRecord], policy_version: int = -1) -> pa.Table:
    """One row per turn. ``policy_version``: the checkpoint that played them, as in the episodes table (its
    sampling log-probs are ``logprobs``); -1 for tables built outside a run (tests, benchmarks)."""
    rows = {name: [] for name in TURNS.names}
    for r in records:
        for t in r.turns:
            g = t.gen
            values = dict(
                policy_version=policy_version,
                rollout_id=r.rollout_id,
                group_id=r.group_id,
                turn=t.turn,
                observation=t.observation,
                action=t.action,
                prompt_ids=t.prompt_ids,
                action_ids=g.token_ids,
                logprobs=g.logprobs,
                entropy=g.entropy,
                policy_mask=g.policy_mask,
                allowed=g.allowed,
                finished=g.finished,
                reward=t.reward,
                done=t.done,
                won=t.won,
                valid=t.valid,
                format_valid=t.format_valid,
                score=t.score,
                progress_key=t.progress_key,
                abstract_action=t.abstract_action,
                n_admissible=t.n_admissible,
                gen_s=t.gen_s,
                env_s=t.env_s,
            )
            for k, v in values.items():
                rows[k].append(v)
    return pa.table(rows, schema=TURNS)


def records(episodes: pa.Table, turns: pa.Table) -> list[EpisodeRecord]:
    """The records an episodes and a turns table were built from (``episodes_table``, ``turns_table``), in the
    episodes' order: what a stage that plays on from stored episodes needs (the credit audit's replays)."""
    by_rollout: dict[int, list[TurnRecord]] = {}
    for t in sorted(turns.to_pylist(), key=lambda row: (row["rollout_id"], row["turn"])):
        gen = Generation(t["action_ids"], t["logprobs"], t["entropy"], t["policy_mask"], t["allowed"], t["finished"])
        names = ("observation", "action", "prompt_ids", "reward", "done", "won", "valid", "format_valid", "score")
        rest = ("progress_key", "abstract_action", "n_admissible", "gen_s", "env_s")
        fields = {name: t[name] for name in (*names, *rest)}
        by_rollout.setdefault(t["rollout_id"], []).append(TurnRecord(turn=t["turn"], gen=gen, **fields))
    out = []
    for e in episodes.to_pylist():
        index = int(e["task_id"].rsplit("/", 1)[1])
        task = Task(e["env"], e["split"], e["tier"], index, e["task_seed"], e["family"])
        kept = ("kind", "parent_rollout", "branch_token", "status", "error", "branch_score")
        rec = EpisodeRecord(
            e["rollout_id"], e["group_id"], task, e["context"], e["sample_seed"], **{k: e[k] for k in kept}
        )
        rec.turns = by_rollout.get(e["rollout_id"], [])
        out.append(rec)
    return out


def advantages_table(
    rollout_id: np.ndarray,
    turn: np.ndarray,
    adv: np.ndarray,
    keep: np.ndarray,
    adv_tokens: np.ndarray | None = None,
    n_tokens: np.ndarray | None = None,
) -> pa.Table:
    """The advantages of N step rows, (N,) arrays, the rows of a trajectory contiguous and in turn order.

    Per-token advantages ``adv_tokens`` (M,) (row n owns ``n_tokens[n]`` of them, in row order) are
    stored once per trajectory: its tokens, all turns, as one list on its first row; other rows hold null.
    """
    n = len(rollout_id)
    if adv_tokens is None:
        tokens = pa.nulls(n, pa.list_(pa.float64()))
    else:
        ends = np.cumsum(n_tokens)  # (N,) token end of each row
        first = np.ones(n, dtype=bool)  # (N,) the row opens its trajectory
        first[1:] = rollout_id[1:] != rollout_id[:-1]
        last = np.ones(n, dtype=bool)  # (N,) the row closes its trajectory
        last[:-1] = first[1:]
        traj_end = ends[last][np.cumsum(first) - 1]  # (N,) token end of the row's trajectory
        # a first row's list spans its trajectory's tokens; the others are empty and masked as null
        offsets = np.append(np.where(first, ends - n_tokens, traj_end), ends[-1] if n else 0)  # (N + 1,)
        tokens = pa.ListArray.from_arrays(
            pa.array(offsets, pa.int32()), pa.array(adv_tokens, pa.float64()), mask=pa.array(~first)
        )
    return pa.table(
        {
            "rollout_id": rollout_id,
            "turn": np.asarray(turn, dtype=np.int32),
            "adv": adv,
            "keep": keep,
            "adv_tokens": tokens,
        },
        schema=ADVANTAGES,
    )


def audit_table(columns: dict[str, object]) -> pa.Table:
    """The credit audit's decision points (``AUDIT``'s columns, one entry per point)."""
    return pa.table(columns, schema=AUDIT)


def write_advantages(
    iteration_dir: str | Path, method: str, table: pa.Table, state: dict | None
) -> tuple[Path, str, Path | None]:
    """Write ``advantages-<method>.parquet`` and, for a stateful estimator, ``estimator_state-<method>.json``
    into an iteration's folder (other methods' files are left alone). Returns (table path, its digest, state path)."""
    d = Path(iteration_dir)
    path = d / f"advantages-{method}.parquet"
    digest = write_table(table, path, "advantages")
    state_path = None
    if state is not None:
        state_path = d / f"estimator_state-{method}.json"
        write_json(state, state_path)
    return path, digest, state_path


def write_table(table: pa.Table, path: str | Path, kind: str) -> str:
    """Write ``table`` to ``path`` atomically (temporary file, fsync, rename); return its sha256 digest."""
    schema = _SCHEMAS[kind]
    if not table.schema.equals(schema):
        raise StoreError(f"{path}: table does not match the {kind!r} schema")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    table = table.replace_schema_metadata({_META_VERSION: SCHEMA_VERSION.encode(), _META_TABLE: kind.encode()})
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        pq.write_table(table, tmp, compression="zstd")
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as err:  # pyarrow's message (e.g. on a full disk) does not name the file
        message = f"could not write {path}: {err.strerror or err}; the previous file, if any, is unchanged"
        raise (OSError(err.errno, message) if err.errno else OSError(message)) from err
    finally:
        remove_temporary(tmp)
    return file_digest(path)


def read_table(path: str | Path, kind: str, columns: list[str] | None = None) -> pa.Table:
    """Read a stored table, checking it is complete, of this schema version and has its kind's columns."""
    lacks = _check(path, kind)
    unknown = sorted(set(columns or []) - set(_SCHEMAS[kind].names))
    if unknown:
        raise StoreError(f"{path}: the {kind!r} table has no column {', '.join(unknown)}")
    wanted = columns or _SCHEMAS[kind].names
    try:
        table = pq.read_table(path, columns=[name for name in wanted if name not in lacks])
    except (pa.ArrowInvalid, OSError) as err:
        raise StoreError(f"{path}: not a readable Parquet file (truncated or corrupt): {err}") from err
    for name in (name for name in wanted if name in lacks):
        field = _SCHEMAS[kind].field(name)
        table = table.add_column(wanted.index(name), field, pa.array([-1] * table.num_rows, field.type))
    return table


def check_table(path: str | Path, kind: str) -> None:
    """Raise ``StoreError`` naming ``path`` unless it is a readable Parquet file of ``kind`` in a schema
    version this code reads, with exactly its kind's columns and types. Reads only the footer, so a command
    can check all its inputs before it writes anything."""
    _check(path, kind)


def _check(path: str | Path, kind: str) -> tuple[str, ...]:
    """``check_table``; returns the columns the file's schema version lacks (filled on reading)."""
    path = Path(path)
    if not path.is_file():
        raise StoreError(f"{path}: no such file")
    try:
        stored = pq.read_schema(path)
    except (pa.ArrowInvalid, OSError) as err:
        raise StoreError(f"{path}: not a readable Parquet file (truncated or corrupt): {err}") from err
    meta = stored.metadata or {}
    version = meta.get(_META_VERSION, b"?").decode()
    # checked before the columns, so a file of another kind is named as such, not as damaged
    if version not in _LACKS or meta.get(_META_TABLE, b"").decode() != kind:
        raise StoreError(
            f"{path}: schema version {version!r} of table {meta.get(_META_TABLE, b'?').decode()!r}; this code reads "
            f"versions {', '.join(map(repr, _LACKS))} of {kind!r}"
        )
    expected = _SCHEMAS[kind]
    lacks = _LACKS[version].get(kind, ())
    missing = [name for name in expected.names if name not in stored.names and name not in lacks]
    extra = [name for name in stored.names if name not in expected.names]
    retyped = [
        f"{f.name} ({stored.field(f.name).type}, expected {f.type})"
        for f in expected
        if f.name in stored.names and not stored.field(f.name).type.equals(f.type)
    ]
    for what, names in (
        ("lacks column", missing),
        ("has unknown column", extra),
        ("has a column of another type:", retyped),
    ):
        if names:
            raise StoreError(f"{path}: the {kind!r} table {what} {', '.join(names)}")
    return lacks


def env_steps(data_dir: str | Path, experiment: str, run_name: str, iterations: range) -> int:
    """Environment steps taken by the stored rollouts of ``iterations``: every episode's turns, APPO's
    branches included (a branch's turns copied from its parent were replayed in its environment)."""
    return sum(
        int(
            read_table(iteration_dir(data_dir, experiment, run_name, it) / "episodes.parquet", "episodes", ["n_turns"])[
                "n_turns"
            ]
            .to_numpy()
            .sum()
        )
        for it in iterations
    )


def remove_stale_temporaries(run_dir: str | Path) -> list[Path]:
    """Delete temporary files and folders (``.<name>.tmp-<pid>``) left by a writer that was killed.

    Call only when no other process writes this run (a run name is resumed by one process at a time).
    """
    removed = []
    for p in sorted(Path(run_dir).rglob(".*.tmp-*")):
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        removed.append(p)
    return removed
