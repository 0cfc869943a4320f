"""Asynchronous rollouts (``rollout.max_staleness``, docs/algorithms.md §1.10): the config check, the decoupled
objective against hand-computed numbers, and end to end the staleness bound, the behaviour log-probs the
update weighs with, methods that keep state or branch, and a fixed-lag run killed and resumed.
"""

from __future__ import annotations

import math
import signal

import pyarrow.parquet as pq
import pytest
import torch
from flowkit import built_owners, newest_checkpoint, run_of, steps
from safetensors.torch import load_file
from test_reliability import api_url, assert_same_tensors, config, files, finish, run_dir, start_cli  # noqa: F401

from horizonrl import store
from horizonrl.config import TrainConfig, load_config
from horizonrl.models.loading import load_policy
from horizonrl.training.checkpoint import checkpoint_dir
from horizonrl.training.iteration import UpdatePlan
from horizonrl.training.sequences import TrainRow, attach_advantages, train_rows
from horizonrl.training.trainer import UpdateSettings, behaviour_weighted, recompute_old_logprobs
from methods.losses import PPOLossParams, ppo_clip
from mlflow import MlflowClient

MAIN = "configs/loop_household_easy.yaml"


@pytest.mark.parametrize(
    "overrides, names",
    [
        (["rollout.max_staleness=-1"], r"^config: rollout\.max_staleness must be greater than or equal to 0 \(got -1"),
        (
            ["rollout.max_staleness=1", "rollout.async_mode=eager"],
            r"^config: rollout\.async_mode must be 'fixed' or 'bounded' \(got 'eager'",
        ),
        (
            ["rollout.max_staleness=1", "rollout.runner=ray"],
            r"^config: rollout\.max_staleness needs rollout\.runner = 'local' \(not 'ray'\)",
        ),
    ],
)
def test_bad_staleness_settings_are_refused_naming_the_field(overrides, names):
    with pytest.raises(ValueError, match=names):
        load_config(MAIN, overrides)


def test_defaults_are_synchronous_and_keep_the_pi_old_path():
    cfg = load_config(MAIN, [])
    assert (cfg.rollout.max_staleness, cfg.rollout.async_mode) == (0, "fixed")
    s = UpdateSettings.from_config(cfg, 0, sampled_here=True)
    assert not s.decoupled and s.pi_old_tol == cfg.update.pi_old_tol
    stale = UpdateSettings.from_config(
        load_config(MAIN, ["rollout.max_staleness=1"]), 0, sampled_here=False, decoupled=True
    )
    assert stale.decoupled and stale.pi_old_tol is None, "rows of an older version: pi_old (pi_prox) recomputed"


@pytest.mark.parametrize("stale", [False, True])
@pytest.mark.parametrize(
    "overrides", [[], ["engine.name=vllm"], ["model.lora.rank=4"], ["rollout.runner=ray", "rollout.shards=2"]]
)
def test_the_learners_settings_for_an_updates_rows_are_the_configs(overrides, stale):
    """The learner's plan, built once at the run's start, adapted to one update's rows (``for_rows``) gives
    what ``UpdateSettings.from_config`` gives for those rows: the pi_old shortcut only for rows the learner's
    own weights sampled, the sampler measured only on vLLM, the decoupled objective for stale rows."""
    cfg = load_config(MAIN, ["method=drgrpo", *overrides])
    got = UpdatePlan.from_config(cfg, horizon=8).for_rows(7, stale).settings
    assert got == UpdateSettings.from_config(cfg, 7, sampled_here=not stale, decoupled=stale, horizon=8)


def _row(behav: list[float], adv: list[float]) -> TrainRow:
    n = len(behav)
    return TrainRow(1, -1, list(range(n + 1)), list(range(1, n + 1)), [[]] * n, behav, [0] * n, list(range(n)), adv)


