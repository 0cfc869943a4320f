"""APPO branch rollouts: replay fidelity on household, lineage in the store, and a run through the flow."""

from __future__ import annotations

import pytest
import torch
from flowkit import run_of, steps, tiny_config

from horizonrl import store
from horizonrl.envs.household import HouseholdSuite
from horizonrl.rollout.branching import collect_branches, plan_branches, turn_start
from horizonrl.rollout.loop import SamplingSettings, collect
from methods.appo import BranchingParams
from mlflow import MlflowClient


def _flat_tokens(ep) -> list[int]:
    return [t for turn in ep.turns for t in turn.gen.token_ids]


@pytest.mark.parametrize("context", ["full", "window"])
def test_branch_replays_its_source_up_to_the_split(tiny_policy, context):
    model, tokenizer, fmt, engine = tiny_policy
    suite = HouseholdSuite(0)
    sampling = SamplingSettings(
        action_mode="admissible",
        context=context,
        history_turns=2,
        max_turns=5,
        max_action_tokens=24,
        temperature=1.0,
        seed=11,
    )
    initial = collect(suite, suite.tasks("train", "easy", 2), 3, engine, fmt, sampling)
    starts, scores, stats = plan_branches(initial, 3, BranchingParams(), tokenizer)
    assert len(starts) == 6 and stats["branches_per_group"] == 3.0
    assert stats["omega_fallback_fraction"] == 1.0, "sampler and scorer are one policy: Omega is constant"
    branches = collect_branches(suite, starts, engine, fmt, sampling, first_rollout_id=100)
    for b, start in zip(branches, starts):
        parent = start.parent
        assert b.kind == "branch" and b.parent_rollout == parent.rollout_id and b.branch_token == start.split
        assert b.group_id == parent.group_id
        assert _flat_tokens(b)[: start.split + 1] == _flat_tokens(parent)[: start.split + 1]
        split_turn = next(
            t
            for t in range(len(parent.turns))
            if sum(len(x.gen.token_ids) for x in parent.turns[: t + 1]) > start.split
        )
        for t in range(split_turn + 1):
            assert b.turns[t].observation == parent.turns[t].observation, "replayed state differs from the source"
        assert len(b.turns) <= 5


def test_branch_split_is_never_the_last_token_of_an_action(tiny_policy):
    model, tokenizer, fmt, engine = tiny_policy
    suite = HouseholdSuite(0)
    initial = collect(
        suite, suite.tasks("train", "easy", 3), 2, engine, fmt, SamplingSettings("admissible", "full", 2, 4, 24, 1.0, 5)
    )
    starts, _, _ = plan_branches(initial, 4, BranchingParams(), tokenizer)
    for s in starts:
        ends, total = set(), 0
        for turn in s.parent.turns:
            total += len(turn.gen.token_ids)
            ends.add(total - 1)
        assert s.split not in ends


@pytest.mark.parametrize("context", ["full", "window"])
def test_a_turn_start_replays_whole_turns_and_samples_from_that_turn_on(tiny_policy, context):
    """The credit audit's continuations (``turn_start``): the parent's first u turns exactly (observations,
    prompt ids, actions), then every turn from u on sampled, from turn 0 up to the parent's last turn."""
    _, _, fmt, engine = tiny_policy
    suite = HouseholdSuite(0)
    sampling = SamplingSettings("admissible", context, 2, 5, 24, 1.0, 13)
    parent = collect(suite, suite.tasks("train", "easy", 1), 1, engine, fmt, sampling)[0]
    turns = list(range(len(parent.turns)))
    starts = [turn_start(parent, u) for u in turns]
    assert [s.split for s in starts][:2] == [-1, len(parent.turns[0].gen.token_ids) - 1]
    branches = collect_branches(suite, starts * 2, engine, fmt, sampling, first_rollout_id=50, kind="audit")
    for b, u in zip(branches, turns * 2):
        assert b.kind == "audit" and b.parent_rollout == parent.rollout_id and len(b.turns) > u
        for t in range(u):
            assert b.turns[t] is parent.turns[t], "a replayed turn is the parent's own record"
        assert b.turns[u].observation == parent.turns[u].observation, "the state the continuation starts in"
        assert b.turns[u].prompt_ids == parent.turns[u].prompt_ids, "the policy sees exactly what the parent saw"
        assert b.turns[u] is not parent.turns[u] and b.turns[u].gen.token_ids, "turn u is sampled afresh"


