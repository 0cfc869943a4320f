"""A resumed run tells the truth about its settings (issue 41), and plays its own checkpoint 0 whatever
became of the model folder it started from; its logged policy loads without unpickling anything.

On main the second start below trained iteration 2 with the new learning rate silently: MLflow's params
still said ``iterations=1``, ``update.lr=0.001``, and ``config.yaml`` was overwritten, so nothing said what
iteration 1 ran with. Real flows (the session's Prefect harness), MLflow on SQLite, the tiny model.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
import yaml
from flowkit import run_of, tiny_config

import mlflow
from flows.cli import main
from horizonrl.run import config_history
from horizonrl.tracking import mlflow_runs
from mlflow import MlflowClient


def _household_row() -> dict:
    from horizonrl.envs.household import HouseholdSuite

    suite = HouseholdSuite(0)
    env = suite.make()
    obs, info = env.reset(suite.tasks("test", "easy", 1)[0])
    return {"goal": env.goal(), "observation": obs, "admissible": list(info["admissible_commands"])}


@pytest.mark.slow
def test_a_resume_with_changed_settings_is_refused_then_recorded(
    prefect_harness, tiny_policy_dir, tmp_path, tracking_uri, monkeypatch
):
    """Iteration 1 from a copy of the tiny model; the copy's weights are then cut in half (a model folder
    changed on disk). The same run with ``iterations=2`` and a new ``update.lr`` is refused naming the
    learning rate (exit 2, nothing touched); with ``--allow-change update.lr`` it resumes from its own
    checkpoints, trains iteration 2, and the change is in ``config-history.json`` (the first start's config
    kept) and in MLflow tags that say where the current values live."""
    from flows.train import train

    model = tmp_path / "model"
    shutil.copytree(tiny_policy_dir, model)
    cfg = tiny_config(tmp_path, tracking_uri, "resume-x", iterations=1)
    cfg["model"] = {"path": str(model)}
    cfg["eval"] = {"every": 1, "n_tasks": 2, "greedy": False}
    train(config=cfg)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])

    monkeypatch.chdir(tmp_path)
    Path("c.yaml").write_text(yaml.safe_dump(cfg))
    # stderr captured here, not with capsys: a flow run while capsys is active (the first train above) binds
    # Prefect's console log handler to capsys's stream, which closes with this test under later tests' flows
    with contextlib.redirect_stderr(io.StringIO()) as stderr:
        assert main(["train", "--config", "c.yaml", "--set=iterations=2", "--set=update.lr=0.5"]) == 2
    err = stderr.getvalue()
    assert "run 'resume-x' resumes with changed settings: update.lr 0.001 -> 0.5;" in err, err
    assert "--allow-change update.lr" in err and len(err.strip().splitlines()) == 1, err
    run_folder = tmp_path / "data" / "test" / "resume-x"
    assert not (run_folder / config_history.HISTORY_FILE).exists()

    changed = {**cfg, "iterations": 2, "update": {**cfg["update"], "lr": 0.5}}
    train(config=changed, allow_change=["update.lr"])  # the truncated model folder is not read again

    c = MlflowClient(tracking_uri)
    run = run_of(c, "resume-x")
    assert run.info.status == "FINISHED" and (run_folder / "checkpoints" / "iter=00002").is_dir()
    history = json.loads((run_folder / config_history.HISTORY_FILE).read_text())
    assert history["first"]["update"]["lr"] == 0.001 and history["first"]["iterations"] == 1
    assert history["changes"] == [
        {"iteration": 2, "field": "iterations", "old": "1", "new": "2"},
        {"iteration": 2, "field": "update.lr", "old": "0.001", "new": "0.5"},
    ]
    assert yaml.safe_load((run_folder / "config.yaml").read_text())["update"]["lr"] == 0.5
    assert run.data.params["update.lr"] == "0.001"  # MLflow keeps a param's first value ...
    tags = run.data.tags  # ... and the tags say what changed, when, and where the current value is
    assert tags["horizonrl.config.update.lr"] == "0.5" and tags["horizonrl.config.iterations"] == "2"
    assert tags[config_history.CHANGES_TAG].startswith("iteration 2: iterations 1 -> 2; iteration 2: update.lr")
    assert "The params hold the first start's values" in tags[config_history.CHANGES_TAG]
    assert config_history.HISTORY_FILE in {a.path for a in c.list_artifacts(run.info.run_id)}

    model_info = mlflow_runs.policy_models(c, run.info.run_id)[0]  # the newest policy, logged from code
    assert model_info.tags[mlflow_runs.POLICY_ITERATION_TAG] == "2"
    mlflow.set_tracking_uri(tracking_uri)
    local = Path(mlflow.artifacts.download_artifacts(f"models:/{model_info.model_id}", dst_path=str(tmp_path / "m")))
    assert not list(local.rglob("*.pkl")), "the logged policy holds a pickle"
    assert not list(local.rglob("optimizer.pt")), "the logged policy carries the optimizer's state"
    row = _household_row()
    [action] = mlflow.pyfunc.load_model(str(local)).predict(pd.DataFrame([row]))
    assert action in row["admissible"]

    # shortening the run below what it trained is refused in one line, nothing touched
    with contextlib.redirect_stderr(io.StringIO()) as stderr:
        shorter = ["train", "--config", "c.yaml", "--set=iterations=1", "--set=update.lr=0.5"]
        assert main([*shorter, "--allow-change=update.lr"]) == 2
    err = stderr.getvalue()
    assert err.strip() == (
        "horizonrl: run 'resume-x' not started: iterations = 1: run 'resume-x' has finished 2 already, and a run "
        "is not shortened below what it trained; give iterations >= 2, or another run_name (its checkpoint of "
        "any iteration can be evaluated with horizonrl evaluate --model <run folder>/checkpoints/iter=<n> "
        "--config <config>)"
    ), err
    assert yaml.safe_load((run_folder / "config.yaml").read_text())["iterations"] == 2


@pytest.mark.slow
def test_a_start_that_finished_no_iteration_is_started_afresh_by_the_corrected_command(
    prefect_harness, tmp_path, tracking_uri, monkeypatch
):
    """A start that fails in its first iteration (every gradient NaN, ``update.max_nan_skips=0``), then the
    corrected command (``max_nan_skips=20``): no resume to refuse and no --allow-change to give. The failed
    attempt's files move to ``failed-starts/1/``, its MLflow run is renamed ``<run>.failed-start-1`` and
    FAILED with what changed, and a new MLflow run of the name holds the new settings as params. On main the
    corrected command was refused as a resume with changed settings, and with --allow-change the params kept
    the failed start's value."""
    from flows.train import train

    cfg = tiny_config(tmp_path, tracking_uri, "fresh-x", iterations=1)
    cfg["eval"] = {"every": 1, "n_tasks": 2, "greedy": False}
    cfg["method"] = "grpo"  # keeps every row (|A| >= 0), so the update takes steps whatever the rewards
    failing = {**cfg, "update": {**cfg["update"], "max_nan_skips": 0}}
    monkeypatch.setenv("HORIZONRL_FAULT", "nan-grad:1")
    with pytest.raises(RuntimeError, match="max_nan_skips"):
        train(config=failing)
    monkeypatch.delenv("HORIZONRL_FAULT")
    c = MlflowClient(tracking_uri)
    first = run_of(c, "fresh-x")
    assert first.info.status == "FAILED" and first.data.params["update.max_nan_skips"] == "0"

    corrected = {**cfg, "update": {**cfg["update"], "max_nan_skips": 20}}
    train(config=corrected)
    run_folder = tmp_path / "data" / "test" / "fresh-x"
    aside = run_folder / config_history.FAILED_STARTS / "1"
    assert yaml.safe_load((aside / "config.yaml").read_text())["update"]["max_nan_skips"] == 0
    assert (aside / "checkpoints" / "iter=00000").is_dir() and (run_folder / "checkpoints" / "iter=00001").is_dir()
    old, new = c.get_run(first.info.run_id), run_of(c, "fresh-x")
    assert new.info.run_id != first.info.run_id and new.info.status == "FINISHED"
    assert new.data.params["update.max_nan_skips"] == "20"
    assert new.data.tags[mlflow_runs.REPLACES_TAG] == first.info.run_id
    assert old.info.status == "FAILED" and old.data.tags[mlflow_runs.RUN_NAME_TAG] == "fresh-x.failed-start-1"
    assert "update.max_nan_skips 0 -> 20" in old.data.tags[mlflow_runs.FAILURE_TAG]


