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
        (
            "method: loop\nrollout: [group_size: 8\n",
            [],
            ["config: file 'config.yaml' line 3, column 1: expected ',' or ']'"],
        ),
        ("method: loop\ncolour: blue\n", [], ["config: colour is not a field of the config", "in config.yaml line 2"]),
        ("rollout:\n  group_size: many\n", [], ["config: rollout.group_size is not an integer", "(got 'many' in"]),
        ("", ["update.lr=fast"], ["config: update.lr must be a valid number", "(got 'fast' from --set)"]),
        ("method: ppo9\n", [], ["config: method is not a method; known:", "(got 'ppo9' in config.yaml line 1)"]),
        ("env:\n  name: minecraft\n", [], ["config: env.name is not an environment; known:", "(got 'minecraft'"]),
        (
            "method: loop\nrollout:\n  group_size: 1\n",
            [],
            [
                "config: rollout.group_size is too small: method 'loop' needs at least 2",
                "(got 1 in config.yaml line 3)",
            ],
        ),
        ("model:\n  path: ./no-such-model\n", [], ["config: model.path is not a folder here", "'./no-such-model'"]),
        (
            "env:\n  tier: nightmare\n",
            [],
            ["config: env.tier is not a tier of household; allowed: easy, medium, hard (got 'nightmare' in"],
        ),
        ("", ["run_name=adv'q"], ["config: run_name is not a plain name", '(got "adv\'q" from --set)']),
        ("", ["run_name=../../escape"], ["config: run_name is not a plain name", "(got '../../escape' from --set)"]),
        ("", ["experiment=a/b"], ["config: experiment is not a plain name", "(got 'a/b' from --set)"]),
        ("", ["update.lr=.inf"], ["config: update.lr must be a finite number (got inf from --set)"]),
        ("", ["advantage_params.kl_lambda=.nan"], ["config: advantage_params.kl_lambda must be a finite number"]),
        ("", ["seed=true"], ["config: seed is not an integer", "(got True from --set)"]),
        ("", ["rollout.group_size=2.5"], ["config: rollout.group_size is not an integer", "(got 2.5 from --set)"]),
        ("", ["iterations=0"], ["config: iterations must be greater than or equal to 1 (got 0 from --set)"]),
        ("", ["update.lr=-0.1"], ["config: update.lr must be greater than 0 (got -0.1 from --set)"]),
        ("rollout:\n\tgroup_size: 4\n", [], ["config: file 'config.yaml' line 2, column 1: found character"]),
        ("", ["model.path=nosuchmodel"], ["config: model.path is neither a folder here nor a known pretrained model"]),
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
        "zero-iterations",
        "negative-lr",
        "yaml-tab",
        "unknown-model-name",
    ],
)
@pytest.mark.refuses_input
def test_bad_config_names_the_problem_and_writes_nothing(tmp_path, monkeypatch, capsys, text, sets, names):
    """One line per problem, ``horizonrl: config: <field> <problem> (got <value> ...)``, no traceback, no URL, no
    ``^`` marker. Run from an empty folder, so a ``data/`` or ``mlflow/`` created by mistake would show."""
    monkeypatch.chdir(tmp_path)
    Path(CONFIG).write_text(text)
    assert main(["train", "--config", CONFIG, *(f"--set={s}" for s in sets)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("horizonrl: config: ") and len(err.strip().splitlines()) == 1, err
    assert not any(word in err for word in ("Traceback", "pydantic", "http", "^")), err
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
    assert err.startswith("horizonrl: config: model.path holds no config.json") and len(err.strip().splitlines()) == 1
    assert "'weights/config.json'" in err, err
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
    """``horizonrl train`` (and a flow run's state) reports a write the disk refused (full, read-only, over
    quota, a checkpoint that could not be written) and a refused start in one line; any other error keeps its
    traceback, to be debugged."""
    import errno

    from horizonrl.config import ConfigError
    from horizonrl.run.preflight import PreflightError
    from horizonrl.training.checkpoint import CheckpointWriteError
    from tasks.failures import known_failure

    for code in (errno.ENOSPC, errno.EROFS, errno.EDQUOT):
        assert known_failure(OSError(code, "refused"))
    assert known_failure(CheckpointWriteError("could not write checkpoint x: disk full"))
    assert known_failure(ConfigError(["config: x must be y"])) and known_failure(PreflightError("model.path"))
    assert not known_failure(OSError(errno.ENOENT, "missing")) and not known_failure(ValueError("bug"))


def test_the_command_line_says_its_version_and_helps_without_markup(capsys):
    """``--version`` names the installed version (and the checkout's commit); the top-level help has no
    reStructuredText markup; ``show --iteration`` and the ``stack`` actions say what they are."""
    from importlib import metadata

    for args in (["--version"], ["--help"], ["show", "--help"], ["stack", "--help"]):
        with pytest.raises(SystemExit) as stop:
            main(args)
        assert stop.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"horizonrl {metadata.version('horizonrl')}")
    assert "``" not in out
    assert "the stored iteration (iter=<n>; 0 holds the first evaluation)" in " ".join(out.split())
    assert "up: start the servers and the worker" in " ".join(out.split())
