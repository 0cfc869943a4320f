"""``horizonrl evaluate`` on anything (issue 33): a policy trained on a user's games scored on an outside
game through ``--set``; bad input refused in one line before any run exists; a failure after the run
exists marks it FAILED with the cause; a killed evaluation is marked by the next one; evaluation episodes
stored in Parquet and traced with their game; params true to the run.

Real flows (the session's Prefect harness), MLflow on SQLite, games made with ``tw-make``.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess

import pytest
from flowkit import cli_run, run_of, tiny_config

from flows.cli import main
from horizonrl import faults, store
from horizonrl.envs.textworld_env import tw_make_path
from mlflow import MlflowClient

pytestmark = pytest.mark.extra  # games made with TextWorld's tw-make

SOURCE = "tw-source"


def _tw_make(*args: str) -> None:
    done = subprocess.run([tw_make_path(), *args, "--silent", "-f"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.fixture(scope="module")
def world(tmp_path_factory, prefect_harness) -> dict:
    """Two ``tw-make custom`` games (g1 train, g2 test), an outside cooking game, and a finished one-iteration
    run trained on the two (its policy logged), in a store of this module."""
    from flows.train import train

    root = tmp_path_factory.mktemp("evaluate")
    games = root / "games"
    games.mkdir()
    for seed in (1, 2):
        _tw_make(
            "custom",
            "--world-size",
            "2",
            "--nb-objects",
            "3",
            "--quest-length",
            "2",
            "--seed",
            str(seed),
            "--output",
            str(games / f"g{seed}.z8"),
        )
    (games / "splits.yaml").write_text("train: [g1.z8]\ntest: [g2.z8]\n")
    outside = root / "outside" / "cook3.z8"
    _tw_make(
        "tw-cooking",
        *("--recipe", "2", "--take", "2", "--go", "1", "--open", "--cook", "--cut", "--split", "test"),
        *("--seed", "3", "--output", str(outside)),
    )
    uri = f"sqlite:///{root}/mlflow.db"
    cfg = tiny_config(root, uri, SOURCE, iterations=1)
    cfg["env"] = {"name": "textworld-coin", "games": str(games), "max_turns": 4}
    cfg["eval"] = {"every": 1, "n_tasks": 1, "greedy": False}
    train(config=cfg)
    return {"root": root, "uri": uri, "games": games, "outside": outside, "source": run_of(MlflowClient(uri), SOURCE)}


def _evaluations(c: MlflowClient) -> list:
    exp = c.get_experiment_by_name("test")
    return c.search_runs([exp.experiment_id], filter_string="tags.`horizonrl.kind` = 'evaluation'")


def _no_run_left_running(c: MlflowClient) -> None:
    runs = c.search_runs([e.experiment_id for e in c.search_experiments()])
    assert [r.info.run_name for r in runs if r.info.status == "RUNNING"] == []


@pytest.mark.slow
def test_a_policy_is_scored_on_an_outside_game_and_the_records_are_true(world, monkeypatch, caplog):
    """``--set env.name/env.games/eval.*`` evaluate the source's policy on the outside cooking game (one
    game file): a FINISHED run whose params name the games, the horizon used and the policy folder's
    tokenizer; its episodes in Parquet (kind eval / eval_greedy, the game and seeds in each row) and its
    traces naming the game. The source run stored its own evaluations beside its rollouts and logged
    no ``greedy nan`` (greedy was off)."""
    c = MlflowClient(world["uri"])
    monkeypatch.setenv("MLFLOW_TRACKING_URI", world["uri"])
    source = world["source"]
    with caplog.at_level(logging.INFO):
        rc = main(
            ["evaluate", "--source", source.info.run_id]
            + ["--set=env.name=textworld-cooking", f"--set=env.games={world['outside']}"]
            + ["--set=eval.n_tasks=1", "--set=eval.greedy=true", "--set=env.max_turns=30"]
        )
    assert rc == 0
    said = [r.getMessage() for r in caplog.records if "eval: success" in r.getMessage()]
    assert said and all("(greedy " in m and "nan" not in m for m in said), said  # greedy on: named
    [run] = _evaluations(c)
    assert run.info.status == "FINISHED" and run.data.tags["horizonrl.source_run_id"] == source.info.run_id
    params = run.data.params
    assert params["env.games"] == str(world["outside"]) and params["env.horizon"] == "30"
    assert params["model.tokenizer"] != "word" and "WordPiece" in params["model.tokenizer"]
    d = world["root"] / "data" / "test" / run.info.run_name / "iter=00001"
    for kind in ("eval", "eval_greedy"):
        rows = store.read_table(d / f"{kind}-episodes.parquet", "episodes").to_pylist()
        assert [(r["kind"], r["family"], r["split"]) for r in rows] == [(kind, "cook3.z8", "test")]
        assert rows[0]["task_seed"] == 0 and rows[0]["n_turns"] >= 1
        assert store.read_table(d / f"{kind}-turns.parquet", "turns").num_rows == rows[0]["n_turns"]
    traces = c.search_traces(locations=[run.info.experiment_id], run_id=run.info.run_id)
    assert traces and {t.info.tags["game"] for t in traces} == {"cook3.z8"}

    src = world["root"] / "data" / "test" / SOURCE
    for it in (0, 1):  # before the first iteration and after the last, beside the rollouts
        evaluated = store.read_table(src / f"iter={it:05d}" / "eval-episodes.parquet", "episodes")
        assert evaluated["family"].to_pylist() == ["g2.z8"] and evaluated["kind"].to_pylist() == ["eval"]
    assert not (src / "iter=00001" / "eval_greedy-episodes.parquet").exists()
    assert source.data.params["env.horizon"] == "4" and source.data.params["model.tokenizer"] == "word"
    _no_run_left_running(c)


@pytest.mark.slow
@pytest.mark.parametrize(
    "args,names",
    [
        (["--split", "dev"], ["--split 'dev'", "no game falls in split 'dev'"]),
        (["--split", "valid"], ["--split 'valid'", "split must be one of ('train', 'dev', 'test')"]),
        (["--set", "method=grpo"], ["--set method: not a field evaluate can change", "allowed: env.*"]),
        (["--set", "update.lr=0.1"], ["--set update.lr: not a field evaluate can change"]),
        (["--set", "eval.n_tasks=0"], ["eval.n_tasks", "greater than or equal to 1"]),
        (["--set", "env.games"], ["--set 'env.games': expected key=value"]),
        (["--set", "env.games=/no/such/games"], ["env.games = '/no/such/games': no such folder or game file"]),
        (["--set", "env.tier=nightmare", "--set", "env.max_turns=null"], ["config: env.tier is not a tier of"]),
        (["--n-tasks", "0"], ["--n-tasks 0: must be at least 1"]),
    ],
    ids=["no-dev-split", "unknown-split", "method", "update", "zero-tasks", "no-equals", "missing-games", "tier", "n0"],
)
@pytest.mark.refuses_input
def test_bad_evaluate_input_is_one_line_and_creates_no_run(world, monkeypatch, capsys, args, names):
    c = MlflowClient(world["uri"])
    monkeypatch.setenv("MLFLOW_TRACKING_URI", world["uri"])
    before = {r.info.run_id for r in _evaluations(c)}
    capsys.readouterr()
    assert main(["evaluate", "--source", world["source"].info.run_id, *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("horizonrl: evaluate: ") and len(err.strip().splitlines()) == 1, err
    for name in names:
        assert name in err, err
    assert {r.info.run_id for r in _evaluations(c)} == before


@pytest.mark.slow
def test_a_policy_that_cannot_spell_the_games_is_refused_before_its_run(world, monkeypatch, capsys):
    """A household policy's tokenizer has no character fallback (household's text is closed), so on the
    outside cooking game two commands get the same ids. On main this failed after the run existed (exit 1,
    a FAILED run); the preflight plays the split's first reset and refuses it in one line, exit 2, no run."""
    from flows.train import train

    c = MlflowClient(world["uri"])
    monkeypatch.setenv("MLFLOW_TRACKING_URI", world["uri"])
    cfg = tiny_config(world["root"], world["uri"], "household-source", iterations=1)
    cfg["eval"] = {"every": 1, "n_tasks": 1, "greedy": False}
    train(config=cfg)
    source = run_of(c, "household-source")
    before = {r.info.run_id for r in _evaluations(c)}
    capsys.readouterr()
    rc = main(
        ["evaluate", "--source", source.info.run_id, "--set=env.name=textworld-cooking"]
        + [f"--set=env.games={world['outside']}", "--set=eval.n_tasks=1", "--set=env.max_turns=3"]
    )
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1, err[-3000:]
    assert err.startswith("horizonrl: evaluate: env.name = 'textworld-cooking': the policy's tokenizer cannot spell")
    assert "have the same token ids" in err, err
    assert {r.info.run_id for r in _evaluations(c)} == before
    _no_run_left_running(c)