def test_decoupled_loss_matches_the_hand_computed_objective():
    """AReaL's decoupled PPO loss, -mean_t w_t min(r_t A_t, clip(r_t) A_t) with w = pi_prox / pi_behav and
    r = pi_theta / pi_prox, computed by hand for 4 tokens, equals ppo_clip over the behaviour-weighted
    advantages; its gradient too. The clip acts on r alone: token 2 (r = 1.3, A > 0) is clipped at 1.1
    although its w is 0.5."""
    behav = [-1.0, -2.0, -0.5, -1.5]  # log pi_behav: the stored sampling log-probs of the playing version
    prox = [-1.2, -1.5, -0.5 + math.log(0.5), -1.5]  # log pi_prox: the learner before the update
    ratio = [1.0, 0.8, 1.3, 1.05]  # pi_theta / pi_prox
    adv = [1.0, -2.0, 0.5, 3.0]
    rows, figures = behaviour_weighted([_row(behav, adv)], [prox])
    w = [math.exp(p - b) for p, b in zip(prox, behav)]
    assert rows[0].adv == pytest.approx([a * x for a, x in zip(adv, w)], rel=1e-12)
    assert figures == pytest.approx({"behav_weight_mean": sum(w) / 4, "behav_weight_max": max(w)})
    lo, hi = 1 / 1.1, 1.1  # LOOP's clip range, eps 0.1
    by_hand = -sum(x * min(r * a, min(max(r, lo), hi) * a) for x, r, a in zip(w, ratio, adv)) / 4
    logp = torch.tensor([[p + math.log(r) for p, r in zip(prox, ratio)]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([prox], dtype=torch.float64)
    mask = torch.ones(1, 4, dtype=torch.bool)
    params = PPOLossParams(aggregation="token-mean")
    terms = ppo_clip(
        logp, old, torch.tensor([rows[0].adv], dtype=torch.float64), mask, torch.zeros(1, 4).long(), params
    )
    assert float(terms.loss.detach()) == pytest.approx(by_hand, rel=1e-12)
    terms.loss.backward()
    unclipped = [lo <= r <= hi or (r < lo and a > 0) or (r > hi and a < 0) for r, a in zip(ratio, adv)]
    grad = [-x * r * a / 4 if u else 0.0 for x, r, a, u in zip(w, ratio, adv, unclipped)]  # d/d log pi_theta
    assert logp.grad[0].tolist() == pytest.approx(grad, rel=1e-12)
    assert not unclipped[2], "token 2 is the clipped one"


def test_without_staleness_the_weight_is_exactly_one():
    """Rows played by the policy being trained (pi_behav = pi_prox): w = exp(0) = 1 and every advantage is
    bit-identical, so the decoupled loss is today's PPO loss exactly."""
    behav, adv = [-0.3, -1.7, -2.25], [0.1, -0.7, 1 / 3]
    rows, figures = behaviour_weighted([_row(behav, adv)], [list(behav)])
    assert rows[0].adv == adv and figures == {"behav_weight_mean": 1.0, "behav_weight_max": 1.0}


def _versions(root, run_name: str, iterations: int, kind: str = "episodes") -> dict[int, list[int]]:
    return {
        it: store.read_table(store.iteration_dir(root / "data", "test", run_name, it) / f"{kind}.parquet", kind)[
            "policy_version"
        ].to_pylist()
        for it in range(1, iterations + 1)
    }


@pytest.mark.slow
@pytest.mark.parametrize("method, mode", [("appo", "bounded"), ("blpo", "fixed")])
def test_branching_and_stateful_methods_run_asynchronously(prefect_harness, tmp_path, method, mode):
    """APPO's branches are played by their parent's version; BLPO's memory is carried in iteration (and so
    version) order; neither row is older than the bound. A bounded run is tagged as not reproducible."""
    from flows.train import train

    cfg = config(tmp_path, method, iterations=2, method=method, eval={"every": 10, "n_tasks": 2, "greedy": False})
    cfg["advantage_params"] = {}
    cfg["rollout"] = {**cfg["rollout"], "max_staleness": 1, "async_mode": mode}
    train(config=cfg)
    for it in (1, 2):
        ep = pq.read_table(store.iteration_dir(tmp_path / "data", "test", method, it) / "episodes.parquet")
        versions = dict(zip(ep["rollout_id"].to_pylist(), ep["policy_version"].to_pylist()))
        assert all(it - 2 <= v <= it - 1 for v in versions.values()), (it, versions)
        for rid, parent in zip(ep["rollout_id"].to_pylist(), ep["parent_rollout"].to_pylist()):
            if parent >= 0:
                assert versions[rid] == versions[parent], "a branch played by another version than its parent"
    run = run_of(MlflowClient(cfg["tracking_uri"]), method)
    assert run.info.status == "FINISHED"
    assert (run.data.tags.get("reproducible", "").startswith("false")) == (mode == "bounded")
    if method == "appo":
        kinds = pq.read_table(store.iteration_dir(tmp_path / "data", "test", method, 2) / "episodes.parquet")["kind"]
        assert "branch" in kinds.to_pylist(), "APPO played no branch: the check above proved nothing"
    if method == "blpo":
        assert (checkpoint_dir(run_dir(tmp_path, method), 2) / "estimator_state.json").is_file()


@pytest.mark.slow
def test_fixed_lag_rows_carry_their_version_weigh_their_behaviour_logprobs_and_resume_when_killed(
    api_url,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    """k = 1, fixed, 3 iterations, run straight in this process. Iteration i is played by checkpoint
    max(i-2, 0) (so 0, 0, 1), never more than one version behind the update's start; each stage logs at
    its own iteration; the generator holds its versions without optimizer state. The stored log-probs of
    iteration 3 are checkpoint 1's (recomputed within 1e-4, checkpoint 2's are not) and the update's logged
    mean behaviour weight is mean exp(log pi_prox - log pi_behav) over its rows, pi_prox = checkpoint 2.

    Beside it the same run as CLI processes: killed at the end of iteration 2's update, with the generator
    somewhere in iteration 3 (not started, playing, writing or done: timing decides), then killed after
    iteration 3's advantages, started a third time: it ends with the straight run's tables, weights and
    optimizer state. Kill points lie in the learner's stages, so each process is sure to be killed. One test
    for both, so the one straight run serves both checks."""
    from flows.train import train

    def cfg(name: str) -> dict:
        c = config(tmp_path, name, iterations=3, eval={"every": 10, "n_tasks": 2, "greedy": False})
        c["rollout"] = {**c["rollout"], "max_staleness": 1}
        return c

    first = start_cli(cfg("r"), api_url, tmp_path / "cli-0.log", "update:2")
    taken = []  # the optimizer held beside every version the generator played

    def watch(run):
        sync = run.generator.sync
        run.generator.sync = lambda policy, serving=None: (
            sync(policy, serving),
            taken.append(run.generator.weights.current.optimizer),
        )[0]

    built = built_owners(monkeypatch, watch)
    train(config=cfg("straight"))
    assert len(taken) >= 2 and all(o is None for o in taken), taken
    (run,) = built
    assert run.generator.weights is not run.learner.weights and run.collector is run.generator
    assert run.generator.weights.current is None, "the generator's copy is let go at the run's end"
    for n, fault in enumerate(("update:2", "advantage:3")):
        log = tmp_path / f"cli-{n}.log"
        rc = finish(first if n == 0 else start_cli(cfg("r"), api_url, log, fault))
        assert rc == -signal.SIGKILL, f"{fault}: not killed (rc {rc}):\n{log.read_text()[-3000:]}"
        assert newest_checkpoint(run_dir(tmp_path)).iteration < 3
    log = tmp_path / "cli-final.log"
    assert finish(start_cli(cfg("r"), api_url, log)) == 0, log.read_text()[-3000:]

    assert _versions(tmp_path, "straight", 3) == {1: [0] * 4, 2: [0] * 4, 3: [1] * 4}
    turn_versions = _versions(tmp_path, "straight", 3, "turns")  # every turn row of an episode: its version
    assert {it: set(v) for it, v in turn_versions.items()} == {1: {0}, 2: {0}, 3: {1}}
    c = MlflowClient(cfg("straight")["tracking_uri"])
    rid = run_of(c, "straight").info.run_id
    stale = {m.step: m.value for m in c.get_metric_history(rid, "async/staleness")}
    assert stale == {1: 0.0, 2: 1.0, 3: 1.0}
    for key in ("collect/success_rate", "update/steps", "async/learner_idle_fraction", "async/generator_idle_fraction"):
        assert steps(c, rid, key) == [1, 2, 3], key
    assert steps(c, rid, "update/behav_weight_mean") == [2, 3], "iteration 1 is played by the checkpoint it trains"
    assert all(0.0 <= m.value <= 1.0 for m in c.get_metric_history(rid, "async/learner_idle_fraction"))
    d = store.iteration_dir(tmp_path / "data", "test", "straight", 3)
    rows = attach_advantages(
        train_rows(store.read_table(d / "turns.parquet", "turns"), "window"),
        store.read_table(d / "advantages-loop.parquet", "advantages"),
    )
    model1, tok = load_policy(checkpoint_dir(run_dir(tmp_path, "straight"), 1))
    model2, _ = load_policy(checkpoint_dir(run_dir(tmp_path, "straight"), 2))
    s = UpdateSettings.from_config(TrainConfig.model_validate(cfg("straight")), tok.pad_token_id, sampled_here=False)
    behav = [v for r in rows for v in r.sample_logp]
    by1 = [v for part in recompute_old_logprobs(model1, rows, s) for v in part]
    by2 = [v for part in recompute_old_logprobs(model2, rows, s) for v in part]
    assert max(abs(a - b) for a, b in zip(by1, behav)) < 1e-4, "stored log-probs are the turn rows' version's"
    assert max(abs(a - b) for a, b in zip(by2, behav)) > 1e-3, "checkpoint 2 moved: the test could tell"
    want = sum(math.exp(p - b) for p, b in zip(by2, behav)) / len(behav)
    got = {m.step: m.value for m in c.get_metric_history(rid, "update/behav_weight_mean")}[3]
    assert got == pytest.approx(want, abs=1e-4) and abs(got - 1.0) > 1e-5

    a, b = run_dir(tmp_path, "straight"), run_dir(tmp_path)
    assert files(b) == files(a)
    for it in (1, 2, 3):
        da, db = (store.iteration_dir(tmp_path / "data", "test", name, it) for name in ("straight", "r"))
        for name in ("advantages-loop.parquet", "episodes.parquet", "turns.parquet"):
            drop = [c for c in ("run_name", "gen_s", "env_s") if c in pq.read_schema(da / name).names]
            assert pq.read_table(db / name).drop_columns(drop).equals(pq.read_table(da / name).drop_columns(drop)), (
                it,
                name,
            )
    ca, cb = checkpoint_dir(a, 3), checkpoint_dir(b, 3)
    assert_same_tensors(load_file(cb / "model.safetensors"), load_file(ca / "model.safetensors"), "weights")
    w0 = load_file(checkpoint_dir(a, 0) / "model.safetensors")
    assert any(not torch.equal(w0[k], v) for k, v in load_file(ca / "model.safetensors").items())
    opt_a, opt_b = (torch.load(c / "optimizer.pt", weights_only=True)["state"] for c in (ca, cb))
    for k in opt_a:
        assert_same_tensors(opt_b[k], opt_a[k], f"optimizer state of parameter {k}")
