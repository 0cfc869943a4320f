"""Sequences: the learner rebuilds exactly the token sequences the engine saw, through the Parquet store.

The acceptance test plays real rollouts (tiny model, household easy tier) through a spy engine that
records every prompt it is given, writes and reads the turns table, rebuilds with ``train_rows`` and
compares token by token. Hand-built tables pin ``train_rows``, ``attach_advantages`` and ``step_batch``.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from horizonrl import store
from horizonrl.rollout.loop import SamplingSettings, collect
from horizonrl.store import ADVANTAGES
from horizonrl.training.sequences import TrainRow, attach_advantages, step_batch, train_rows


class RecordingEngine:
    """Spy: forwards to the real engine and records, per call, the full sequence each episode's action
    is sampled after. In full context ``collect`` uses a session that takes only the new ids per turn;
    the sequence it conditions on is everything sent to that slot so far plus the actions it produced."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.calls: list[dict[int | None, tuple[list[int], object]]] = []  # per call: slot -> (sequence, generation)

    def generate(self, request):
        gens = self.engine.generate(request)
        self.calls.append({k: (list(p), g) for k, (p, g) in enumerate(zip(request.prompts, gens))})
        return gens

    def session(self):
        return RecordingSession(self, self.engine.session())


class RecordingSession:
    def __init__(self, spy: RecordingEngine, session) -> None:
        self.spy, self.session, self.seq = spy, session, {}

    def extend(self, slots, request):
        gens = self.session.extend(slots, request)
        call = {}
        for slot, ids, g in zip(slots, request.prompts, gens):
            call[slot] = (self.seq.get(slot, []) + list(ids), g)
            self.seq[slot] = call[slot][0] + g.token_ids
        self.spy.calls.append(call)
        return gens


def _play(tiny_policy, household_suite, context: str, action_mode: str, max_action_tokens: int):
    """2 easy tasks x 2 rollouts, 4 turns; returns (records, {(rollout_id, turn): (prompt, generation)})."""
    _, _, fmt, engine = tiny_policy
    spy = RecordingEngine(engine)
    settings = SamplingSettings(
        action_mode, context, history_turns=2, max_turns=4, max_action_tokens=max_action_tokens, temperature=1.0, seed=5
    )
    records = collect(household_suite, household_suite.tasks("train", "easy", 2), 2, spy, fmt, settings)
    seen = {}
    for turn, call in enumerate(spy.calls):
        # the episodes still running at this turn, in rollout order (the order collect batches them)
        running = [r.rollout_id for r in records if len(r.turns) > turn]
        assert len(running) == len(call)
        keys = running if set(call) == set(running) else range(len(running))  # session slots are rollout ids
        seen.update({(rid, turn): call[k] for rid, k in zip(running, keys)})
    assert len(seen) == sum(len(r.turns) for r in records)
    gens = [g for _, g in seen.values()]
    assert max(len(r.turns) for r in records) == 4  # history and growing contexts are exercised
    if action_mode == "admissible":
        assert not all(m for g in gens for m in g.policy_mask)  # some forced tokens, skipped by positions
    else:
        assert not all(g.finished for g in gens)  # some actions cut at the budget: the context closes them
    return records, seen


def _stored_turns(records, tmp_path) -> pa.Table:
    path = tmp_path / "turns.parquet"
    store.write_table(store.turns_table(records), path, "turns")
    return store.read_table(path, "turns")


def _f32(values: list[float]) -> list[float]:
    """What a float32 column gives back: the stored log-probs are exact at float32 precision."""
    return np.asarray(values, dtype=np.float32).astype(np.float64).tolist()


@pytest.mark.parametrize("action_mode,max_action_tokens", [("admissible", 12), ("free", 5)])
def test_window_rows_are_the_recorded_prompts_plus_generated_ids(
    tiny_policy, household_suite, tmp_path, action_mode, max_action_tokens
):
    records, seen = _play(tiny_policy, household_suite, "window", action_mode, max_action_tokens)
    rows = train_rows(_stored_turns(records, tmp_path), "window")
    assert sorted((r.rollout_id, r.turn) for r in rows) == sorted(seen)
    for row in rows:
        prompt, gen = seen[(row.rollout_id, row.turn)]
        assert row.input_ids == prompt + gen.token_ids
        policy = [j for j, m in enumerate(gen.policy_mask) if m]
        assert row.positions == [len(prompt) + j for j in policy]
        assert [row.input_ids[p] for p in row.positions] == [gen.token_ids[j] for j in policy]
        assert row.sample_logp == _f32([gen.logprobs[j] for j in policy])
        assert row.allowed == [gen.allowed[j] for j in policy]
        assert row.turn_id == [row.turn] * len(policy)


