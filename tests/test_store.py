"""Store: exact round trips of the three tables, schema-version and kind checks, atomic writes."""

from __future__ import annotations

import hashlib
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from horizonrl import store
from horizonrl.engines.base import Generation
from horizonrl.envs.base import Task
from horizonrl.rollout.records import EpisodeRecord, TurnRecord
from horizonrl.store import ADVANTAGES, EPISODES, TURNS, StoreError, read_table, write_table

TASK = Task("household", "train", "easy", 7, 2**62 + 3, "pick_and_place")


def _turn(
    turn: int, action: str, ids: list[int], *, valid: bool = True, reward: float = 0.0, won: bool = False
) -> TurnRecord:
    """A turn whose float values are exact in float32, so the float32 columns round-trip bit for bit."""
    n = len(ids)
    gen = Generation(
        token_ids=ids,
        logprobs=[-0.5 * (j + 1) for j in range(n)],
        entropy=[0.25] * n,
        policy_mask=[j % 2 == 0 for j in range(n)],
        allowed=[[ids[j], 99] if j % 2 == 0 else [ids[j]] for j in range(n)],
        finished=n > 0,
    )
    return TurnRecord(
        turn,
        f"obs {turn} é…",
        action,
        [2, 100 + turn, 4],
        gen,
        reward,
        won,
        won,
        valid,
        bool(action),
        0.5 * turn,
        f"key|{turn}",
        "NAVIGATE",
        5 - turn,
        0.125,
        0.0625,
    )


def _records() -> list[EpisodeRecord]:
    """Two episodes: one won in 2 turns (one invalid, 3 + 2 generated tokens), one with no turn at all."""
    won = EpisodeRecord(
        10,
        3,
        TASK,
        "window",
        12345,
        "branch",
        4,
        17,
        [_turn(0, "go to fridge 1", [7, 8, 3], valid=False), _turn(1, "", [9, 3], reward=10.0, won=True)],
        "won",
    )
    empty = EpisodeRecord(11, 3, TASK, "full", -1, status="error", error="boom")
    return [won, empty]


def _advantages() -> pa.Table:
    return pa.table(
        {
            "rollout_id": [10, 10, 11],
            "turn": [0, 1, 0],
            "adv": [0.5, -1.25, 0.0],
            "keep": [True, False, True],
            "adv_tokens": [[0.5, 0.25], None, []],
        },
        schema=ADVANTAGES,
    )


def test_episodes_table_fields_are_derived_from_the_records():
    t = store.episodes_table(_records(), "run-a", 3, 2).to_pylist()
    assert t[0] == dict(
        run_name="run-a",
        iteration=3,
        policy_version=2,
        rollout_id=10,
        group_id=3,
        task_id="household/easy/train/7",
        env="household",
        split="train",
        tier="easy",
        family="pick_and_place",
        task_seed=2**62 + 3,
        kind="branch",
        parent_rollout=4,
        branch_token=17,
        branch_score=0.0,
        context="window",
        sample_seed=12345,
        n_turns=2,
        episode_return=10.0,
        won=True,
        score=0.5,
        n_invalid=1,
        gen_tokens=5,
        status="won",
        error="",
    )
    assert (t[1]["n_turns"], t[1]["episode_return"], t[1]["won"], t[1]["score"], t[1]["gen_tokens"], t[1]["error"]) == (
        0,
        0.0,
        False,
        0.0,
        0,
        "boom",
    )


def _audit() -> pa.Table:
    """Two decision points: one played (a failed continuation among its returns), one not yet."""
    nan = float("nan")
    return store.audit_table({
        "point": [0, 1], "rollout_id": [10, 10], "group_id": [3, 3], "turn": [0, 1], "n_turns": [2, 2],
        "task_id": [TASK.task_id] * 2, "family": ["pick_and_place"] * 2, "phase": ["early", "late"],
        "anchor": [0, -1], "action": ["go to desk 1", ""], "q_returns": [[1.0, nan], []], "v_returns": [[0.0, 1.0], []],
        "q_mc": [1.0, nan], "v_mc": [0.5, nan], "a_mc": [0.5, nan], "se": [0.5, nan], "a_half1": [1.0, nan],
        "a_half2": [nan, nan],
    })  # fmt: skip


@pytest.mark.parametrize("kind", ["episodes", "turns", "advantages", "audit"])
def test_round_trip_is_exact_in_values_and_types(tmp_path, kind):
    table = {
        "episodes": lambda: store.episodes_table(_records(), "run-a", 3, 2),
        "turns": lambda: store.turns_table(_records()),
        "advantages": _advantages,
        "audit": _audit,
    }[kind]()
    path = tmp_path / "iter=00003" / f"{kind}.parquet"
    digest = write_table(table, path, kind)
    back = read_table(path, kind)
    assert back.schema.equals(store._SCHEMAS[kind])  # every column type as declared (metadata aside)
    assert repr(back.to_pylist()) == repr(table.to_pylist())  # repr: NaN where NaN was written
    assert digest == hashlib.sha256(path.read_bytes()).hexdigest()


