"""Collect shards: fixed by the task list and the shard count, so the same seed gives the same tables
whether the shards play in the flow's process or on a (local, real) Ray cluster through prefect-ray's
task runner, and the cluster leaves no process behind."""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path

import pytest
from flowkit import tiny_config

from horizonrl import store
from horizonrl.config import TrainConfig
from horizonrl.rollout.loop import SamplingSettings, collect, split_shards

SAMPLING = SamplingSettings(
    action_mode="admissible",
    context="window",
    history_turns=2,
    max_turns=3,
    max_action_tokens=12,
    temperature=1.0,
    seed=5,
)


def _without_timings(table):
    return table.drop_columns([c for c in ("gen_s", "env_s", "run_name") if c in table.column_names])


def test_shards_are_contiguous_blocks_numbered_as_one_collect(household_suite):
    tasks = household_suite.tasks("train", "easy", 7)
    shards = split_shards(tasks, 3, 4, seed=11)
    assert [len(s.tasks) for s in shards] == [3, 2, 2]
    assert [t for s in shards for t in s.tasks] == tasks
    assert [(s.first_group_id, s.first_rollout_id) for s in shards] == [(0, 0), (3, 12), (5, 20)]
    assert len({s.seed for s in shards}) == 3 and 11 not in {s.seed for s in shards}
    assert [s.seed for s in split_shards(tasks, 1, 4, seed=11)] == [11]  # one shard: the unsharded stream
    assert len(split_shards(tasks[:2], 3, 4, seed=11)) == 2  # never an empty shard


def test_one_shard_is_the_unsharded_collect_and_shards_join_in_order(tiny_policy, household_suite):
    _, _, fmt, engine = tiny_policy
    tasks = household_suite.tasks("train", "easy", 3)
    whole = collect(household_suite, tasks, 2, engine, fmt, SAMPLING)
    (one,) = split_shards(tasks, 1, 2, seed=5)
    single = collect(
        household_suite,
        one.tasks,
        2,
        engine,
        fmt,
        replace(SAMPLING, seed=one.seed),
        first_rollout_id=one.first_rollout_id,
        first_group_id=one.first_group_id,
    )
    assert _without_timings(store.turns_table(single)).equals(_without_timings(store.turns_table(whole)))
    joined = [
        r
        for s in split_shards(tasks, 2, 2, seed=5)
        for r in collect(
            household_suite,
            s.tasks,
            2,
            engine,
            fmt,
            replace(SAMPLING, seed=s.seed),
            first_rollout_id=s.first_rollout_id,
            first_group_id=s.first_group_id,
        )
    ]
    assert [(r.rollout_id, r.group_id, r.task) for r in joined] == [(r.rollout_id, r.group_id, r.task) for r in whole]


@pytest.mark.parametrize(
    ("override", "names"),
    [
        ({"rollout": {"tasks_per_iteration": 2, "shards": 3}}, "rollout.shards"),
        (
            {"rollout": {"runner": "ray"}, "engine": {"name": "vllm"}, "ray": {"address": "auto"}},
            "engine.vllm.url must be set for rollout.runner = 'ray' .* the run's own vLLM server listens on 127.0.0.1",
        ),
    ],
)
def test_shard_settings_are_checked(override, names):
    with pytest.raises(ValueError, match=names):
        TrainConfig.model_validate(override)


@pytest.mark.slow
@pytest.mark.extra  # the ray extra
def test_ray_shards_give_the_local_tables_and_leave_no_process(prefect_harness, tmp_path, tracking_uri, monkeypatch):
    """The train flow twice with 2 shards: in process, then on a local Ray cluster (2 CPUs, 127.0.0.1).

    Ray gives each shard one CPU, so its workers run torch on one thread; the in-process run does too
    here, because a different thread count splits reductions differently (last-bit differences in the
    entropy were seen with 2 threads against 1). ``RayTaskRunner.submit`` is wrapped by a spy that only
    records what went to Ray, so equal tables cannot come from shards that stayed in this process."""
    import prefect_ray
    import ray
    import torch

    from flows.train import train

    submitted = []
    submit = prefect_ray.RayTaskRunner.submit

    def spy(self, task, parameters, *args, **kwargs):
        submitted.append((task.name, parameters["shard"].index, ray.is_initialized()))
        return submit(self, task, parameters, *args, **kwargs)

    monkeypatch.setattr(prefect_ray.RayTaskRunner, "submit", spy)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # Ray then sets one thread per one-CPU worker

    before = _processes()
    tables = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for runner in ("local", "ray"):
            cfg = tiny_config(tmp_path, tracking_uri, runner, iterations=1)  # one store, one tiny model: two runs
            cfg["rollout"] = {**cfg["rollout"], "tasks_per_iteration": 3, "shards": 2, "runner": runner}
            cfg["eval"] = {"every": 1, "n_tasks": 1, "greedy": False}
            cfg["ray"] = {"num_cpus": 2, "object_store_mb": 100}
            train(config=cfg)
            d = store.iteration_dir(cfg["data_dir"], "test", runner, 1)
            tables[runner] = [
                _without_timings(store.read_table(d / f"{kind}.parquet", kind)) for kind in ("turns", "episodes")
            ]
    finally:
        torch.set_num_threads(threads)
    turns, episodes = tables["local"]
    assert episodes.num_rows == 6 and episodes["group_id"].to_pylist() == [0, 0, 1, 1, 2, 2]
    assert submitted == [("collect-shard", 0, True), ("collect-shard", 1, True)]
    assert tables["ray"][0].equals(turns) and tables["ray"][1].equals(episodes)
    assert not ray.is_initialized()
    deadline = time.monotonic() + 20  # workers exit once their raylet is gone
    while (
        left := {pid: cmd for pid, cmd in _processes().items() if pid not in before and _is_ray(cmd)}
    ) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, left
    assert not [pid for pid, cmd in _processes().items() if pid not in before and _parent(pid) == os.getpid()]


def _is_ray(cmd: str) -> bool:
    return (
        "ray::" in cmd or "/ray/" in cmd
    )  # workers rename themselves ray::<task>; raylet, GCS and helpers live under ray/


def _processes() -> dict[int, str]:
    """Live (not zombie) processes: pid -> command line."""
    out = {}
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and (p / "stat").read_text().rpartition(")")[2].split()[0] != "Z":
                out[int(p.name)] = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            pass
    return out


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def test_the_owners_never_travel_with_a_shard(tmp_path):
    """Ray pickles a task's function with its globals, and Prefect's context with the flow's: a run's owners
    must never be shipped (a worker builds its own player, ``tasks.context.shard_player``), so pickling any of
    them fails loudly instead of copying this process's model, optimizer or environments."""
    import pickle

    import cloudpickle

    from horizonrl.config import load_config
    from horizonrl.run.owners import build_run
    from tasks.collect import play_shard

    built = build_run(load_config(None, [f"data_dir={tmp_path}", "rollout.max_staleness=1"]))
    for owner in (built.player, built.generator, built.learner, built.learner.weights):
        with pytest.raises(TypeError, match="never travel"):
            pickle.dumps(owner)
    assert len(cloudpickle.dumps(play_shard)) < 20_000  # the task, not a model