@pytest.mark.slow
def test_a_failure_after_the_run_exists_marks_it_failed_with_the_cause(world, tmp_path, monkeypatch, capsys):
    """The evaluation's tables cannot be written (its experiment folder under ``data_dir`` is a file): the
    run exists by then, so it fails at run time (exit 1, one line, no traceback) and its run is FAILED with
    the cause."""
    c = MlflowClient(world["uri"])
    monkeypatch.setenv("MLFLOW_TRACKING_URI", world["uri"])
    data = tmp_path / "data"
    data.mkdir()
    (data / "test").write_text("a file where the experiment's folder goes\n")
    before = {r.info.run_id for r in _evaluations(c)}
    capsys.readouterr()
    rc = main(["evaluate", "--source", world["source"].info.run_id, "--set=eval.n_tasks=1", f"--set=data_dir={data}"])
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("horizonrl: evaluate failed: ") and str(data / "test") in last, last
    [run] = [r for r in _evaluations(c) if r.info.run_id not in before]
    assert run.info.status == "FAILED" and str(data / "test") in run.data.tags["horizonrl.failure"]
    _no_run_left_running(c)


@pytest.mark.slow
def test_a_killed_evaluation_is_marked_by_the_next_one(world, monkeypatch, caplog, tmp_path):
    """SIGKILL in the evaluate stage (``HORIZONRL_FAULT=evaluate:1``: episodes played and stored, nothing
    logged): the run stays RUNNING, as a killed process cannot mark it. The same command run again
    finishes and marks the killed run KILLED, naming its process; no run is left RUNNING."""
    from prefect.settings import PREFECT_API_URL

    c = MlflowClient(world["uri"])
    monkeypatch.setenv("MLFLOW_TRACKING_URI", world["uri"])
    before = {r.info.run_id for r in _evaluations(c)}
    command = ["evaluate", "--source", world["source"].info.run_id, "--set=eval.n_tasks=1"]
    env = {**os.environ, faults.ENV: "evaluate:1", "PREFECT_API_URL": PREFECT_API_URL.value()}
    done = cli_run(command, env, tmp_path / "cli-logs")
    assert done.returncode == -9, done.stderr[-3000:]
    [killed] = [r for r in _evaluations(c) if r.info.run_id not in before]
    assert killed.info.status == "RUNNING"
    assert killed.data.tags["horizonrl.process"].partition(":")[0] == socket.gethostname()
    with caplog.at_level(logging.INFO):
        assert main(command) == 0
    said = [r.getMessage() for r in caplog.records if "eval: success" in r.getMessage()]
    assert said and not any("nan" in m or "greedy" in m for m in said), said  # greedy off: not named
    killed = c.get_run(killed.info.run_id)
    assert killed.info.status == "KILLED" and "killed" in killed.data.tags["horizonrl.failure"]
    again = [r for r in _evaluations(c) if r.info.run_id not in before and r.info.run_id != killed.info.run_id]
    assert [r.info.status for r in again] == ["FINISHED"]
    assert again[0].data.metrics["eval/success_rate"] in (0.0, 1.0)
    _no_run_left_running(c)


