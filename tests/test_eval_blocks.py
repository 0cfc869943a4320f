"""An evaluation played in blocks (``eval.block_tasks``) resumes at the first block not stored: a failure in
the middle of one replays only that block and the ones after it, and the evaluation ends with what an
uninterrupted one stores and logs; a killed ``horizonrl evaluate`` is continued by the next one with the
same settings. Real train flows (the session's Prefect harness), ``horizonrl`` processes, MLflow on SQLite,
Parquet files and the household environment."""

from __future__ import annotations

import signal

import pyarrow as pa
import pytest
import yaml
from flowkit import run_of, tiny_config
from test_reliability import api_url, finish, start_cli  # noqa: F401

from flows.evaluate import evaluate_policy
from horizonrl import store
from horizonrl.rollout.loop import split_shards
from horizonrl.run.player import Player
from mlflow import MlflowClient
from tasks.evaluate import _stored_block
from tasks.evaluation_run import CONTINUES_TAG

TIMING = ("gen_s", "env_s")  # wall-clock columns: the only ones two plays of the same episodes differ in


def _config(tmp_path, name: str) -> dict:
    cfg = tiny_config(tmp_path / name, f"sqlite:///{tmp_path / name}/mlflow.db", "blocks", iterations=1)
    cfg["eval"] = {"every": 1, "n_tasks": 5, "greedy": False, "block_tasks": 2}  # blocks of 2, 2 and 1 tasks
    return cfg


def _stored(tmp_path, name: str, iteration: int) -> tuple[pa.Table, pa.Table]:
    d = store.iteration_dir(tmp_path / name / "data", "test", "blocks", iteration)
    turns = store.read_table(d / "eval-turns.parquet", "turns")
    return store.read_table(d / "eval-episodes.parquet", "episodes"), turns.drop_columns(list(TIMING))


def test_a_failed_evaluation_replays_only_the_blocks_it_had_not_stored(prefect_harness, tmp_path, monkeypatch):
    from flows.train import train

    train(config=_config(tmp_path, "straight"))
    played: list[tuple[int, int]] = []  # (first task's group id, tasks) of every held-out block played
    real_play = Player.play

    def play(self, shard, greedy=False):
        if shard.tasks[0].split == "test":
            played.append((shard.first_group_id, len(shard.tasks)))
            if len(played) == 2:
                raise RuntimeError("the sampler died in the middle of block 1")
        return real_play(self, shard, greedy)

    monkeypatch.setattr(Player, "play", play)
    train(config=_config(tmp_path, "failed"))

    # iteration 0: block 0, block 1 (fails), then the retry: block 1 again and block 2; iteration 1: all three
    assert played == [(0, 2), (2, 2), (2, 2), (4, 1), (0, 2), (2, 2), (4, 1)]
    for it in (0, 1):
        for a, b in zip(_stored(tmp_path, "straight", it), _stored(tmp_path, "failed", it)):
            assert a.equals(b), it
        d = store.iteration_dir(tmp_path / "failed" / "data", "test", "blocks", it)
        assert not list(d.glob("eval-block-*")), "blocks are removed once the evaluation is stored"
    assert _stored(tmp_path, "failed", 0)[0].num_rows == 5
    figures = []
    for name in ("straight", "failed"):
        c = MlflowClient(f"sqlite:///{tmp_path / name}/mlflow.db")
        run = run_of(c, "blocks")
        assert run.info.status == "FINISHED"
        figures.append([(m.step, m.value) for m in c.get_metric_history(run.info.run_id, "eval/success_rate")])
    assert figures[0] == figures[1] and len(figures[0]) == 2