@pytest.mark.parametrize("action_mode,max_action_tokens", [("admissible", 12), ("free", 5)])
def test_full_rows_hold_every_recorded_prompt_as_a_prefix(
    tiny_policy, household_suite, tmp_path, action_mode, max_action_tokens
):
    records, seen = _play(tiny_policy, household_suite, "full", action_mode, max_action_tokens)
    rows = train_rows(_stored_turns(records, tmp_path), "full")
    assert [r.rollout_id for r in rows] == [r.rollout_id for r in records] and {r.turn for r in rows} == {-1}
    for row, rec in zip(rows, records):
        positions, logp, turn_id, flat_index, flat = [], [], [], [], 0
        for t in range(len(rec.turns)):
            prompt, gen = seen[(row.rollout_id, t)]
            end = len(prompt) + len(gen.token_ids)
            assert row.input_ids[:end] == prompt + gen.token_ids, f"rollout {row.rollout_id} turn {t}"
            policy = [j for j, m in enumerate(gen.policy_mask) if m]
            positions += [len(prompt) + j for j in policy]
            logp += [gen.logprobs[j] for j in policy]
            turn_id += [t] * len(policy)
            flat_index += [flat + j for j in policy]
            flat += len(gen.token_ids)
        assert len(row.input_ids) == end  # nothing after the last action
        assert row.positions == positions
        assert [row.input_ids[p] for p in row.positions] == [
            i for t in rec.turns for i, m in zip(t.gen.token_ids, t.gen.policy_mask) if m
        ]
        assert row.sample_logp == _f32(logp)
        assert (row.turn_id, row.flat_index) == (turn_id, flat_index)


def test_rows_do_not_depend_on_the_stored_row_order(tiny_policy, household_suite):
    """train_rows sorts by (rollout_id, turn): a shuffled table rebuilds the same rows."""
    records, _ = _play(tiny_policy, household_suite, "full", "admissible", 12)
    table = store.turns_table(records)
    shuffled = table.take(pa.array(np.random.default_rng(0).permutation(table.num_rows)))
    for context in ("full", "window"):
        assert train_rows(shuffled, context) == train_rows(table, context)


def _hand_turns() -> pa.Table:
    """Rollout 7: turn 0 (prompt [1, 2], action [10, 11, 3], token 11 forced), turn 1 (delta [3, 4],
    action [12, 3], end forced). Rollout 5: one turn. Rows are stored out of order on purpose."""
    rows = [
        dict(
            rollout_id=7,
            group_id=1,
            turn=1,
            prompt_ids=[3, 4],
            action_ids=[12, 3],
            logprobs=[-0.5, 0.0],
            policy_mask=[True, False],
            allowed=[[12, 13], [3]],
            reward=1.0,
            action="b",
        ),
        dict(
            rollout_id=5,
            group_id=0,
            turn=0,
            prompt_ids=[1],
            action_ids=[20],
            logprobs=[-2.0],
            policy_mask=[True],
            allowed=[],
            reward=0.0,
            action="c",
        ),
        dict(
            rollout_id=7,
            group_id=1,
            turn=0,
            prompt_ids=[1, 2],
            action_ids=[10, 11, 3],
            logprobs=[-1.0, 0.0, -0.25],
            policy_mask=[True, False, True],
            allowed=[[10, 12], [11], [3, 9]],
            reward=0.0,
            action="a",
        ),
    ]
    defaults = dict(
        observation="o",
        entropy=None,
        finished=True,
        done=False,
        won=False,
        valid=True,
        format_valid=True,
        score=0.0,
        progress_key="k",
        abstract_action="X",
        n_admissible=2,
        gen_s=0.0,
        env_s=0.0,
    )
    return pa.Table.from_pylist([{**defaults, **r} for r in rows], schema=store.TURNS)


