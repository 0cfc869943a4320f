"""TextWorld suites: tw-make caching, disjoint splits, walkthroughs, replay, agent-side keys and labels;
the user's own games (``env.games``): splits, walkthroughs, broken games named, a short train run.

The first coin and cooking challenge games are generated once per suite run (``tw_root`` in conftest.py), and
three ``tw-make custom`` games once per module.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
import threading

import pytest

from horizonrl.config import load_config
from horizonrl.envs import SUITES, make_suite, suite_ref
from horizonrl.envs.base import Env, EnvSuite
from horizonrl.envs.textworld_env import (
    TextWorldEnv,
    TextWorldSuite,
    ensure_game,
    game_spec,
    split_of,
    tw_make_path,
)
from horizonrl.seeding import derive_seed

INFO_KEYS = {"won", "lost", "admissible_commands", "valid", "score", "progress_key", "family", "goal"}


def _random_trace(env: TextWorldEnv, task, seed: int, turns: int = 12) -> list:
    """Random admissible play with an inadmissible string every fourth turn."""
    rng = random.Random(seed)
    observation, info = env.reset(task)
    trace = [(observation, info)]
    for turn in range(turns):
        action = "dance wildly" if turn % 4 == 3 else rng.choice(info["admissible_commands"])
        observation, reward, done, info = env.step(action)
        trace.append((action, observation, reward, done, info))
        if done:
            break
    return trace


def test_suites_are_registered_and_follow_the_protocol(tw_root):
    for name in ("textworld-coin", "textworld-treasure", "textworld-cooking"):
        assert name in SUITES
        suite = make_suite(name)
        assert isinstance(suite, EnvSuite) and isinstance(suite.make(), Env) and suite.name == name
    suite = TextWorldSuite("textworld-coin", root=tw_root)
    assert [suite.max_turns(t) for t in ("easy", "medium", "hard", "level1")] == [20, 30, 40, 12]
    assert game_spec("tw-coin_collector", "hard", "test").options == ("--level", "205")
    cooking = game_spec("tw-cooking", "recipe2-take1-go6-cook", "dev")
    assert cooking.options == ("--recipe=2", "--take=1", "--go=6", "--cook", "--split", "valid")
    assert cooking.name == "tw-cooking-recipe2-take1-go6-cook-valid" and cooking.horizon == 52
    with pytest.raises(ValueError):
        suite.tasks("train", "level-x", 1)
    with pytest.raises(ValueError):
        suite.tasks("dev", "easy", 1)  # coin collector has no dev split


def test_splits_are_disjoint_seed_lists_fixed_by_the_suite_seed():
    suite = TextWorldSuite("textworld-cooking")
    seeds = {split: [t.seed for t in suite.tasks(split, "easy", 300)] for split in ("train", "dev", "test")}
    assert all(len(set(s)) == 300 for s in seeds.values())
    assert not set(seeds["train"]) & set(seeds["test"]) and not set(seeds["dev"]) & set(seeds["train"] + seeds["test"])
    assert {split_of(s, suite.splits) for s in seeds["test"]} == {"test"}
    assert (
        TextWorldSuite("textworld-cooking").tasks("test", "easy", 5, offset=295)
        == suite.tasks("test", "easy", 300)[295:]
    )
    assert [t.seed for t in TextWorldSuite("textworld-cooking", seed=1).tasks("train", "easy", 5)] != seeds["train"][:5]
    assert all(0 <= s < 2**31 for s in seeds["train"])  # tw-make takes a 32-bit seed
    # cooking draws each split from its own food distribution
    assert game_spec("tw-cooking", "easy", "test").options[-2:] == ("--split", "test")


@pytest.mark.parametrize("name", ["textworld-coin", "textworld-cooking"])
def test_walkthrough_wins_with_normalised_score(tw_root, name):
    suite = TextWorldSuite(name, root=tw_root)
    env, task = suite.make(), suite.tasks("train", "easy", 1)[0]
    observation, info = env.reset(task)
    assert set(info) == INFO_KEYS and info["score"] == 0.0 and not info["won"]
    assert info["goal"] in observation and "$$" not in observation  # objective shown, title art removed
    plan = env.walkthrough()
    scores = []
    for i, action in enumerate(plan):
        observation, reward, done, info = env.step(action)
        scores.append(info["score"])
        assert set(info) == INFO_KEYS and 0.0 <= info["score"] <= 1.0
        assert not any(line.startswith(">") for line in observation.splitlines())  # no prompt/status line
        assert done == (i == len(plan) - 1) and reward == float(done)
    assert info["won"] and scores[-1] == 1.0 and scores == sorted(scores)
    assert env.step("look") == (observation, 0.0, True, {**info, "valid": False})  # the game is over
    env.close()


@pytest.mark.parametrize("name", ["textworld-coin", "textworld-cooking"])
def test_replay_of_same_task_and_actions_is_identical(tw_root, name):
    suite = TextWorldSuite(name, root=tw_root)
    task = suite.tasks("train", "easy", 1)[0]
    first = _random_trace(suite.make(), task, seed=3)
    env = TextWorldSuite(name, root=tw_root).make()
    second = [env.reset(task)] + [(step[0], *env.step(step[0])) for step in first[1:]]
    assert second == first
    assert any(not step[4]["valid"] for step in first[1:])  # the inadmissible strings were played


def test_inadmissible_command_is_answered_by_the_game_and_flagged(tw_root):
    env = TextWorldSuite("textworld-coin", root=tw_root).make()
    _, before = env.reset(TextWorldSuite("textworld-coin").tasks("train", "easy", 1)[0])
    observation, reward, done, info = env.step("dance wildly")
    assert observation and (reward, done, info["valid"]) == (0.0, False, False)
    assert {**info, "valid": True} == before


def test_progress_keys_and_labels_read_no_walkthrough(tw_root, tmp_path, monkeypatch):
    """Same actions on the game and on a copy whose walkthrough is emptied: identical keys and labels;
    and ``walkthrough()`` is never called while they are computed."""
    suite = TextWorldSuite("textworld-cooking", root=tw_root)
    task = suite.tasks("train", "easy", 1)[0]
    env = suite.make()
    env.reset(task)
    plan = env.walkthrough()
    game_dir = game_spec("tw-cooking", "easy", "train").name
    shutil.copytree(tw_root / game_dir, tmp_path / game_dir)
    meta = json.loads((tmp_path / game_dir / f"{task.seed}.json").read_text())
    meta["metadata"]["walkthrough"] = []
    (tmp_path / game_dir / f"{task.seed}.json").write_text(json.dumps(meta))
    monkeypatch.setattr(TextWorldEnv, "walkthrough", lambda self: pytest.fail("walkthrough read"))
    traces = []
    for root in (tw_root, tmp_path):
        env = TextWorldSuite("textworld-cooking", root=root).make()
        keys = [env.reset(task)[1]["progress_key"]]
        labels = []
        for action in plan:
            labels.append(env.abstract_action(action))
            keys.append(env.step(action)[3]["progress_key"])
        traces.append((keys, labels))
    assert traces[0] == traces[1]
    keys, labels = traces[0]
    assert keys[0] == "tw_v1|tw-cooking|score=0/3|recipe=0" and keys[-1].startswith("tw_v1|tw-cooking|score=3/3")
    assert all(" " not in key for key in keys) and len(set(keys)) >= 4
    assert labels[plan.index("examine cookbook")] == "EXAMINE_GOAL"  # 'cookbook' is in the objective
    assert labels[plan.index("eat meal")] == "EAT_GOAL"  # 'meal' too
    assert {label for label, action in zip(labels, plan) if action.startswith("take ")} == {"TAKE_GOAL"}  # recipe items


def test_coin_labels_read_the_objective(tw_root):
    suite = TextWorldSuite("textworld-coin", root=tw_root)
    env = suite.make()
    env.reset(suite.tasks("train", "easy", 1)[0])
    plan = env.walkthrough()
    assert [env.abstract_action(a) for a in plan] == ["GO_GOAL"] * (len(plan) - 1) + ["TAKE_GOAL"]
    assert [env.abstract_action(a) for a in ("inventory", "look", "jump", "")] == ["INVENTORY", "LOOK", "JUMP", "OTHER"]


def test_games_are_cached_and_generation_is_race_safe(tw_root, tmp_path, monkeypatch):
    suite = TextWorldSuite("textworld-coin", root=tmp_path)
    task = suite.tasks("test", "level1", 1)[0]
    spec = game_spec("tw-coin_collector", "level1", "test")
    paths: list = []
    racers = [threading.Thread(target=lambda: paths.append(ensure_game(tmp_path, spec, task.seed))) for _ in range(2)]
    for racer in racers:
        racer.start()
    for racer in racers:
        racer.join()
    assert len(paths) == 2 and paths[0] == paths[1] and paths[0].exists()
    assert sorted(p.name for p in paths[0].parent.iterdir()) == [f"{task.seed}.json", f"{task.seed}.z8"]
    monkeypatch.setattr("horizonrl.envs.textworld_env.tw_make_path", lambda: pytest.fail("regenerated"))
    assert ensure_game(tmp_path, spec, task.seed) == paths[0]
    _, info = suite.make().reset(task)
    assert info["admissible_commands"] and not info["won"]


# ---------------------------------------------------------------- the user's own games (env.games)

USER_SEEDS = (1, 2, 3)


@pytest.fixture(scope="module")
def user_games(tmp_path_factory):
    """Three games made by calling ``tw-make custom`` directly, as a user would (3-6 s each, in
    parallel), in a folder whose ``splits.yaml`` puts g1, g2 in train and g3 in test."""
    folder = tmp_path_factory.mktemp("user") / "games"
    folder.mkdir()
    makers = [
        subprocess.Popen(
            [
                tw_make_path(),
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
                str(folder / f"g{seed}.z8"),
                "--silent",
                "-f",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for seed in USER_SEEDS
    ]
    for maker in makers:
        output, _ = maker.communicate(timeout=600)
        assert maker.returncode == 0, output
    (folder / "splits.yaml").write_text("train: [g1.z8, g2.z8]\ntest: [g3.z8]\n")
    return folder


def _copy_games(source, target, names):
    target.mkdir()
    for name in names:
        for suffix in (".z8", ".json"):
            shutil.copy(source / f"{name}{suffix}", target / f"{name}{suffix}")
    return target


def test_user_games_are_split_by_their_file_and_won_by_their_walkthrough(user_games):
    suite = make_suite("textworld-coin", 0, games=str(user_games))
    assert suite.splits == ("train", "dev", "test")
    train, test = suite.tasks("train", "easy", 10), suite.tasks("test", "easy", 10)
    assert sorted(t.family for t in train) == ["g1.z8", "g2.z8"] and [t.family for t in test] == ["g3.z8"]
    assert suite.tasks("train", "easy", 1, offset=1) == train[1:]
    with pytest.raises(ValueError, match=re.escape(str(user_games / "splits.yaml"))):
        suite.tasks("dev", "easy", 1)  # splits.yaml names no dev game
    walkthroughs = {
        t.family: json.loads((user_games / t.family).with_suffix(".json").read_text())["metadata"]["walkthrough"]
        for t in train + test
    }
    assert suite.max_turns("easy") == game_spec("tw-coin_collector", "easy", "train").horizon  # the tier's
    env = suite.make()
    for task in train + test:
        _, info = env.reset(task)
        assert not info["won"] and info["goal"]
        plan = env.walkthrough()
        assert plan == walkthroughs[task.family]
        for i, action in enumerate(plan):
            _, reward, done, info = env.step(action)
            assert done == (i == len(plan) - 1) and reward == float(done)
        assert info["won"] and info["score"] == 1.0
    env.close()


def test_without_a_splits_file_a_seeded_hash_of_the_name_splits_the_games(user_games, tmp_path):
    folder = _copy_games(user_games, tmp_path / "hashed", ["g1", "g2", "g3"])
    for seed in (0, 1):
        rule = {
            f"g{s}.z8": ("test", "dev", *["train"] * 8)[derive_seed(seed, "textworld-games", f"g{s}.z8") % 10]
            for s in USER_SEEDS
        }
        for source in (str(folder), str(folder / "g*.z8")):  # a folder or a glob
            suite = TextWorldSuite("textworld-cooking", seed=seed, games=source)
            found = {
                t.family: split
                for split in suite.splits
                for t in (suite.tasks(split, "easy", 10) if split in rule.values() else [])
            }
            assert found == rule
    (folder / "splits.yaml").write_text("train: [g2.z8]\ntest: [g3.z8]\n")  # not read for one game file
    one = TextWorldSuite("textworld-coin", games=str(folder / "g1.z8"))  # one game: a suite of it, every split
    assert {split: [t.family for t in one.tasks(split, "easy", 5)] for split in one.splits} == {
        "train": ["g1.z8"],
        "dev": ["g1.z8"],
        "test": ["g1.z8"],
    }


def test_a_game_textworld_cannot_load_is_named_before_any_work(user_games, tmp_path):
    folder = _copy_games(user_games, tmp_path / "broken", ["g1"])
    story = (user_games / "g2.z8").read_bytes()
    meta = (user_games / "g2.json").read_text()
    (folder / "cut.z8").write_bytes(story[: len(story) // 3])
    (folder / "noise.z8").write_bytes(random.Random(0).randbytes(4096))
    (folder / "flipped.z8").write_bytes(story[:1000] + bytes(b ^ 0xFF for b in story[1000:1100]) + story[1100:])
    (folder / "old.ulx").write_bytes(b"Glul" + bytes(60))
    for name in ("cut", "noise", "flipped", "old"):
        (folder / f"{name}.json").write_text(meta)
    (folder / "lone.z8").write_bytes(story)  # no .json beside it
    (folder / "bad_meta.z8").write_bytes(story)
    (folder / "bad_meta.json").write_text("{not json")
    with pytest.raises(ValueError) as err:
        TextWorldSuite("textworld-coin", games=str(folder))
    reasons = {
        "cut": "truncated",
        "noise": "not a Z-machine version 8",
        "flipped": "checksum",
        "old": "Glulx",
        "lone": "no lone.json",
        "bad_meta": "not a TextWorld game description",
    }
    lines = str(err.value).splitlines()
    assert lines[0] == f"env.games = {str(folder)!r}: 6 game(s) TextWorld cannot load:"
    for name, reason in reasons.items():
        suffix = ".json" if name == "bad_meta" else ".ulx" if name == "old" else ".z8"
        assert any(line.strip().startswith(f"{folder / name}{suffix}: ") and reason in line for line in lines), name
    assert not any("g1" in line for line in lines)
    with pytest.raises(ValueError, match=re.escape(str(folder / "cut.z8"))):  # config load checks them too
        load_config(None, ["env.name=textworld-coin", f"env.games={folder}"])
    # what the header check stands in for: TextWorld's interpreter (Frotz) ends the process on such a file
    for name, fatal in (("cut", "Story file read error"), ("noise", "Unknown Z-code version")):
        done = subprocess.run(
            [sys.executable, "-c", f"import textworld; textworld.start({str(folder / name) + '.z8'!r}).reset()"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode != 0 and f"Fatal error: {fatal}" in done.stderr


def test_a_folder_or_pattern_without_games_is_named(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("no games here")
    with pytest.raises(ValueError, match=re.escape(f"the folder {empty} holds no game file")):
        TextWorldSuite("textworld-coin", games=str(empty))
    with pytest.raises(
        ValueError, match=re.escape(f"env.games = {str(empty / '*.z8')!r}: the pattern matches no game file")
    ):
        TextWorldSuite("textworld-coin", games=str(empty / "*.z8"))
    with pytest.raises(ValueError, match=re.escape(f"no such folder or game file ({tmp_path / 'missing'})")):
        load_config(None, ["env.name=textworld-coin", f"env.games={tmp_path / 'missing'}"])


def test_user_games_run_through_the_worker_pool(user_games):
    """A worker process builds the suite on the user's games from ``suite_ref`` (a picklable factory)."""
    from horizonrl.envs.pool import EnvPool

    suite = make_suite("textworld-coin", 0, games=str(user_games))
    task = suite.tasks("test", "easy", 1)[0]
    env = suite.make()
    env.reset(task)
    plan = env.walkthrough()
    pool = EnvPool(suite_ref("textworld-coin", str(user_games)), 0, n_workers=1)
    try:
        [(_, info)] = pool.reset_many([task])
        assert set(info) == INFO_KEYS and not info["won"]
        for action in plan:
            _, reward, done, info = pool.step_many({0: action})[0]
        assert (reward, done, info["won"]) == (1.0, True, True)
    finally:
        pool.close()