def test_records_are_read_back_as_they_were_stored():
    """``store.records`` inverts the two tables (what the credit audit replays from)."""
    episodes, turns = store.episodes_table(_records(), "run-a", 3, 2), store.turns_table(_records(), 2)
    back = store.records(episodes, turns)
    assert [r.task for r in back] == [r.task for r in _records()]
    assert back[0].turns[1].gen == _records()[0].turns[1].gen, "the tokens, their log-probs and allowed sets"
    assert store.episodes_table(back, "run-a", 3, 2).equals(episodes) and store.turns_table(back, 2).equals(turns)


def test_turns_table_keeps_the_generation_lists():
    rows = store.turns_table(_records()).to_pylist()
    assert [(r["rollout_id"], r["turn"]) for r in rows] == [(10, 0), (10, 1)]
    assert rows[0]["action_ids"] == [7, 8, 3] and rows[0]["prompt_ids"] == [2, 100, 4]
    assert rows[0]["logprobs"] == [-0.5, -1.0, -1.5] and rows[0]["policy_mask"] == [True, False, True]
    assert rows[0]["allowed"] == [[7, 99], [8], [3, 99]] and rows[0]["valid"] is False


def test_file_carries_schema_version_and_kind(tmp_path):
    path = tmp_path / "turns.parquet"
    write_table(store.turns_table(_records()), path, "turns")
    meta = pq.read_schema(path).metadata
    assert meta[b"horizonrl.schema_version"] == store.SCHEMA_VERSION.encode() == b"2"
    assert meta[b"horizonrl.table"] == b"turns"


def test_other_schema_version_raises_naming_the_path(tmp_path, monkeypatch):
    path = tmp_path / "advantages.parquet"
    monkeypatch.setattr(store, "SCHEMA_VERSION", "0")
    write_table(_advantages(), path, "advantages")
    monkeypatch.undo()
    with pytest.raises(StoreError, match=re.escape(f"{path}: schema version '0'")):
        read_table(path, "advantages")


def test_tables_of_schema_version_1_are_read_with_the_turns_policy_version_unknown(tmp_path):
    """A run stored before turns carried ``policy_version`` (version 1: the same tables without that column)
    is still read, so it resumes and recomputes: the column comes back as -1 (the episode row has it)."""
    turns = store.turns_table(_records(), policy_version=3)
    meta = {b"horizonrl.schema_version": b"1", b"horizonrl.table": b"turns"}
    pq.write_table(turns.drop_columns(["policy_version"]).replace_schema_metadata(meta), tmp_path / "turns.parquet")
    read = read_table(tmp_path / "turns.parquet", "turns")
    assert read.schema.equals(TURNS) and read["policy_version"].to_pylist() == [-1] * turns.num_rows
    assert read.drop_columns(["policy_version"]).equals(turns.drop_columns(["policy_version"]))
    some = read_table(tmp_path / "turns.parquet", "turns", columns=["turn", "policy_version"])
    assert some.column_names == ["turn", "policy_version"] and some["turn"].equals(turns["turn"])
    episodes = store.episodes_table(_records(), "r", 1, 0)
    pq.write_table(episodes.replace_schema_metadata({**meta, b"horizonrl.table": b"episodes"}), tmp_path / "e.parquet")
    assert read_table(tmp_path / "e.parquet", "episodes").equals(episodes)


def test_file_without_metadata_raises(tmp_path):
    path = tmp_path / "advantages.parquet"
    pq.write_table(_advantages(), path)
    with pytest.raises(StoreError, match=re.escape(f"{path}: schema version '?'")):
        read_table(path, "advantages")


@pytest.mark.parametrize("keep", [0, 4, 100, -8, -1])
def test_truncated_file_raises_naming_the_path(tmp_path, keep):
    path = tmp_path / "turns.parquet"
    write_table(store.turns_table(_records()), path, "turns")
    data = path.read_bytes()
    path.write_bytes(data[:keep] if keep >= 0 else data[: len(data) + keep])
    with pytest.raises(StoreError, match=re.escape(f"{path}: not a readable Parquet file (truncated")):
        read_table(path, "turns")


def test_wrong_table_kind_raises_naming_the_path(tmp_path):
    path = tmp_path / "advantages.parquet"
    write_table(_advantages(), path, "advantages")
    with pytest.raises(
        StoreError,
        match=re.escape(
            f"{path}: schema version '2' of table 'advantages'; this code reads versions '1', '2' of 'turns'"
        ),
    ):
        read_table(path, "turns")


