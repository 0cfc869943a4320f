"""A new SQLite MLflow store is a copy of an empty store MLflow migrated once per machine (horizonrl.tracking):
it must be the store MLflow would have made, and never touch one that exists."""

from __future__ import annotations

import mlflow
from mlflow import MlflowClient

from horizonrl import tracking


def test_a_new_store_is_mlflows_empty_store_made_here(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for d in ("one", "two"):
        (tmp_path / d).mkdir()
    monkeypatch.chdir(tmp_path / "one")
    first = tracking.client(f"sqlite:///{tmp_path}/a/mlflow.db")
    template = tmp_path / "cache" / "horizonrl" / f"mlflow-{mlflow.__version__}.db"
    assert template.is_file(), "the migrated empty store was not cached"
    built = (template.read_bytes(), template.stat().st_mtime_ns)
    run = first.create_run(tracking.experiment_id(first, "e"))
    first.log_metric(run.info.run_id, "m", 1.0)

    monkeypatch.chdir(tmp_path / "two")  # MLflow puts the Default experiment's artifacts under the creator's ./mlruns
    second = tracking.client(f"sqlite:///{tmp_path}/b/mlflow.db")  # copied, not migrated again
    assert (template.read_bytes(), template.stat().st_mtime_ns) == built
    default = second.get_experiment("0")
    assert default.name == "Default" and default.artifact_location == str(tmp_path / "two" / "mlruns" / "0")
    assert second.search_experiments(filter_string="name = 'e'") == []
    assert MlflowClient(f"sqlite:///{tmp_path}/a/mlflow.db").get_run(run.info.run_id).data.metrics == {"m": 1.0}
    assert not [p for d in ("a", "b") for p in (tmp_path / d).iterdir() if ".tmp-" in p.name], "a partial copy was left"


def test_an_existing_store_is_opened_not_replaced(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    made = MlflowClient(uri)  # made by MLflow itself, before horizonrl opens it
    run = made.create_run(made.create_experiment("mine"))
    assert tracking.client(uri).get_run(run.info.run_id).info.run_id == run.info.run_id


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
    tracking.client(uri)
    late = _LateLookup(uri)
    made = tracking.experiment_id(late, "shared")
    assert late.lookups == 2 and made == MlflowClient(uri).get_experiment_by_name("shared").experiment_id