@pytest.mark.slow
def test_short_train_run_plays_the_users_games(prefect_harness, user_games, tmp_path, tracking_uri):
    """One iteration of the train flow on the user's games: the episodes stored in Parquet name the
    train games, evaluation plays the test game, and the stages' metrics are logged."""
    from flowkit import run_of, steps, tiny_config

    from flows.train import train
    from horizonrl import store
    from mlflow import MlflowClient

    cfg = tiny_config(tmp_path, tracking_uri, "own-games", iterations=1)
    cfg["env"] = {"name": "textworld-coin", "games": str(user_games), "max_turns": 4}
    cfg["eval"] = {"every": 1, "n_tasks": 5, "greedy": False}
    train(config=cfg)
    episodes = store.read_table(
        store.iteration_dir(tmp_path / "data", "test", "own-games", 1) / "episodes.parquet", "episodes"
    )
    assert sorted(episodes["family"].to_pylist()) == ["g1.z8", "g1.z8", "g2.z8", "g2.z8"]
    assert set(episodes["env"].to_pylist()) == {"textworld-coin"} and set(episodes["split"].to_pylist()) == {"train"}
    c = MlflowClient(tracking_uri)
    run = run_of(c, "own-games")
    assert run.data.params["env.games"] == str(user_games)
    assert steps(c, run.info.run_id, "collect/success_rate") == [1] and steps(
        c, run.info.run_id, "eval/success_rate"
    ) == [0, 1]
    assert run.data.metrics["collect/episodes"] == 4 and run.data.metrics["collect/error_rate"] == 0.0


def test_generated_games_are_cached_in_the_runs_data_folder(tmp_path):
    """The run's data folder reaches the suite (and the worker processes' suites) as an argument, not through
    the process environment: two runs in one process with different ``data_dir`` cache games apart."""
    import pickle

    for d in ("a", "b"):
        suite = make_suite("textworld-coin", 0, data_dir=str(tmp_path / d))
        assert suite.root == tmp_path / d / "envs" / "textworld"
        worker_suite = pickle.loads(pickle.dumps(suite_ref("textworld-coin", None, str(tmp_path / d))))(0)
        assert worker_suite.root == suite.root
    assert "HORIZONRL_DATA_DIR" not in os.environ
