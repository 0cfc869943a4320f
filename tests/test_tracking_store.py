"""horizonrl.tracking.mlflow_runs against a real SQLite MLflow store: a new store is a copy of an empty store MLflow
migrated once per machine (it must be the store MLflow would have made, and never touch one that exists);
experiments created concurrently; the commits a run ran at."""

from __future__ import annotations

import subprocess

import mlflow
from horizonrl.tracking import mlflow_runs
from mlflow import MlflowClient


def test_a_new_store_is_mlflows_empty_store_made_here(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for d in ("one", "two"):
        (tmp_path / d).mkdir()
    monkeypatch.chdir(tmp_path / "one")
    first = mlflow_runs.client(f"sqlite:///{tmp_path}/a/mlflow.db")
    template = tmp_path / "cache" / "horizonrl" / f"mlflow-{mlflow.__version__}.db"
    assert template.is_file(), "the migrated empty store was not cached"
    built = (template.read_bytes(), template.stat().st_mtime_ns)
    run = first.create_run(mlflow_runs.experiment_id(first, "e"))
    first.log_metric(run.info.run_id, "m", 1.0)

    monkeypatch.chdir(tmp_path / "two")  # MLflow puts the Default experiment's artifacts under the creator's ./mlruns
    second = mlflow_runs.client(f"sqlite:///{tmp_path}/b/mlflow.db")  # copied, not migrated again
    assert (template.read_bytes(), template.stat().st_mtime_ns) == built
    default = second.get_experiment("0")
    assert default.name == "Default" and default.artifact_location == str(tmp_path / "two" / "mlruns" / "0")
    assert second.search_experiments(filter_string="name = 'e'") == []
    assert MlflowClient(f"sqlite:///{tmp_path}/a/mlflow.db").get_run(run.info.run_id).data.metrics == {"m": 1.0}
    assert not [p for d in ("a", "b") for p in (tmp_path / d).iterdir() if ".tmp-" in p.name], "a partial copy was left"
    first.set_terminated(run.info.run_id)  # runs end (the suite checks none is left RUNNING)


def test_an_existing_store_is_opened_not_replaced(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    made = MlflowClient(uri)  # made by MLflow itself, before horizonrl opens it
    run = made.create_run(made.create_experiment("mine"))
    assert mlflow_runs.client(uri).get_run(run.info.run_id).info.run_id == run.info.run_id
    made.set_terminated(run.info.run_id)


class _LateLookup(MlflowClient):
    """A real client whose first lookup by name comes before another process creates the experiment: the
    race two runs starting at once hit on a shared server."""

    def __init__(self, uri: str) -> None:
        super().__init__(uri)
        self.lookups = 0

    def get_experiment_by_name(self, name: str):
        self.lookups += 1
        if self.lookups == 1:
            MlflowClient(self.tracking_uri).create_experiment(name)  # the other run wins the race
            return None
        return super().get_experiment_by_name(name)


def test_an_experiment_created_by_another_run_meanwhile_is_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    mlflow_runs.client(uri)
    late = _LateLookup(uri)
    made = mlflow_runs.experiment_id(late, "shared")
    assert late.lookups == 2 and made == MlflowClient(uri).get_experiment_by_name("shared").experiment_id


def test_each_commit_a_resumed_run_ran_at_is_recorded_once(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    c = mlflow_runs.client(f"sqlite:///{tmp_path}/mlflow.db")
    older = mlflow_runs.create_run(c, "e", "r", {"git_commit": "a" * 40})  # a run from before the tag existed
    for commit in ("b" * 40, "b" * 40, "c" * 40):
        mlflow_runs.record_commit(c, older, commit)
    assert c.get_run(older).data.tags[mlflow_runs.COMMITS_TAG] == " ".join(("a" * 40, "b" * 40, "c" * 40))
    c.set_terminated(older)


def test_changed_code_names_only_files_a_cell_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)

    def git(*args):
        return subprocess.run(
            ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True, capture_output=True, text=True
        ).stdout.strip()

    git("init", "-q")
    (tmp_path / "methods").mkdir()
    (tmp_path / "methods" / "loop.py").write_text("A = 1\n")
    (tmp_path / "README.md").write_text("one\n")
    commits = []
    for change in (None, "README.md", "methods/loop.py"):
        if change:
            (tmp_path / change).write_text((tmp_path / change).read_text() + "more\n")
        git("add", "-A")
        git("commit", "-qm", f"change {change}")
        commits.append(git("rev-parse", "HEAD"))
    assert mlflow_runs.changed_code(commits[:2]) == []
    assert mlflow_runs.changed_code(commits) == mlflow_runs.changed_code(commits[::-1]) == ["methods/loop.py"]
    assert mlflow_runs.changed_code([commits[0], "f" * 40]) is None