def test_missing_file_raises_naming_the_path(tmp_path):
    with pytest.raises(StoreError, match=re.escape(f"{tmp_path / 'nope.parquet'}: no such file")):
        read_table(tmp_path / "nope.parquet", "turns")


def test_write_refuses_a_table_of_another_schema(tmp_path):
    path = tmp_path / "turns.parquet"
    with pytest.raises(StoreError, match="'turns' schema"):
        write_table(_advantages(), path, "turns")
    wrong_type = _advantages().cast(
        pa.schema([f if f.name != "turn" else pa.field("turn", pa.int64()) for f in ADVANTAGES])
    )
    with pytest.raises(StoreError):
        write_table(wrong_type, tmp_path / "advantages.parquet", "advantages")
    assert list(tmp_path.iterdir()) == []


def test_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "advantages.parquet"
    write_table(_advantages(), path, "advantages")
    old = path.read_bytes()

    def write_half_then_fail(table, where, **kwargs):
        with open(where, "wb") as f:
            f.write(old[: len(old) // 2])
        raise OSError("disk full")

    monkeypatch.setattr(store.pq, "write_table", write_half_then_fail)
    with pytest.raises(OSError, match="disk full"):
        write_table(_advantages().slice(0, 1), path, "advantages")
    assert path.read_bytes() == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["advantages.parquet"]
    monkeypatch.undo()
    assert read_table(path, "advantages").num_rows == 3


def test_successful_overwrite_replaces_the_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "advantages.parquet"
    write_table(_advantages(), path, "advantages")
    write_table(_advantages().slice(1, 2), path, "advantages")
    assert read_table(path, "advantages").to_pylist() == _advantages().slice(1, 2).to_pylist()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["advantages.parquet"]


def test_reading_one_column(tmp_path):
    path = tmp_path / "episodes.parquet"
    write_table(store.episodes_table(_records(), "run-a", 3, 2), path, "episodes")
    won = read_table(path, "episodes", columns=["won"])
    assert won.column_names == ["won"] and won.schema.field("won").type == pa.bool_()
    assert won.column("won").to_pylist() == [True, False]


def test_iteration_dir_layout(tmp_path):
    assert store.iteration_dir(tmp_path, "exp", "run", 12) == tmp_path / "exp" / "run" / "iter=00012"
    assert EPISODES.names[0] == "run_name" and TURNS.field("allowed").type == pa.list_(pa.list_(pa.int32()))


def test_reading_columns_of_a_file_of_another_kind_names_the_kind_not_corruption(tmp_path):
    path = tmp_path / "advantages.parquet"
    write_table(_advantages(), path, "advantages")
    with pytest.raises(StoreError, match=re.escape(f"{path}: schema version '2' of table 'advantages'")):
        read_table(path, "episodes", columns=["won"])


def test_reading_an_unknown_column_names_it(tmp_path):
    path = tmp_path / "episodes.parquet"
    write_table(store.episodes_table(_records(), "run-a", 3, 2), path, "episodes")
    with pytest.raises(StoreError, match=re.escape(f"{path}: the 'episodes' table has no column nope")):
        read_table(path, "episodes", columns=["won", "nope"])


def test_advantages_table_stores_each_trajectorys_tokens_once_on_its_first_row():
    """Per-token advantages (APPO): one list per trajectory, all its turns, on its first row; a first row
    without tokens of its own still opens its trajectory's list."""
    import numpy as np

    rid, turn = np.array([7, 7, 9, 4, 4, 4]), np.array([0, 1, 0, 0, 1, 2])
    n_tokens = np.array([2, 1, 3, 0, 2, 1])  # (N,); M = 9
    t = store.advantages_table(rid, turn, np.arange(6.0), np.array([True] * 5 + [False]), np.arange(9.0), n_tokens)
    assert t.schema.equals(ADVANTAGES)
    assert t["adv_tokens"].to_pylist() == [[0.0, 1.0, 2.0], None, [3.0, 4.0, 5.0], [6.0, 7.0, 8.0], None, None]
    assert t["turn"].to_pylist() == [0, 1, 0, 0, 1, 2] and t["keep"].to_pylist()[-1] is False
    plain = store.advantages_table(rid, turn, np.arange(6.0), np.ones(6, dtype=bool))
    assert plain["adv_tokens"].null_count == 6
    empty = np.array([], dtype=np.int64)
    assert (
        store.advantages_table(empty, empty, np.array([]), np.array([], dtype=bool), np.array([]), empty).num_rows == 0
    )
