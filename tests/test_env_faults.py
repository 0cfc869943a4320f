"""Faults during rollouts: an environment that raises, answers garbage, crashes its worker or hangs, and an
engine that returns a non-finite log-prob or runs over its token budget. Each ends (or marks) only its own
episode, with the reason in the store; the batch and the iteration go on, and the counts are logged.

The faulty environment is the real household environment with a fault injected at a chosen step; the
faulty engine is the real transformers engine whose output is corrupted on one episode. Both are test
doubles of the failure only, named as such.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pytest
from faulty_env import FAULTS, FaultySuite, faulty_suite
from flowkit import built_owners, run_of, tiny_config

from horizonrl import store
from horizonrl.envs import SUITES
from horizonrl.envs.pool import EnvPool
from horizonrl.rollout.loop import SamplingSettings, collect
from horizonrl.rollout.metrics import EvaluationIncomplete, check_complete, episode_metrics

REASONS = {
    "raise": "ValueError: injected",
    "garbage": "step returned NoneType",
    "crash": "worker process died",
    "hang": "no answer within 2 s",
}


def _sampling(**kw) -> SamplingSettings:
    return SamplingSettings(
        **dict(
            action_mode="admissible",
            context="window",
            history_turns=2,
            max_turns=3,
            max_action_tokens=12,
            temperature=1.0,
            seed=5,
        )
        | kw
    )


def _without_timings(table):
    return table.drop_columns([c for c in ("gen_s", "env_s") if c in table.column_names])


@pytest.mark.parametrize("context", ["window", "full"])
def test_pool_and_in_process_play_identical_rollouts(tiny_policy, household_suite, context):
    _, _, fmt, engine = tiny_policy
    tasks = household_suite.tasks("train", "easy", 3)
    local = collect(household_suite, tasks, 2, engine, fmt, _sampling(context=context))
    with EnvPool("household", 0, n_workers=2) as pool:
        pooled = collect(pool, tasks, 2, engine, fmt, _sampling(context=context))
        pids = pool.pids
    assert _without_timings(store.turns_table(pooled)).equals(_without_timings(store.turns_table(local)))
    assert store.episodes_table(pooled, "r", 1, 0).equals(store.episodes_table(local, "r", 1, 0))
    assert not any(
        Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split(") ")[1][:1]
        for pid in pids
    )


def test_environment_faults_end_their_episodes_and_the_batch_goes_on(tiny_policy, household_suite, tmp_path):
    from methods.advantages import LOOParams
    from tasks.advantage import compute_advantages
    from tasks.collect import RolloutRef

    _, _, fmt, engine = tiny_policy
    tasks = household_suite.tasks("train", "easy", 5)
    start = time.monotonic()
    with EnvPool(faulty_suite, 0, n_workers=2, step_timeout_s=2.0) as pool:
        records = collect(pool, tasks, 2, engine, fmt, _sampling())
        assert pool.restarts >= 2  # the crashed and the hung workers were replaced
    assert time.monotonic() - start < 60
    by_task = {t.index: [r for r in records if r.task == t] for t in tasks}
    for index, fault in FAULTS.items():
        for r in by_task[index]:
            assert r.status == "error" and REASONS[fault] in r.error, (fault, r.error)
            assert len(r.turns) == 1 and r.turns[0].reward == 0.0 and not r.turns[0].won
    assert all(r.status != "error" and len(r.turns) >= 1 for r in by_task[0])
    check_complete(records)  # an environment's own errors are its tasks' outcomes: an evaluation stands

    d = tmp_path / "iter"
    d.mkdir()
    store.write_table(store.turns_table(records), d / "turns.parquet", "turns")
    store.write_table(store.episodes_table(records, "r", 1, 0), d / "episodes.parquet", "episodes")
    episodes = store.read_table(d / "episodes.parquet", "episodes")
    assert episode_metrics(episodes)["error_rate"] == pytest.approx(8 / 10)
    errors = episodes.filter(pc.equal(episodes["status"], "error"))["error"].to_pylist()
    assert len(errors) == 8 and all(any(reason in e for reason in REASONS.values()) for e in errors)
    # errored episodes are left out of the estimate: advantage 0, not kept; the healthy group is estimated
    table, _, _ = compute_advantages(
        RolloutRef(1, str(d / "episodes.parquet"), str(d / "turns.parquet")), "loo", LOOParams(), None, 0
    )
    bad = {r.rollout_id for r in records if r.status == "error"}
    rows = table.to_pylist()
    assert {(r["rollout_id"], r["turn"]) for r in rows} == {(e.rollout_id, t.turn) for e in records for t in e.turns}
    for row in rows:
        if row["rollout_id"] in bad:
            assert row["adv"] == 0.0 and not row["keep"]
    healthy = [r for r in records if r.status != "error"]
    returns = {r.rollout_id: r.episode_return for r in healthy}
    for row in rows:
        if row["rollout_id"] not in bad:  # LOO over the two healthy rollouts of task 0: R_i - R_j
            other = next(v for k, v in returns.items() if k != row["rollout_id"])
            assert row["adv"] == pytest.approx(returns[row["rollout_id"]] - other)


class NaNEngine:
    """The real engine, with the first sampled log-prob of batch row 0 replaced by NaN on the second call."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, 0

    def generate(self, *args, **kwargs):
        gens = self.inner.generate(*args, **kwargs)
        self.calls += 1
        if self.calls == 2:
            first = next(i for i, m in enumerate(gens[0].policy_mask) if m)
            gens[0].logprobs[first] = math.nan
        return gens

    def session(self):
        return self.inner.session()


