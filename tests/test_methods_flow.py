"""GiGPO, BLPO, REINFORCE++-baseline and APPO's branching settings from the config through the real train
flow; BLPO memory as state; recomputing advantages offline through the train flow's own write path."""

from __future__ import annotations

import json

import pandas as pd
import pyarrow.parquet as pq
import pytest
from flowkit import run_of, steps, tiny_config

import methods
from horizonrl import store
from horizonrl.config import TrainConfig
from horizonrl.files import file_digest
from mlflow import MlflowClient

pytestmark = pytest.mark.slow


def method_config(tmp_path, uri, method: str, run_name: str, iterations: int) -> dict:
    cfg = tiny_config(tmp_path, uri, run_name, iterations)
    cfg["method"] = method
    cfg["rollout"] = {"tasks_per_iteration": 2, "group_size": 3}
    return cfg


@pytest.mark.parametrize("method", ["gigpo", "blpo"])
def test_step_level_methods_run_through_the_flow(prefect_harness, tmp_path, tracking_uri, method):
    from flows.train import train

    train(config=method_config(tmp_path, tracking_uri, method, method, 2))
    c = MlflowClient(tracking_uri)
    run = run_of(c, method)
    assert steps(c, run.info.run_id, "advantage/kept_fraction") == [1, 2]
    assert steps(c, run.info.run_id, "update/steps") == [1, 2]
    for key in (
        "adv_mean",
        "adv_abs_mean",
        "trajectories",
        "groups",
        "zero_group_fraction",
    ):  # LOOP's names, every method
        assert steps(c, run.info.run_id, f"advantage/{key}") == [1, 2], key
    if method == "blpo":
        assert steps(c, run.info.run_id, "advantage/blpo/memory_keys") == [1, 2]
        d = store.iteration_dir(tmp_path / "data", "test", method, 2)
        payload = json.loads((d / "estimator_state-blpo.json").read_text())
        params = TrainConfig.model_validate(method_config(tmp_path, tracking_uri, method, method, 2)).advantage_spec()[
            1
        ]
        memory = methods.state_from_json("blpo", payload, params)
        frame = pd.DataFrame(memory.records())
        assert len(frame) == len(memory) > 0, "household's first turn gives every task group an eligible exact group"
        assert {"role", "action", "W", "mean"} <= set(frame.columns)
        assert frame["role"].str.startswith("role_v1|").all()
        assert any(a.path == "estimator_state" for a in c.list_artifacts(run.info.run_id))


def test_blpo_resume_gives_bit_identical_advantages(prefect_harness, tmp_path, tracking_uri):
    from flows.train import train

    train(config=method_config(tmp_path, tracking_uri, "blpo", "straight", 2))
    train(config=method_config(tmp_path, tracking_uri, "blpo", "stopped", 1))
    train(config=method_config(tmp_path, tracking_uri, "blpo", "stopped", 2))
    a = pq.read_table(store.iteration_dir(tmp_path / "data", "test", "straight", 2) / "advantages-blpo.parquet")
    b = pq.read_table(store.iteration_dir(tmp_path / "data", "test", "stopped", 2) / "advantages-blpo.parquet")
    assert a.num_rows > 0
    assert a["adv"].to_pylist() == b["adv"].to_pylist()  # exact equality, not approximate
    assert a["keep"].to_pylist() == b["keep"].to_pylist()


def test_recompute_other_method_over_stored_rollouts(prefect_harness, tmp_path, tracking_uri):
    from flows.recompute import recompute_advantages
    from flows.train import train

    train(config=tiny_config(tmp_path, tracking_uri, "source", 2))
    run_dir = tmp_path / "data" / "test" / "source"
    before = {str(p.relative_to(run_dir)): file_digest(p) for p in run_dir.glob("iter=*/*.parquet")}
    written = recompute_advantages(str(run_dir), "gigpo")
    assert sorted(written) == [1, 2]
    for it in (1, 2):
        d = store.iteration_dir(tmp_path / "data", "test", "source", it)
        table = store.read_table(d / "advantages-gigpo.parquet", "advantages")
        turns = store.read_table(d / "turns.parquet", "turns")
        assert table.num_rows == turns.num_rows
    after = {
        str(p.relative_to(run_dir)): file_digest(p) for p in run_dir.glob("iter=*/*.parquet") if "gigpo" not in p.name
    }
    assert after == before, "recomputing must not touch the original rollouts or advantages"
    c = MlflowClient(tracking_uri)
    recomputed, source = run_of(c, "source--recompute-gigpo"), run_of(c, "source")
    assert recomputed.data.tags["horizonrl.source_run_id"] == source.info.run_id
    assert steps(c, recomputed.info.run_id, "advantage/zero_group_fraction") == [1, 2]
    recompute_advantages(str(run_dir), "gigpo")
    assert steps(c, recomputed.info.run_id, "advantage/zero_group_fraction") == [1, 2], "a rerun logs no step twice"


def test_reinforce_pp_baseline_trains_and_recompute_writes_the_same_table(prefect_harness, tmp_path, tracking_uri):
    """REINFORCE++-baseline is a method (``method=``), with its KL term to the reference policy; recomputing
    it over the stored rollouts goes through the same write path and gives the same file, byte for byte."""
    from flows.recompute import recompute_advantages
    from flows.train import train

    train(config=method_config(tmp_path, tracking_uri, "reinforce_pp_baseline", "rpp", 1))
    c = MlflowClient(tracking_uri)
    run = run_of(c, "rpp")
    assert steps(c, run.info.run_id, "update/steps") == [1] and run.data.params["method"] == "reinforce_pp_baseline"
    path = store.iteration_dir(tmp_path / "data", "test", "rpp", 1) / "advantages-reinforce_pp_baseline.parquet"
    trained = file_digest(path)
    table = store.read_table(path, "advantages")
    assert table.num_rows > 0 and all(
        table["keep"].to_pylist()
    )  # no |A| filter by default (LOOP's drops equal-return groups)
    assert recompute_advantages(str(tmp_path / "data" / "test" / "rpp"), "reinforce_pp_baseline") == {1: str(path)}
    assert file_digest(path) == trained


def test_appo_branching_params_from_the_config_reach_the_planner(prefect_harness, tmp_path, tracking_uri):
    """``per_method.appo.branching_params`` set in the config: with ``omega_fallback: none`` a constant Omega
    gives BS = 0, so no strict branch point and no fallback count (the default falls back on every rollout)."""
    from flows.train import train

    cfg = method_config(tmp_path, tracking_uri, "appo", "appo-none", 1)
    cfg["per_method"] = {"appo": {"branching_params": {"omega_fallback": "none"}}}
    train(config=cfg)
    c = MlflowClient(tracking_uri)
    metrics = run_of(c, "appo-none").data.metrics
    assert metrics["collect/appo/omega_fallback_fraction"] == 0.0 and metrics["collect/appo/branch_strict"] == 0.0
    assert metrics["collect/appo/branches_per_group"] == 3.0  # the budget (group_size) is still played