def test_evaluate_settable_fields_are_fields_of_the_config():
    """Every ``EVAL_SETTABLE`` entry names a section or field the config has, so none is a dead name."""
    from horizonrl.config import TrainConfig
    from tasks.evaluation_run import EVAL_SETTABLE

    flat = TrainConfig().flat()
    for entry in EVAL_SETTABLE:
        assert any(k == entry or k.startswith(entry) for k in flat) or entry in ("data_dir",), entry


def _model_config(tmp_path, uri: str) -> str:
    """A household config file for evaluating a model with no run behind it (the listed prompt)."""
    import yaml

    cfg = tiny_config(tmp_path, uri, "baseline")
    cfg["rollout"].update(prompt="listed", context="window")
    cfg["eval"].update(greedy=False)
    path = tmp_path / "baseline.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


@pytest.mark.slow
def test_a_model_folder_is_evaluated_without_a_run_behind_it(
    prefect_harness, chat_model_dir, tmp_path, tracking_uri, monkeypatch
):
    """``--model FOLDER --config FILE``: a FINISHED evaluation run named after the folder, tagged with its
    lineage (the path as given, the folder and the digest of its files) and no source run; params hold the
    config's prompt; the success rate's 95% Wilson interval is logged and brackets it. The store is the one
    ``--set tracking_uri`` names, not the environment's (on main the environment's won, silently)."""
    from horizonrl.files import folder_digest
    from horizonrl.tracking.stats import wilson

    folder = chat_model_dir("llama3")
    elsewhere = f"sqlite:///{tmp_path}/elsewhere.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", elsewhere)
    config = _model_config(tmp_path, elsewhere)
    rc = main(
        ["evaluate", "--model", str(folder), "--config", config, "--n-tasks", "3", f"--set=tracking_uri={tracking_uri}"]
    )
    assert rc == 0
    assert not (tmp_path / "elsewhere.db").exists(), "the evaluation went to the environment's store"
    c = MlflowClient(tracking_uri)
    [run] = _evaluations(c)
    tags, metrics = run.data.tags, run.data.metrics
    assert run.info.status == "FINISHED" and run.info.run_name.startswith(f"{folder.name}--eval-test-")
    assert "horizonrl.source_run_id" not in tags and tags["horizonrl.policy_uri"] == str(folder)
    assert tags["horizonrl.init.model"] == str(folder) and tags["horizonrl.init.folder"] == str(folder.resolve())
    assert tags["horizonrl.init.folder_digest"] == folder_digest(folder)
    assert run.data.params["rollout.prompt"] == "listed" and run.data.params["model.path"] == str(folder)
    assert metrics["eval/episodes"] == 3
    low, high = wilson(metrics["eval/success_rate"], 3)
    assert (metrics["eval/success_ci_low"], metrics["eval/success_ci_high"]) == pytest.approx((low, high))
    assert low - 1e-9 <= metrics["eval/success_rate"] <= high and high - low > 0.3  # three episodes: wide
    _no_run_left_running(c)