def test_engine_faults_are_recorded_not_trained_on(tiny_policy, household_suite):
    _, _, fmt, engine = tiny_policy
    tasks = household_suite.tasks("train", "easy", 2)
    records = collect(household_suite, tasks, 2, NaNEngine(engine), fmt, _sampling(max_turns=3))
    hit = next(r for r in records if r.status == "error")
    assert "non-finite log-prob" in hit.error and len(hit.turns) == 2  # ended before its action was played
    assert sum(r.status == "error" for r in records) == 1
    with pytest.raises(EvaluationIncomplete, match="1 of 4 held-out episodes were ended by the sampler"):
        check_complete(records)  # the sampler's fault, not the policy's: no evaluation figure from them
    # over the token budget (free decoding, one token): recorded per turn as not format-valid; the episode goes on
    cut = collect(
        household_suite, tasks, 2, engine, fmt, _sampling(action_mode="free", max_action_tokens=1, max_turns=2)
    )
    assert all(not t.format_valid and not t.gen.finished for r in cut for t in r.turns)
    assert all(r.status in ("truncated", "done") and len(r.turns) == 2 for r in cut)


def _faulty_household(seed: int) -> FaultySuite:
    return FaultySuite(seed)


def test_train_flow_counts_environment_errors_and_goes_on(prefect_harness, tmp_path, tracking_uri):
    from flows.train import train
    from mlflow import MlflowClient

    SUITES["household-faulty"] = _faulty_household  # in-process stepping: the raise and garbage faults
    try:
        cfg = tiny_config(tmp_path, tracking_uri, "faulty", iterations=1)
        cfg["env"] = {**cfg["env"], "name": "household-faulty", "train_pool": 3}  # tasks 0..2: 1 raises, 2 garbage
        cfg["rollout"] = {"tasks_per_iteration": 3, "group_size": 2}
        train(config=cfg)
    finally:
        del SUITES["household-faulty"]
    d = Path(cfg["data_dir"]) / "test" / "faulty" / "iter=00001"
    episodes = store.read_table(d / "episodes.parquet", "episodes")
    status = episodes["status"].to_pylist()
    assert status.count("error") == 4
    c = MlflowClient(tracking_uri)
    run = run_of(c, "faulty")
    assert run.data.metrics["collect/error_rate"] == pytest.approx(4 / 6)
    adv = store.read_table(d / "advantages-loop.parquet", "advantages")
    bad = set(np.asarray(episodes["rollout_id"])[np.asarray(status) == "error"].tolist())
    assert all(not k for r, k in zip(adv["rollout_id"].to_pylist(), adv["keep"].to_pylist()) if r in bad)
    assert "update/loss" in run.data.metrics or any(k.startswith("update/") for k in run.data.metrics)


def test_train_flow_steps_environments_in_workers_and_leaves_none(prefect_harness, tmp_path, tracking_uri, monkeypatch):
    """The whole train flow with a pool of two workers and generation overlapping stepping (collect and
    evaluation); the workers are gone when the run ends."""
    from flows.train import train
    from mlflow import MlflowClient

    cfg = tiny_config(tmp_path, tracking_uri, "pooled", iterations=1)
    cfg["rollout"] = {**cfg["rollout"], "env_workers": 2, "overlap": True}
    built = built_owners(monkeypatch)
    train(config=cfg)
    assert built[0].player._episodes is None  # closed at the end of the run
    kids = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _parent(p) == os.getpid() and _running(p)]
    assert not [p for p in kids if b"spawn" in (p / "cmdline").read_bytes()]
    run = run_of(MlflowClient(tracking_uri), "pooled")
    assert run.data.metrics["collect/error_rate"] == 0.0 and run.data.params["rollout.env_workers"] == "2"
    assert run.data.params["rollout.overlap"] == "True" and run.data.metrics["collect/episodes"] == 4
    turns = store.read_table(Path(cfg["data_dir"]) / "test" / "pooled" / "iter=00001" / "turns.parquet", "turns")
    fv, fin = turns["format_valid"].to_pylist(), turns["finished"].to_pylist()
    assert run.data.metrics["collect/format_invalid_rate"] == pytest.approx(1 - sum(fv) / len(fv))
    assert run.data.metrics["collect/unfinished_action_rate"] == pytest.approx(1 - sum(fin) / len(fin))


def _parent(proc: Path) -> int:
    try:
        return int((proc / "stat").read_text().rpartition(")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def _running(proc: Path) -> bool:
    try:
        return (proc / "stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False
