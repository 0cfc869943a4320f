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

from flowkit import tiny_config
from flows.cli import main
from horizonrl import store
from horizonrl.checkpoint import latest_checkpoint

CONFIG = "config.yaml"


@pytest.mark.parametrize("text,sets,names", [
    ("method: loop\nrollout: [group_size: 8\n", [], ["config.yaml' is not valid YAML"]),
    ("method: loop\ncolour: blue\n", [], ["colour", "Extra inputs are not permitted"]),
    ("rollout:\n  group_size: many\n", [], ["rollout.group_size", "valid integer"]),
    ("", ["update.lr=fast"], ["update.lr", "valid number"]),
    ("method: ppo9\n", [], ["method", "unknown method 'ppo9'"]),
    ("env:\n  name: minecraft\n", [], ["env.name = 'minecraft' is unknown"]),
    ("method: loop\nrollout:\n  group_size: 1\n", [], ["rollout.group_size = 1", "'loop' needs at least 2"]),
    ("model:\n  path: ./no-such-model\n", [], ["model.path", "'./no-such-model' does not exist"]),
], ids=["malformed-yaml", "unknown-key", "wrong-type", "wrong-type-set", "unknown-method", "unknown-env", "group-too-small", "missing-model"])
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
        pq.write_table(table.replace_schema_metadata({**table.schema.metadata, b"horizonrl.schema_version": b"0"}), path)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("bad,message", [("truncated", "not a readable Parquet file (truncated or corrupt)"), ("old-schema", "schema version '0'")], ids=["truncated", "old-schema"])
def test_bad_stored_rollouts_fail_the_run_naming_the_file(prefect_harness, tmp_path, tracking_uri, caplog, bad, message):
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
    assert latest_checkpoint(tmp_path / "data" / "test" / "bad").iteration == 0
