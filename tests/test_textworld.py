"""TextWorld suites: tw-make caching, disjoint splits, walkthroughs, replay, agent-side keys and labels.

Three small games are generated once per session (3-8 s each) under a temporary folder.
"""

from __future__ import annotations

import json
import random
import shutil
import threading

import pytest

pytest.importorskip("textworld")

from horizonrl.envs import SUITES, make_suite  # noqa: E402
from horizonrl.envs.base import Env, EnvSuite  # noqa: E402
from horizonrl.envs.textworld_env import (  # noqa: E402
    TextWorldEnv, TextWorldSuite, ensure_game, game_spec, split_of,
)

INFO_KEYS = {"won", "lost", "admissible_commands", "valid", "score", "progress_key", "family", "goal"}


@pytest.fixture(scope="session")
def tw_root(tmp_path_factory):
    """Games of the first coin and cooking train tasks, generated once and shared by the tests."""
    root = tmp_path_factory.mktemp("textworld")
    for name in ("textworld-coin", "textworld-cooking"):
        suite = TextWorldSuite(name, root=root)
        suite.prepare(suite.tasks("train", "easy", 1))
    return root


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
    assert TextWorldSuite("textworld-cooking").tasks("test", "easy", 5, offset=295) == suite.tasks("test", "easy", 300)[295:]
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