def test_changes_are_named_by_field_sections_allow_them_and_a_retry_records_once(tmp_path):
    """An added key under an empty section is one field (not the section too); ``--allow-change update``
    allows every field under it; recording the same change twice (a retried start) keeps one entry."""
    from horizonrl.config import TrainConfig

    before = TrainConfig(run_name="r")
    after = TrainConfig(run_name="r", advantage_params={"normalize_std": True}, update={"lr": 0.5, "epochs": 2})
    changes = config_history.config_changes(before, after)
    assert [str(c) for c in changes] == [
        "advantage_params.normalize_std (unset) -> True",
        "update.epochs None -> 2",
        "update.lr 0.001 -> 0.5",
    ]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(before.model_dump()))
    # no iteration finished: a change starts the run afresh (no resume to refuse), one that only extends it resumes
    assert config_history.failed_start(tmp_path, after) == changes
    assert config_history.resume_changes(tmp_path, after, []) == []
    longer = TrainConfig(run_name="r", iterations=61)
    assert config_history.failed_start(tmp_path, longer) == []
    assert [str(c) for c in config_history.resume_changes(tmp_path, longer)] == ["iterations 60 -> 61"]
    (tmp_path / "checkpoints" / "iter=00001").mkdir(parents=True)
    with pytest.raises(config_history.ConfigChangeRefused, match="advantage_params.normalize_std"):
        config_history.resume_changes(tmp_path, after, ["update"])
    assert config_history.resume_changes(tmp_path, after, ["update", "advantage_params"]) == changes
    for _ in range(2):
        history = config_history.record(tmp_path, before.model_dump(), changes, 3)
    assert len(json.loads(history.read_text())["changes"]) == 3