@pytest.mark.slow
@pytest.mark.parametrize(
    "args,names",
    [
        (["--model", "FOLDER"], ["--model needs --config"]),
        (["--source", "abc", "--config", "CONFIG"], ["--config goes with --model"]),
        (["--model", "FOLDER", "--config", "CONFIG", "--set", "model.path=/x"], ["--set model.path"]),
        (["--model", "FOLDER", "--config", "/no/such.yaml"], ["config: file '/no/such.yaml' does not exist"]),
        (["--model", "FOLDER", "--config", "CONFIG", "--set", "model.lora.rank=4"], ["model.lora"]),
        (["--model", "/no/such/model", "--config", "CONFIG"], ["/no/such/model"]),
    ],
    ids=["no-config", "config-with-source", "model-path", "missing-config", "lora", "missing-folder"],
)
def test_bad_model_evaluation_input_is_one_line_and_creates_no_run(
    chat_model_dir, tmp_path, tracking_uri, monkeypatch, capsys, args, names
):
    folder, config = str(chat_model_dir("llama3")), _model_config(tmp_path, tracking_uri)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_uri)
    capsys.readouterr()
    assert main(["evaluate", *[{"FOLDER": folder, "CONFIG": config}.get(a, a) for a in args]]) == 2
    err = capsys.readouterr().err
    assert err.startswith("horizonrl: evaluate: ") and len(err.strip().splitlines()) == 1, err
    for name in names:
        assert name in err, err
    c = MlflowClient(tracking_uri)
    assert c.get_experiment_by_name("test") is None or _evaluations(c) == []
