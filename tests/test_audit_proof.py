"""Proof that the credit audit measures what it says (issue 48, point 4), on a chain whose true per-turn
advantage is known in closed form (tests/chain_env.py: a fixed policy, one decisive turn).

The audit's own steps run here as its tasks run them (``horizonrl.audit``: play, pick, Monte Carlo truth,
scores); the environment and the policy are test doubles (no model: the policy's probabilities must be
known exactly for the closed form to hold)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from chain_env import DECISIVE, P_LEFT, ChainSuite, OracleEngine, true_advantage

import methods
from horizonrl import store
from horizonrl.audit import points as audit_points
from horizonrl.audit import scores, statistics, truth
from horizonrl.engines.base import Generation
from horizonrl.models.tokenizers import train_word_tokenizer
from horizonrl.rollout.loop import SamplingSettings, collect
from horizonrl.rollout.metrics import EvaluationIncomplete, check_complete
from horizonrl.rollout.prompting import ChatFormat
from horizonrl.training.sequences import step_batch


def _audit_chain(m: int, n_points: int, seed: int = 0, groups: int = 24) -> tuple[pd.DataFrame, dict]:
    """The audit of the oracle policy on the chain: ``groups`` groups of 4, ``n_points`` points, M = ``m``."""
    suite = ChainSuite()
    fmt = ChatFormat.for_tokenizer(train_word_tokenizer(suite.corpus(), fallback=False))
    engine = OracleEngine()
    settings = SamplingSettings("admissible", "full", 2, suite.max_turns("easy"), 4, 1.0, seed)
    played = collect(suite, suite.tasks("train", "easy", groups), 4, engine, fmt, settings)
    episodes, turns = store.episodes_table(played, "chain", 0, 0), store.turns_table(played, 0)
    parents = {r.rollout_id: r for r in store.records(episodes, turns)}
    picked = audit_points.pick_points(audit_points.candidates(episodes, turns), n_points, 0.3, seed)
    plan = truth.plan(picked, parents, m)
    records = truth.play_block(suite, parents, plan, engine, fmt, settings, first_rollout_id=1000)
    q, v = truth.returns(picked, parents, plan, store.episodes_table(records, "chain", 0, 0), m)
    q_mc, _, a_mc, se = statistics.mc_advantage(q, v)
    half1, half2 = statistics.split_halves(q, v)
    table = picked.assign(q_mc=q_mc, a_mc=a_mc, se=se, a_half1=half1, a_half2=half2)
    batch = step_batch(episodes, turns, 0)
    entry = methods.ADVANTAGES.get("loo")
    loo = pd.DataFrame(
        {"rollout_id": batch.traj_id, "turn": batch.turn, "loo": entry.fn(batch, entry.params_cls()).adv}
    )
    table = table.merge(loo, on=["rollout_id", "turn"], how="left")
    table["oracle"] = [true_advantage(t, a) for t, a in zip(table["turn"], table["action"])]
    table["shuffled"] = np.random.default_rng(seed).permutation(table["loo"].to_numpy())
    return table, scores.score(table, ["oracle", "loo", "shuffled"], 2000, seed, 2.0)


@pytest.fixture(scope="module")
def chain_audit():
    return _audit_chain(m=16, n_points=300, groups=48)


def test_the_monte_carlo_advantage_converges_to_the_closed_form_within_its_interval(chain_audit):
    table, _ = chain_audit
    exact = table["oracle"].to_numpy()
    a_mc, se = table["a_mc"].to_numpy(), table["se"].to_numpy()
    after = table["turn"].to_numpy() > DECISIVE
    assert (a_mc[after] == 0).all() and (se[after] == 0).all(), "after the decisive turn nothing is left to chance"
    noisy = ~after
    z = np.abs(a_mc[noisy] - exact[noisy]) / se[noisy]
    assert (z < 1.96).mean() >= 0.85, f"95% intervals cover the truth at {(z < 1.96).mean():.2f}"
    decisive_left = (table["turn"] == DECISIVE) & (table["action"] == "left")
    mean, spread = a_mc[decisive_left].mean(), 1.96 * np.sqrt((se[decisive_left] ** 2).sum()) / decisive_left.sum()
    assert abs(mean - (1 - P_LEFT)) < spread, f"A_MC of 'left' at the decisive turn: {mean:.3f} vs {1 - P_LEFT}"
    coarse, _ = _audit_chain(m=4, n_points=300, seed=1, groups=48)
    error = {len_: np.abs(t["a_mc"] - t["oracle"]).mean() for len_, t in ((4, coarse), (16, table))}
    assert error[16] < error[4], f"more continuations, closer to the closed form: {error}"


def test_the_audit_ranks_the_truth_above_loop_and_loop_above_a_shuffled_control(chain_audit):
    _, result = chain_audit
    spear = {name: result["estimators"][name]["spearman"] for name in ("oracle", "loo", "shuffled")}
    assert spear["oracle"].value > spear["loo"].value > spear["shuffled"].value
    pairs = {(p["a"], p["b"], p["metric"]): p["difference"] for p in result["pairs"]}
    assert pairs["oracle", "loo", "spearman"].low > 0, "the truth ranks above LOOP, its paired interval above 0"
    assert pairs["loo", "shuffled", "spearman"].low > 0, "LOOP ranks above the shuffled control"
    assert result["noise_ceiling"].value > spear["loo"].value
    oracle = result["estimators"]["oracle"]
    # the truth is 0 away from the decisive turn, where a chance |A_MC| > 2 SE (1 point in 20) counts 1/2
    assert oracle["sign_agreement"].value >= 0.95 and oracle["sign_agreement"].n >= 30
    assert oracle["ordering"].low > 0.5 and oracle["ordering"].n >= 5, "actions ordered above chance at anchors"


class _DeadEngine(OracleEngine):
    """The oracle policy behind a server that died: every generation comes back with the engine's error."""

    def generate(self, request):
        return [Generation([], [], [], [], error="vLLM server unreachable") for _ in request.prompts]


def test_continuations_a_dead_engine_ended_are_refused_and_never_taken_for_returns():
    suite = ChainSuite()
    fmt = ChatFormat.for_tokenizer(train_word_tokenizer(suite.corpus(), fallback=False))
    settings = SamplingSettings("admissible", "full", 2, suite.max_turns("easy"), 4, 1.0, 0)
    played = collect(suite, suite.tasks("train", "easy", 1), 2, OracleEngine(), fmt, settings)
    parents = {r.rollout_id: r for r in played}
    block = pd.DataFrame({"point": [0], "rollout_id": [0], "turn": [1]})
    plan = truth.plan(block, parents, 2)
    records = truth.play_block(suite, parents, plan, _DeadEngine(), fmt, settings, first_rollout_id=10)
    with pytest.raises(EvaluationIncomplete, match="4 of 4 continuations were ended by the sampler"):
        check_complete(records, "continuations")
    stored = store.episodes_table(records, "chain", 0, 0)
    assert not truth.matches(stored, plan, parents, 10), "a resumed audit plays such a block again"
    good = truth.play_block(suite, parents, plan, OracleEngine(), fmt, settings, first_rollout_id=10)
    assert truth.matches(store.episodes_table(good, "chain", 0, 0), plan, parents, 10)
