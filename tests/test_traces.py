"""Episodes as MLflow traces: which episodes are chosen, what a trace holds, and no trace twice across a
kill and resume (the train CLI SIGKILLs itself halfway through logging an iteration's traces)."""

from __future__ import annotations

import signal
from collections import Counter

import pyarrow as pa
import pytest
from flowkit import run_of
from test_reliability import RUN, api_url, config, finish, run_dir, start_cli  # noqa: F401 (api_url is a fixture)

from flows.cli import main as cli
from horizonrl import store
from horizonrl.files import file_digest
from horizonrl.seeding import derive_seed
from horizonrl.tracking import episode_view, traces
from mlflow import MlflowClient


def _episodes(returns: dict[int, list[float]]) -> pa.Table:
    rows = [(rid, g, r) for rid, (g, r) in enumerate((g, r) for g, rs in returns.items() for r in rs)]
    return pa.table(
        {"rollout_id": [r[0] for r in rows], "group_id": [r[1] for r in rows], "episode_return": [r[2] for r in rows]}
    )


def test_training_sample_is_best_worst_and_random_of_mixed_groups():
    # group 0 is not mixed (all 1.0): never chosen while mixed groups exist
    episodes = _episodes({0: [1.0, 1.0], 1: [0.0, 2.0, 0.5], 2: [0.0, 0.0, 3.0]})  # rollout ids 0-1 | 2-4 | 5-7
    assert traces.training_sample(episodes, 0, seed=1) == [2, 7]  # worst 0.0: lowest id 2; best 3.0: id 7
    drawn = traces.training_sample(episodes, 2, seed=1)
    assert len(drawn) == 4 and {2, 7} <= set(drawn) and not {0, 1} & set(drawn)
    assert traces.training_sample(episodes, 2, seed=1) == drawn, "one seed, one sample"
    assert traces.training_sample(episodes, 10, seed=1) == [2, 3, 4, 5, 6, 7], (
        "at most every episode of the mixed groups"
    )
    # no mixed group: the best and the worst of all episodes
    assert traces.training_sample(_episodes({0: [0.0, 0.0], 1: [1.0, 1.0]}), 0, seed=1) == [0, 2]
    assert traces.training_sample(_episodes({}), 3, seed=1) == []


def test_logging_an_iteration_again_in_the_same_process_logs_nothing(household_suite, tiny_policy, tmp_path):
    """A second call for the same iteration (a retried stage) finds every trace logged and writes nothing;
    each episode is in the store once, finished, with a span per turn."""
    from horizonrl.config import load_config
    from horizonrl.rollout.loop import SamplingSettings, collect

    _, _, fmt, engine = tiny_policy
    cfg = load_config(None, ["env.max_turns=3"])
    records = collect(
        household_suite,
        household_suite.tasks("train", "easy", 2),
        2,
        engine,
        fmt,
        SamplingSettings.from_config(cfg, household_suite, seed=4),
    )
    episodes, turns = store.episodes_table(records, "r", 1, 0), store.turns_table(records)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    c = MlflowClient(uri)
    target = traces.TraceTarget(uri, c.create_run(c.create_experiment("t")).info.run_id, "r", "loop", 0)
    first = traces.log_episodes(target, "eval", 1, episodes, turns)
    again = traces.log_episodes(target, "eval", 1, episodes, turns)
    assert (first["logged"], again["logged"], again["traces"]) == (4.0, 0.0, 4.0)
    found = c.search_traces(
        locations=[c.get_run(target.run_id).info.experiment_id], run_id=target.run_id, max_results=50
    )
    assert sorted(int(t.info.tags["rollout_id"]) for t in found) == [0, 1, 2, 3]
    for t in found:
        assert t.info.state.value == "OK" and len(t.data.spans) == 1 + len(
            records[int(t.info.tags["rollout_id"])].turns
        )
    c.set_terminated(target.run_id)  # runs end (the suite checks none is left RUNNING)


