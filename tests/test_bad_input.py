"""Bad input stops before any work: the error names the field or file, and nothing is written.

test_config.py and test_store.py check the messages of the loaders; here the same inputs go through the
``horizonrl`` command line and the train flow, and the test checks that no folder, store or file appeared.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from flowkit import newest_checkpoint, tiny_config

from flows.cli import main
from horizonrl import store

CONFIG = "config.yaml"


@pytest.mark.parametrize(
    "text,sets,names",
    [
        ("method: loop\nrollout: [group_size: 8\n", [], ["config.yaml' is not valid YAML"]),
        ("method: loop\ncolour: blue\n", [], ["colour", "Extra inputs are not permitted"]),
        ("rollout:\n  group_size: many\n", [], ["rollout.group_size", "valid integer"]),
        ("", ["update.lr=fast"], ["update.lr", "valid number"]),
        ("method: ppo9\n", [], ["method", "unknown method 'ppo9'"]),
        ("env:\n  name: minecraft\n", [], ["env.name = 'minecraft' is unknown"]),
        ("method: loop\nrollout:\n  group_size: 1\n", [], ["rollout.group_size = 1", "'loop' needs at least 2"]),
        ("model:\n  path: ./no-such-model\n", [], ["model.path", "'./no-such-model' does not exist"]),
        (
            "env:\n  tier: nightmare\n",
            [],
            ["env.tier = 'nightmare' is not a tier of household; allowed: easy, medium, hard"],
        ),
        ("", ["run_name=adv'q"], ["run_name", '"adv\'q" is not a plain name']),
        ("", ["run_name=../../escape"], ["run_name", "'../../escape' is not a plain name"]),
        ("", ["experiment=a/b"], ["experiment", "'a/b' is not a plain name"]),
        ("", ["update.lr=.inf"], ["update.lr", "finite number"]),
        ("", ["advantage_params.kl_lambda=.nan"], ["advantage_params.kl_lambda = nan: numbers must be finite"]),
        ("", ["seed=true"], ["seed", "True is not a valid integer"]),
        ("", ["rollout.group_size=2.5"], ["rollout.group_size", "2.5 is not a valid integer"]),
    ],
    ids=[
        "malformed-yaml",
        "unknown-key",
        "wrong-type",
        "wrong-type-set",
        "unknown-method",
        "unknown-env",
        "group-too-small",
        "missing-model",
        "unknown-tier",
        "quote-in-name",
        "path-traversal",
        "slash-in-experiment",
        "infinite-lr",
        "nan-param",
        "bool-seed",
        "float-int",
    ],
)
@pytest.mark.refuses_input
def test_bad_config_names_the_problem_and_writes_nothing(tmp_path, monkeypatch, capsys, text, sets, names):
    """Run from an empty folder, so a ``data/`` or ``mlflow/`` created by mistake would show."""
    monkeypatch.chdir(tmp_path)
    Path(CONFIG).write_text(text)
    assert main(["train", "--config", CONFIG, *(f"--set={s}" for s in sets)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("horizonrl: bad configuration:")
    for name in names:
        assert name in err
    assert [p.name for p in tmp_path.iterdir()] == [CONFIG]


@pytest.mark.refuses_input
def test_model_folder_without_config_json_is_named(tmp_path, monkeypatch, capsys):
    """A folder that is not a transformers model used to fail inside the tokenizer loader, naming neither."""
    monkeypatch.chdir(tmp_path)
    Path("weights").mkdir()
    assert main(["train", "--set=model.path=./weights"]) == 2
    err = capsys.readouterr().err
    assert "model.path" in err and "'weights/config.json'" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["weights"]


@pytest.mark.refuses_input
def test_recompute_param_without_equals_is_refused(tmp_path, capsys):
    assert main(["recompute", "--run-dir", str(tmp_path), "--method", "loop", "--param", "gamma"]) == 2
    assert "--param 'gamma': expected KEY=VALUE" in capsys.readouterr().err
    assert main(["recompute", "--run-dir", str(tmp_path), "--method", "loop", "--param", "gama=0.9"]) == 2
    assert "gama" in capsys.readouterr().err  # not a parameter of the estimator
    assert list(tmp_path.iterdir()) == []


@pytest.mark.refuses_input
def test_evaluate_unknown_source_is_one_line(tmp_path, monkeypatch, capsys):
    """An unknown run id or registered model is named in one line, before any flow starts or run is made."""
    from horizonrl.tracking.mlflow_runs import client

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    c = client(uri)  # an existing store, without the source
    capsys.readouterr()  # MLflow reports creating its tables
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    for source in (
        "0123456789abcdef0123456789abcdef",
        "runs:/0123456789abcdef0123456789abcdef",
        "models:/no-such-model/1",
    ):
        assert main(["evaluate", "--source", source]) == 2
        err = capsys.readouterr().err
        assert (
            err.startswith(f"horizonrl: evaluate: source {source!r}: no ")
            and uri in err
            and len(err.strip().splitlines()) == 1
        ), err
    assert c.search_runs([e.experiment_id for e in c.search_experiments()]) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlflow.db", "mlflow.db.lock"]


@pytest.mark.refuses_input
def test_empty_sweep_grid_names_the_grid_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    Path(CONFIG).write_text("iterations: 1\n")
    Path("sweep.yaml").write_text(f"name: empty\nbase: {CONFIG}\ngrid: {{}}\n")
    assert main(["sweep", "sweep.yaml"]) == 2
    assert "grid is empty" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == [CONFIG, "sweep.yaml"]


def _plant(d: Path, bad: str) -> Path:
    """Iteration 1's rollout tables as a crashed or older run might leave them: both present, one bad."""
    d.mkdir(parents=True)
    for kind, schema in (("episodes", store.EPISODES), ("turns", store.TURNS)):
        store.write_table(pa.table({n: [] for n in schema.names}, schema=schema), d / f"{kind}.parquet", kind)
    path = d / "turns.parquet"
    if bad == "truncated":
        path.write_bytes(path.read_bytes()[:-100])
    else:  # the same table as written by a version of the code with another schema version
        table = pq.read_table(path)
        pq.write_table(
            table.replace_schema_metadata({**table.schema.metadata, b"horizonrl.schema_version": b"0"}), path
        )
    return path