def test_train_rows_on_a_hand_built_table():
    full = train_rows(_hand_turns(), "full")
    assert full == [
        TrainRow(5, -1, [1, 20], [1], [[]], [-2.0], [0], [0]),
        # [1, 2 | 10, 11, 3 | 3, 4 | 12, 3]: policy tokens 10 (pos 2), 3 (pos 4), 12 (pos 7)
        TrainRow(
            7,
            -1,
            [1, 2, 10, 11, 3, 3, 4, 12, 3],
            [2, 4, 7],
            [[10, 12], [3, 9], [12, 13]],
            [-1.0, -0.25, -0.5],
            [0, 0, 1],
            [0, 2, 3],
        ),
    ]
    window = train_rows(_hand_turns(), "window")
    assert window == [
        TrainRow(5, 0, [1, 20], [1], [[]], [-2.0], [0], [0]),
        TrainRow(7, 0, [1, 2, 10, 11, 3], [2, 4], [[10, 12], [3, 9]], [-1.0, -0.25], [0, 0], [0, 2]),
        TrainRow(7, 1, [3, 4, 12, 3], [2], [[12, 13]], [-0.5], [1], [3]),
    ]


def test_attach_advantages_per_turn_per_token_and_dropped_turns():
    rows = train_rows(_hand_turns(), "full")
    adv = pa.table(
        {
            "rollout_id": [5, 7, 7],
            "turn": [0, 0, 1],
            "adv": [0.5, 2.0, -1.0],
            "keep": [False, True, True],
            "adv_tokens": [None, [0.1, 0.2, 0.3, 0.4, 0.5], [0.1, 0.2, 0.3, 0.4, 0.5]],
        },
        schema=ADVANTAGES,
    )
    out = attach_advantages(rows, adv)
    # rollout 5 keeps no token and is dropped; rollout 7 reads adv_tokens at flat indices 0, 2, 3
    assert [(r.rollout_id, r.positions, r.adv) for r in out] == [(7, [2, 4, 7], [0.1, 0.3, 0.4])]
    per_turn = adv.set_column(4, "adv_tokens", pa.array([None, None, None], pa.list_(pa.float64())))
    out = attach_advantages(
        train_rows(_hand_turns(), "window"), per_turn.set_column(3, "keep", pa.array([True, False, True]))
    )
    assert [(r.rollout_id, r.turn, r.positions, r.adv) for r in out] == [(5, 0, [1], [0.5]), (7, 1, [2], [-1.0])]


def test_step_batch_orders_rows_by_trajectory_and_turn():
    turns = _hand_turns()
    episodes = pa.Table.from_pylist(
        [
            {
                **{n: None for n in store.EPISODES.names},
                "rollout_id": 7,
                "family": "f",
                "episode_return": 1.0,
                "kind": "branch",
                "parent_rollout": 5,
                "branch_token": 3,
            },
            {
                **{n: None for n in store.EPISODES.names},
                "rollout_id": 5,
                "family": "g",
                "episode_return": 0.0,
                "kind": "initial",
                "parent_rollout": -1,
                "branch_token": -1,
            },
        ],
        schema=store.EPISODES,
    )
    b = step_batch(episodes, turns, update_index=4)
    assert b.traj_id.tolist() == [5, 7, 7] and b.turn.tolist() == [0, 0, 1] and b.group_id.tolist() == [0, 1, 1]
    assert b.reward.tolist() == [0.0, 0.0, 1.0] and b.episode_return.tolist() == [0.0, 1.0, 1.0]
    assert b.n_tokens.tolist() == [1, 3, 2] and b.action.tolist() == ["c", "a", "b"]
    assert b.context_id.tolist() == ["g|o", "f|o", "f|o"] and b.kind.tolist() == [0, 1, 1]
    assert b.parent_traj.tolist() == [-1, 5, 5] and b.branch_token.tolist() == [-1, 3, 3] and b.update_index == 4


def test_step_batch_gap_tokens_are_the_observations_between_turns_in_full_context():
    """Full context: rollout 7's turn 1 adds [3, 4] between its two actions, so its action tokens sit at
    response positions [0, 1, 2, 5, 6] (its row's positions [2, 3, 4, 7, 8] less the prompt); window: 0."""

    def episodes(context):
        return pa.Table.from_pylist(
            [
                {
                    **{n: None for n in store.EPISODES.names},
                    "rollout_id": r,
                    "family": "f",
                    "episode_return": 0.0,
                    "kind": "initial",
                    "parent_rollout": -1,
                    "branch_token": -1,
                    "context": context,
                }
                for r in (5, 7)
            ],
            schema=store.EPISODES,
        )

    assert step_batch(episodes("full"), _hand_turns(), update_index=0).gap_tokens.tolist() == [0, 0, 2]
    assert step_batch(episodes("window"), _hand_turns(), update_index=0).gap_tokens.tolist() == [0, 0, 0]