@pytest.mark.slow
def test_appo_run_through_the_flow(prefect_harness, tmp_path, tracking_uri):
    from flows.train import train

    cfg = tiny_config(tmp_path, tracking_uri, "appo", 2)
    cfg.update(method="appo", rollout={"tasks_per_iteration": 2, "group_size": 3, "branch_budget": 2})
    train(config=cfg)
    c = MlflowClient(tracking_uri)
    run = run_of(c, "appo")
    for key in (
        "collect/appo/branches_per_group",
        "collect/appo/branch_strict",
        "collect/appo/omega_fallback_fraction",
        "collect/appo/mean_branching_score",
        "collect/branch_token_share",
        "advantage/appo/branch_credit_fraction",
        "update/mean_scale",
    ):
        assert steps(c, run.info.run_id, key) == [1, 2], key
    d = store.iteration_dir(tmp_path / "data", "test", "appo", 1)
    episodes = store.read_table(d / "episodes.parquet", "episodes").to_pandas()
    branches = episodes[episodes.kind == "branch"]
    assert len(branches) == 4 and (episodes.kind == "initial").sum() == 6
    lineage = branches.merge(
        episodes[episodes.kind == "initial"], left_on="parent_rollout", right_on="rollout_id", suffixes=("", "_parent")
    )
    assert len(lineage) == len(branches) and (lineage.group_id == lineage.group_id_parent).all()
    assert (lineage.branch_token < lineage.gen_tokens_parent).all()
    assert (branches.branch_score > 0).any(), "strict branch points carry their (positive) branching score"
    adv = store.read_table(d / "advantages-appo.parquet", "advantages").to_pandas()
    branch_rows = adv[adv.rollout_id.isin(branches.rollout_id)]
    assert not branch_rows.keep.any() and (branch_rows.adv == 0).all(), "branch rows never enter the loss"
    with_tokens = adv.dropna(subset=["adv_tokens"])
    assert set(with_tokens.rollout_id) >= set(episodes[episodes.kind == "initial"].rollout_id)
    assert torch.isfinite(torch.tensor([v for row in with_tokens.adv_tokens for v in row])).all()
    # One x for every figure: the evaluation curve's steps are the stored episodes' turns, branches included,
    # the same count as time/env_steps (a count of initial rollouts only would fall short by the branches').
    time_steps = {m.step: m.value for m in c.get_metric_history(run.info.run_id, "time/env_steps")}
    with_branches = sum(
        int(
            store.read_table(
                store.iteration_dir(tmp_path / "data", "test", "appo", it) / "episodes.parquet", "episodes"
            )
            .column("n_turns")
            .to_numpy()
            .sum()
        )
        for it in (1, 2)
    )
    assert time_steps[2] == with_branches and branches.n_turns.sum() > 0
    assert steps(c, run.info.run_id, "eval/success_by_env_steps") == [0, int(time_steps[1]), int(time_steps[2])]


def _replay_on(suite, tmp_path, n_tasks: int, tier: str, max_turns: int) -> None:
    """Initial rollouts and their branches on ``suite`` with a tiny model built from its own corpus;
    every branch must see its parent's observations up to the split (``_branch_live`` also checks each
    replayed observation and raises on divergence)."""
    from horizonrl.config import ModelConfig, TinyModelConfig
    from horizonrl.engines.hf import TransformersEngine
    from horizonrl.models.loading import load_policy, tiny_model_dir
    from horizonrl.rollout.prompting import ChatFormat

    tiny = TinyModelConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1)
    model, tokenizer = load_policy(
        tiny_model_dir(tmp_path, suite.name, ModelConfig(tiny=tiny), suite.corpus(n_tasks=n_tasks))
    )
    fmt = ChatFormat.for_tokenizer(tokenizer)
    engine = TransformersEngine(model, tokenizer.pad_token_id, [fmt.end_id])
    sampling = SamplingSettings(
        action_mode="admissible",
        context="full",
        history_turns=2,
        max_turns=max_turns,
        max_action_tokens=32,
        temperature=1.0,
        seed=2,
    )
    initial = collect(suite, suite.tasks("train", tier, n_tasks), 2, engine, fmt, sampling)
    starts, _, _ = plan_branches(initial, 2, BranchingParams(), tokenizer)
    branches = collect_branches(suite, starts, engine, fmt, sampling, first_rollout_id=10)
    assert len(branches) == 2 * n_tasks
    for b, start in zip(branches, starts):
        assert _flat_tokens(b)[: start.split + 1] == _flat_tokens(start.parent)[: start.split + 1]
        turn = next(
            t
            for t in range(len(start.parent.turns))
            if sum(len(x.gen.token_ids) for x in start.parent.turns[: t + 1]) > start.split
        )
        assert [x.observation for x in b.turns[: turn + 1]] == [x.observation for x in start.parent.turns[: turn + 1]]


@pytest.mark.slow
def test_branch_replay_on_textworld(tmp_path, tw_root):
    from horizonrl.envs.textworld_env import TextWorldSuite

    suite = TextWorldSuite("textworld-coin", root=tw_root)
    _replay_on(suite, tmp_path, 1, "easy", 6)


@pytest.mark.slow
def test_branch_replay_on_scienceworld(tmp_path):
    from horizonrl.envs.scienceworld_env import ScienceWorldSuite

    suite = ScienceWorldSuite("boil")
    try:
        _replay_on(suite, tmp_path, 1, "easy", 5)
    finally:
        assert not suite.host.pids, "every environment (JVM) was closed"