@pytest.mark.slow
@pytest.mark.parametrize(
    "bad,message",
    [("truncated", "not a readable Parquet file (truncated or corrupt)"), ("old-schema", "schema version '0'")],
    ids=["truncated", "old-schema"],
)
def test_bad_stored_rollouts_fail_the_run_naming_the_file(
    prefect_harness, tmp_path, tracking_uri, caplog, bad, message
):
    """Stored rollouts are reused on resume, so a bad stored file reaches the collect task: Prefect retries
    it, it fails again, the flow fails with the file's name in the error and the log, and nothing of
    iteration 1 is written (no advantages, no checkpoint, no metric) and the bad file is left as it was."""
    from flows.train import train

    cfg = tiny_config(tmp_path, tracking_uri, "bad", iterations=1)
    cfg["eval"] = {"every": 10, "n_tasks": 2, "greedy": False}
    d = store.iteration_dir(tmp_path / "data", "test", "bad", 1)
    path = _plant(d, bad)
    planted = path.read_bytes()
    caplog.set_level(logging.INFO)
    with pytest.raises(store.StoreError, match=str(path)):
        train(config=cfg)
    exhausted = [r.getMessage() for r in caplog.records if "Retries are exhausted" in r.getMessage()]
    assert len(exhausted) == 1 and "collect" in caplog.text, caplog.text[-3000:]  # collect was retried, then failed
    assert str(path) in exhausted[0] and message in exhausted[0]
    assert sorted(p.name for p in d.iterdir()) == ["episodes.parquet", "turns.parquet"] and path.read_bytes() == planted
    assert newest_checkpoint(tmp_path / "data" / "test" / "bad").iteration == 0


def test_recompute_checks_every_input_before_writing(prefect_harness, tmp_path, capsys):
    """A column dropped from a later iteration's episodes (schema metadata kept) is named with its file,
    and no earlier iteration's advantages are written; without the bad iteration the same command works."""
    run = tmp_path / "data" / "test" / "r"
    for it in (1, 2):
        d = store.iteration_dir(tmp_path / "data", "test", "r", it)
        d.mkdir(parents=True)
        for kind, schema in (("episodes", store.EPISODES), ("turns", store.TURNS)):
            store.write_table(pa.table({n: [] for n in schema.names}, schema=schema), d / f"{kind}.parquet", kind)
    bad = store.iteration_dir(tmp_path / "data", "test", "r", 2) / "episodes.parquet"
    table = pq.read_table(bad)
    pq.write_table(table.drop_columns(["status"]).replace_schema_metadata(table.schema.metadata), bad)
    assert main(["recompute", "--run-dir", str(run), "--method", "grpo"]) == 2  # before its flow and run
    err = capsys.readouterr().err
    assert f"{bad}: the 'episodes' table lacks column status" in err and "nothing was written" in err, err
    assert len(err.strip().splitlines()) == 1 and not list(tmp_path.rglob("*.db")), err
    assert not list(run.rglob("advantages-*")), "an iteration's advantages were written before the bad one was found"
    bad.unlink()
    assert main(["recompute", "--run-dir", str(run), "--method", "grpo"]) == 0
    assert [p.name for p in run.rglob("advantages-*")] == ["advantages-grpo.parquet"]


def test_filter_values_are_quoted_and_artifacts_go_beside_the_store(tmp_path, monkeypatch):
    """A name holding a quote is searched for, not parsed as filter syntax (names are validated, but
    every value put into a filter is quoted); a store given by URI keeps its artifacts beside it, not
    under whatever folder the process runs in."""
    from horizonrl.tracking import mlflow_runs

    work, store_dir = tmp_path / "cwd", tmp_path / "elsewhere"
    work.mkdir()
    monkeypatch.chdir(work)
    c = mlflow_runs.client(f"sqlite:///{store_dir}/mlflow.db")
    run_id = mlflow_runs.create_run(c, "test", "adv'q", {})
    assert mlflow_runs.find_run(c, "test", "adv'q").info.run_id == run_id
    assert mlflow_runs.find_run(c, "test", 'adv"q') is None
    with pytest.raises(ValueError, match="both quote characters"):
        mlflow_runs.find_run(c, "test", "a'b\"c")
    assert c.get_experiment_by_name("test").artifact_location == (store_dir / "artifacts").resolve().as_uri()
    assert list(work.iterdir()) == []
    c.set_terminated(run_id)  # runs end (the suite checks none is left RUNNING)


def test_disk_refusals_are_reported_in_one_line_and_other_errors_keep_their_traceback():
    """``horizonrl train`` reports a write the disk refused (full, read-only, over quota, a checkpoint that
    could not be written) in one line; any other error keeps its traceback, to be debugged."""
    import errno

    from flows.cli import _disk_error
    from horizonrl.training.checkpoint import CheckpointWriteError

    for code in (errno.ENOSPC, errno.EROFS, errno.EDQUOT):
        assert _disk_error(OSError(code, "refused"))
    assert _disk_error(CheckpointWriteError("could not write checkpoint x: disk full"))
    assert not _disk_error(OSError(errno.ENOENT, "missing")) and not _disk_error(ValueError("bug"))
