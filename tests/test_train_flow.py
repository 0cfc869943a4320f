"""End-to-end: the real Prefect ``train`` flow on ``household`` with real MLflow (SQLite) and Parquet.

Tiny sizes (2 tasks x 2 rollouts, 4 turns) keep each run to seconds; what is checked is the plumbing:
every stage's metrics at every iteration, inputs, the episode table, the model, resume and kill/resume.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from horizonrl import store
from flowkit import flat, run_of, steps, tiny_config

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]


def test_train_flow_logs_every_stage(prefect_harness, tmp_path, tracking_uri):
    from flows.train import train

    summary = train(config=tiny_config(tmp_path, tracking_uri))
    assert set(summary) >= {"initial_success_rate", "final_success_rate", "improvement"}
    c = MlflowClient(tracking_uri)
    run = run_of(c, "e2e")
    assert run.data.params["method"] == "loop" and run.data.params["rollout.group_size"] == "2"
    assert run.data.tags["method"] == "loop" and run.data.tags["seed"] == "3" and len(run.data.tags["git_commit"]) >= 7
    for key in ("collect/success_rate", "advantage/kept_fraction", "update/steps", "time/iteration_s"):
        assert steps(c, run.info.run_id, key) == [1, 2], key
    assert steps(c, run.info.run_id, "eval/success_rate") == [0, 1, 2]
    inputs = {d.dataset.name for d in run.inputs.dataset_inputs}
    assert {"iter=1/turns", "iter=1/episodes", "iter=2/advantages-loop"} <= inputs
    artifacts = {a.path for a in c.list_artifacts(run.info.run_id, "episodes")}
    assert "episodes/eval_iter_00002.json" in artifacts
    from flows.evaluate import config_of_run
    from horizonrl.config import TrainConfig

    assert config_of_run(c, run.info.run_id) == TrainConfig.model_validate(tiny_config(tmp_path, tracking_uri))  # what `evaluate` reloads
    assert run.info.status == "FINISHED"
    import mlflow

    mlflow.set_tracking_uri(tracking_uri)
    models = mlflow.search_logged_models(experiment_ids=[run.info.experiment_id], output_format="list")
    assert any(m.source_run_id == run.info.run_id for m in models)
    run_dir = tmp_path / "data" / "test" / "e2e"
    for it in (1, 2):
        d = store.iteration_dir(tmp_path / "data", "test", "e2e", it)
        episodes = store.read_table(d / "episodes.parquet", "episodes")
        assert episodes.num_rows == 4 and set(episodes["iteration"].to_pylist()) == {it}
        store.read_table(d / "turns.parquet", "turns")
        store.read_table(d / "advantages-loop.parquet", "advantages")
    assert (run_dir / "checkpoints" / "iter=00002" / "model.safetensors").is_file()


def test_rerun_resumes_after_last_iteration(prefect_harness, tmp_path, tracking_uri):
    from flows.train import train

    train(config=tiny_config(tmp_path, tracking_uri, "resume", iterations=1))
    first = store.iteration_dir(tmp_path / "data", "test", "resume", 1) / "episodes.parquet"
    digest = store.file_digest(first)
    train(config=tiny_config(tmp_path, tracking_uri, "resume", iterations=3))
    c = MlflowClient(tracking_uri)
    run = run_of(c, "resume")
    assert store.file_digest(first) == digest, "a completed iteration was rewritten"
    assert steps(c, run.info.run_id, "collect/success_rate") == [1, 2, 3]
    assert steps(c, run.info.run_id, "update/steps") == [1, 2, 3]


def test_kill_during_iteration_then_resume(tmp_path, tracking_uri):
    """SIGKILL the CLI while iteration 2 is in progress; a second start finishes with no duplicate or
    partial iteration and continues the same MLflow run."""
    cfg = tiny_config(tmp_path, tracking_uri, "killed", iterations=3)
    sets = [f"--set={k}={v}" for k, v in flat(cfg).items()]
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    cmd = [sys.executable, "-m", "flows.cli", "train", *sets]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    marker = store.iteration_dir(tmp_path / "data", "test", "killed", 2) / "turns.parquet"
    deadline = time.time() + 240
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert marker.exists(), "the run never reached iteration 2"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    root = tmp_path / "data" / "test" / "killed"
    assert sorted(p.name for p in root.glob("iter=*")) == ["iter=00001", "iter=00002", "iter=00003"]
    assert not list(root.rglob("*.tmp*")), "a temporary (partial) file was left behind"
    for it in (1, 2, 3):
        d = store.iteration_dir(tmp_path / "data", "test", "killed", it)
        assert store.read_table(d / "episodes.parquet", "episodes").num_rows == 4
    c = MlflowClient(tracking_uri)
    run = run_of(c, "killed")
    assert steps(c, run.info.run_id, "update/steps") == [1, 2, 3]