def test_a_stored_block_is_read_only_when_it_holds_the_episodes_the_block_plays(household_suite, tmp_path):
    """Rows of another checkpoint, other sampling seeds or other tasks are played again, not read."""
    from horizonrl.rollout.records import EpisodeRecord

    tasks = household_suite.tasks("test", "easy", 4)
    shard = split_shards(tasks, 2, 1, 7)[1]
    records = [
        EpisodeRecord(shard.first_rollout_id + i, shard.first_group_id + i, t, "window", 0)
        for i, t in enumerate(shard.tasks)
    ]
    paths = [tmp_path / "turns.parquet", tmp_path / "episodes.parquet"]

    def write(version: int, seeds: list[int]) -> None:
        for r, seed in zip(records, seeds):
            r.sample_seed = seed
        store.write_table(store.turns_table(records, version), paths[0], "turns")
        store.write_table(store.episodes_table(records, "r", 0, version), paths[1], "episodes")

    from horizonrl.seeding import derive_seed

    right = [derive_seed(shard.seed, "sample", r.rollout_id) for r in records]
    assert _stored_block(paths, shard, 1, 3) is None  # nothing stored yet
    write(3, right)
    assert _stored_block(paths, shard, 1, 3) is not None
    assert _stored_block(paths, shard, 1, 4) is None  # another checkpoint's episodes
    assert _stored_block(paths, split_shards(tasks, 2, 1, 8)[1], 1, 3) is None  # other sampling seeds
    assert _stored_block(paths, split_shards(tasks, 2, 1, 7)[0], 1, 3) is None  # another block's tasks
    paths[1].write_bytes(paths[1].read_bytes()[:-20])  # a file cut short
    assert _stored_block(paths, shard, 1, 3) is None


@pytest.mark.slow
def test_a_killed_model_evaluation_is_continued_by_the_next_with_the_same_settings(
    api_url,  # noqa: F811
    prefect_harness,
    tiny_policy_dir,
    tmp_path,
    monkeypatch,
):
    """``horizonrl evaluate --model`` in blocks of 2 of 5 tasks, killed once its block 1 is stored: the next
    evaluate with the same settings marks it KILLED, takes its name (its folder), reads blocks 0 and 1 and
    plays block 2 only; its tables and success equal an evaluation that was never killed."""
    cfg = tiny_config(tmp_path, f"sqlite:///{tmp_path}/mlflow.db")
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    args = ["evaluate", "--model", str(tiny_policy_dir), "--config", str(tmp_path / "cfg.yaml"), "--n-tasks", "5"]
    args += ["--set", "eval.block_tasks=2", "--set", "eval.greedy=false"]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", cfg["tracking_uri"])  # where evaluate records (start_cli passes it)
    killed = start_cli({}, api_url, tmp_path / "killed.log", "eval-block:1", command=args)
    assert finish(killed) == -signal.SIGKILL
    log = tmp_path / "again.log"
    assert finish(start_cli({}, api_url, log, command=args)) == 0, log.read_text()[-3000:]
    straight = tmp_path / "straight"  # the same evaluation, never killed: in this process (a process less)
    evaluate_policy(
        n_tasks=5,
        tracking_uri=f"sqlite:///{straight}/mlflow.db",
        overrides=["eval.block_tasks=2", "eval.greedy=false", f"data_dir={straight / 'data'}"],
        model=str(tiny_policy_dir),
        config_path=str(tmp_path / "cfg.yaml"),
    )

    text = log.read_text()
    assert "continuing evaluation run" in text
    assert "eval block 0 of 3: read" in text and "eval block 1 of 3: read" in text
    assert "eval block 2 of 3: read" not in text
    c = MlflowClient(cfg["tracking_uri"])
    runs = c.search_runs([c.get_experiment_by_name("test").experiment_id], order_by=["attributes.start_time ASC"])
    assert [r.info.status for r in runs] == ["KILLED", "FINISHED"]
    first, second = runs
    assert second.info.run_name == first.info.run_name and second.data.tags[CONTINUES_TAG] == first.info.run_id
    s = MlflowClient(f"sqlite:///{straight}/mlflow.db")
    (alone,) = s.search_runs([s.get_experiment_by_name("test").experiment_id])
    assert second.data.metrics["eval/success_rate"] == alone.data.metrics["eval/success_rate"]
    tables = []
    for root, run in ((tmp_path / "data", second), (straight / "data", alone)):
        d = store.iteration_dir(root, "test", run.info.run_name, 0)
        assert not list(d.glob("eval-block-*"))
        episodes = store.read_table(d / "eval-episodes.parquet", "episodes").drop_columns(["run_name"])
        turns = store.read_table(d / "eval-turns.parquet", "turns").drop_columns(list(TIMING))
        tables.append((episodes, turns))
    assert tables[0][0].num_rows == 5
    assert all(a.equals(b) for a, b in zip(*tables))