@pytest.mark.slow
def test_traces_survive_a_kill_without_duplicates(api_url, tmp_path):  # noqa: F811
    """Killed halfway through logging iteration 1's training traces, then resumed: every chosen episode
    has exactly one trace, linked to the run, with its turns' observation, action, reward and advantage."""
    cfg = config(tmp_path, iterations=2)
    cfg["trace"] = {"eval_episodes": 2, "train_random": 2}
    log = tmp_path / "killed.log"
    assert finish(start_cli(cfg, api_url, log, fault="trace:1")) == -signal.SIGKILL, log.read_text()[-3000:]
    c = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    run = run_of(c, RUN)
    episodes = store.read_table(store.iteration_dir(tmp_path / "data", "test", RUN, 1) / "episodes.parquet", "episodes")
    chosen = traces.training_sample(episodes, 2, derive_seed(cfg["seed"], "trace", 1))
    before = traces.logged_keys(c, run.info.experiment_id, run.info.run_id, "train", 1)
    assert len(chosen) >= 2 and len(before) == len(chosen) // 2, "the kill did not land halfway through the traces"
    started = c.search_traces(
        locations=[run.info.experiment_id],
        run_id=run.info.run_id,
        include_spans=False,
        filter_string="tags.split = 'train' AND tags.iteration = '1'",
    )
    assert len(started) == len(chosen), "the other half was started, its spans lost to the kill (IN_PROGRESS)"
    log = tmp_path / "resumed.log"
    assert finish(start_cli(cfg, api_url, log)) == 0, log.read_text()[-3000:]

    found = c.search_traces(locations=[run.info.experiment_id], run_id=run.info.run_id, max_results=500)
    keys = Counter(t.info.tags[traces.TRACE_KEY] for t in found)
    assert keys and max(keys.values()) == 1, f"traces logged twice: {[k for k, n in keys.items() if n > 1]}"
    expected = set()
    for it in (1, 2):
        episodes = store.read_table(
            store.iteration_dir(tmp_path / "data", "test", RUN, it) / "episodes.parquet", "episodes"
        )
        chosen = traces.training_sample(episodes, 2, derive_seed(cfg["seed"], "trace", it))
        assert len(chosen) >= 2
        expected |= {traces.trace_key(run.info.run_id, "train", it, r) for r in chosen}
        expected |= {traces.trace_key(run.info.run_id, "eval", it, r) for r in (0, 1)}
    expected |= {traces.trace_key(run.info.run_id, "eval", 0, r) for r in (0, 1)}
    assert set(keys) == expected
    for t in found:
        tags, meta = t.info.tags, t.info.trace_metadata
        assert t.info.state.value == "OK", f"{tags[traces.TRACE_KEY]} was not finished ({t.info.state})"
        assert meta[traces.SOURCE_RUN] == run.info.run_id
        assert {tags["run"], tags["method"], tags["seed"]} == {RUN, "loop", str(cfg["seed"])}
        assert tags["status"] and tags["task"] and float(tags["return"]) == t.data.spans[0].outputs["return"]
        assert meta[traces.SESSION].startswith(f"{RUN}/{tags['split']}/iter={tags['iteration']}/group=")
        turns = sorted((s for s in t.data.spans if s.parent_id), key=lambda s: s.attributes["turn"])
        assert turns and all(
            s.inputs["observation"] and "action" in s.outputs and "reward" in s.attributes for s in turns
        )
        if tags["split"] == "train":
            episodes_file = (
                store.iteration_dir(tmp_path / "data", "test", RUN, int(tags["iteration"])) / "episodes.parquet"
            )
            assert tags["episodes_digest"] == file_digest(episodes_file)
            adv = store.read_table(episodes_file.with_name("advantages-loop.parquet"), "advantages").to_pandas()
            adv = adv[adv["rollout_id"] == int(tags["rollout_id"])].sort_values("turn")
            assert [s.attributes["advantage"] for s in turns] == pytest.approx(adv["adv"].tolist())
            # the row of a trace, in the terminal: the same turns, advantages included
            text = episode_view.episode_text(run_dir(tmp_path), int(tags["iteration"]), int(tags["rollout_id"]))
            for span in turns:
                assert (
                    f"action:      {span.outputs['action'].strip()}" in text
                    and f"advantage (loop) {span.attributes['advantage']:+.4f}" in text
                )
    assert cli(["show", str(run_dir(tmp_path)), "--iteration", "1"]) == 0
    assert cli(["show", str(run_dir(tmp_path)), "--iteration", "9"]) == 2, (
        "an iteration that is not stored is named, not a traceback"
    )
