"""household: determinism, oracle, splits, difficulty, the agent-side progress key and action labels."""

from __future__ import annotations

import copy
import dataclasses
import random
import re
import time

import pytest

from horizonrl.envs.base import Env, EnvSuite
from horizonrl.envs.household import HouseholdEnv, HouseholdSuite, Tracker, abstract_action_label, progress_key
from horizonrl.envs.household_world import (
    FAMILIES,
    OBJECT_TYPES,
    RECEPTACLE_KINDS,
    TIERS,
    Goal,
    Layout,
    Receptacle,
    generate_layout,
    kind_of,
)

INFO_KEYS = {"won", "admissible_commands", "valid", "score", "progress_key", "family", "goal"}


def _kitchen(goal: Goal, extra: tuple[tuple[str, str], ...] = ()) -> Layout:
    """Hand-built one-room layout: apple and mug on the counter, bread in an open cabinet, a closed fridge,
    a closed drawer, a microwave and a sidetable with the lamp."""
    receptacles = (
        Receptacle("countertop 1", "kitchen"),
        Receptacle("fridge 1", "kitchen", False),
        Receptacle("cabinet 1", "kitchen", True),
        Receptacle("drawer 1", "kitchen", False),
        Receptacle("microwave 1", "kitchen", False),
        Receptacle("sidetable 1", "kitchen"),
    )
    placements = (("apple 1", "countertop 1"), ("mug 1", "countertop 1"), ("bread 1", "cabinet 1")) + extra
    return Layout(goal, ("kitchen",), receptacles, placements, "sidetable 1")


def _bedroom(goal: Goal) -> Layout:
    """A different two-room world with the same reachable structure: pen and book on a desk, a closed
    drawer, a microwave in the kitchen."""
    receptacles = (
        Receptacle("bed 1", "bedroom"),
        Receptacle("desk 1", "bedroom"),
        Receptacle("drawer 3", "bedroom", False),
        Receptacle("shelf 2", "bedroom"),
        Receptacle("microwave 1", "kitchen", True),
        Receptacle("countertop 1", "kitchen"),
    )
    placements = (("pen 2", "desk 1"), ("book 1", "desk 1"), ("mug 3", "shelf 2"), ("cup 1", "countertop 1"))
    return Layout(goal, ("bedroom", "kitchen"), receptacles, placements, "")


def _play(env: HouseholdEnv, actions: list[str]) -> list[tuple]:
    return [env.step(action) for action in actions]


def _random_episode(env: HouseholdEnv, task, rng: random.Random, horizon: int) -> list[tuple]:
    """Uniform random play over admissible commands, with a few inadmissible strings mixed in."""
    observation, info = env.reset(task)
    trace = [(observation, info)]
    for _ in range(horizon):
        action = rng.choice(info["admissible_commands"] + ["jump around", "take apple 9 from bed 9"])
        observation, reward, done, info = env.step(action)
        trace.append((action, observation, reward, done, info))
        if done:
            break
    return trace


def test_suite_and_env_follow_the_protocol():
    suite = HouseholdSuite()
    assert isinstance(suite, EnvSuite) and isinstance(suite.make(), Env)
    assert suite.name == "household"
    assert [suite.max_turns(tier) for tier in ("easy", "medium", "hard")] == [15, 30, 50]


def test_replay_of_same_task_and_actions_is_identical():
    for tier in TIERS:
        for task in HouseholdSuite(seed=3).tasks("train", tier, 15):
            first = _random_episode(HouseholdEnv(), task, random.Random(task.index), 40)
            actions = [step[0] for step in first[1:]]
            env = HouseholdSuite(seed=3).make()
            second = [env.reset(task)] + [(a, *env.step(a)) for a in actions]
            assert second == first


def test_info_keys_present_and_typed_on_reset_and_every_step():
    suite, env, rng = HouseholdSuite(), HouseholdEnv(), random.Random(0)
    for tier in TIERS:
        for task in suite.tasks("test", tier, 10):
            trace = _random_episode(env, task, rng, 30)
            for info in [trace[0][1]] + [step[4] for step in trace[1:]]:
                assert set(info) == INFO_KEYS
                assert info["admissible_commands"] == sorted(info["admissible_commands"])
                assert 0.0 <= info["score"] <= 1.0
                assert info["family"] == task.family and info["goal"] == env.goal()


@pytest.mark.parametrize("tier", list(TIERS))
def test_walkthrough_wins_for_300_tasks_of_every_family(tier):
    suite, env = HouseholdSuite(), HouseholdEnv()
    per_family: dict[str, int] = {family: 0 for family in TIERS[tier].families}
    for task in suite.tasks("train", tier, 3000):
        if per_family[task.family] == 300:
            continue
        per_family[task.family] += 1
        _, info = env.reset(task)
        plan = env.walkthrough()
        for i, action in enumerate(plan):
            assert action in info["admissible_commands"], (task, plan, action)
            _, reward, done, info = env.step(action)
            assert done == (i == len(plan) - 1) and reward == float(done)
        assert info["won"] and info["score"] == 1.0
    assert set(per_family.values()) == {300}
    assert set(per_family) == ({"pick_and_place"} if tier == "easy" else set(FAMILIES))


@pytest.mark.parametrize("tier", list(TIERS))
def test_search_expert_wins_using_only_what_it_has_seen(tier):
    """The warm start's searching expert (``plan_search``) wins 300 tasks of the tier within its horizon, and
    finds the first object as an agent that cannot see hidden places must: it visits receptacles in turn
    (the start room's, then the next room's, in listing order) up to the one that holds it, where the
    walkthrough goes straight there."""
    suite, env = HouseholdSuite(), HouseholdEnv()
    searched = 0
    for task in suite.tasks("train", tier, 300):
        _, info = env.reset(task)
        layout, plan = env.world.layout, env.search_walkthrough()
        order = [r.name for room in layout.rooms for r in layout.receptacles if r.room == room]
        first_take = next(i for i, a in enumerate(plan) if a.startswith("take "))
        visits = [a.removeprefix("go to ") for a in plan[:first_take] if a.removeprefix("go to ") in order]
        source = plan[first_take].split(" from ")[1]
        assert visits == order[: order.index(source) + 1], (task, plan)
        searched += len(visits) > 1
        assert len(plan) <= TIERS[tier].horizon
        for i, action in enumerate(plan):
            assert action in info["admissible_commands"], (task, plan, action)
            _, reward, done, info = env.step(action)
            assert done == (i == len(plan) - 1) and reward == float(done)
        assert info["won"]
    assert searched > 100, "the expert found most first objects at once: is it reading their hidden places?"


def test_splits_are_disjoint_by_content_and_hold_10000_train_tasks():
    suite = HouseholdSuite()
    train = suite.tasks("train", "easy", 10_000)
    test = suite.tasks("test", "easy", 500)
    train_signatures = {generate_layout(t.seed, TIERS["easy"]).signature() for t in train}
    test_signatures = {generate_layout(t.seed, TIERS["easy"]).signature() for t in test}
    assert len(train_signatures) == 10_000 and len(test_signatures) == 500
    assert not train_signatures & test_signatures
    assert [t.index for t in train[:3]] == [0, 1, 2] and {t.split for t in test} == {"test"}
    assert HouseholdSuite().tasks("train", "easy", 5, offset=9_995) == train[9_995:]
    assert HouseholdSuite(seed=1).tasks("train", "easy", 5) != train[:5]


def test_random_play_on_easy_wins_a_few_percent():
    suite, env, rng = HouseholdSuite(), HouseholdEnv(), random.Random(0)
    wins = 0
    for task in suite.tasks("train", "easy", 2000):
        _, info = env.reset(task)
        for _ in range(suite.max_turns("easy")):
            _, _, done, info = env.step(rng.choice(info["admissible_commands"]))
            if done:
                wins += 1
                break
    assert 0.01 <= wins / 2000 <= 0.15  # measured 5.75 % with this seed


def test_inadmissible_action_says_nothing_happens_and_changes_nothing():
    env = HouseholdEnv()
    _, before = env.reset_layout(_kitchen(Goal("pick_and_place", "apple", "fridge")), "medium")
    observation, reward, done, info = env.step("take apple 1 from countertop 1")  # not at the countertop yet
    assert (observation, reward, done, info["valid"]) == ("nothing happens .", 0.0, False, False)
    assert {**info, "valid": True} == before
    plan = env.walkthrough()
    interleaved = [a for action in plan for a in (action, "put mug 1 in/on fridge 1", "fly to moon")]
    with_noise = [step for step in _play(env, interleaved) if step[3]["valid"]]
    env.reset_layout(_kitchen(Goal("pick_and_place", "apple", "fridge")), "medium")
    assert with_noise == _play(env, plan)


def test_inadmissible_actions_leave_world_and_tracker_untouched_in_random_play():
    suite, env, rng = HouseholdSuite(), HouseholdEnv(), random.Random(5)
    for tier in TIERS:
        for task in suite.tasks("train", tier, 20):
            _, info = env.reset(task)
            for _ in range(20):
                world, tracker = copy.deepcopy(env.world), copy.deepcopy(env.tracker)
                bad = rng.choice(["use desklamp 1", "go to moon", "take apple 9 from bed 9", "close fridge 1"])
                if bad not in info["admissible_commands"]:
                    assert env.step(bad)[3] == {**info, "valid": False}
                    assert (env.world, env.tracker) == (world, tracker)
                _, _, done, info = env.step(rng.choice(info["admissible_commands"]))
                if done:
                    break


def test_easy_tier_hides_look_and_examine():
    env = HouseholdEnv()
    for task in HouseholdSuite().tasks("train", "easy", 50):
        _, info = env.reset(task)
        for action in env.walkthrough():
            assert not any(c == "look" or c.startswith("examine") for c in info["admissible_commands"])
            _, _, _, info = env.step(action)


def test_heat_then_place_needs_the_microwave_and_a_hot_target():
    env = HouseholdEnv()
    env.reset_layout(_kitchen(Goal("pick_heat_then_place", "apple", "fridge")), "medium")
    _play(env, ["go to countertop 1", "take apple 1 from countertop 1"])
    assert not env.step("heat apple 1 with microwave 1")[3]["valid"]  # not at the microwave
    _, reward, done, info = _play(env, ["go to fridge 1", "open fridge 1", "put apple 1 in/on fridge 1"])[-1]
    assert (reward, done, info["won"], info["score"]) == (0.0, False, False, 0.0)  # placed, but not hot
    _, _, _, info = _play(env, ["take apple 1 from fridge 1", "go to microwave 1"])[-1]
    assert "heat apple 1 with microwave 1" in info["admissible_commands"]
    observation, _, _, info = env.step("heat apple 1 with microwave 1")
    assert observation == "you heat the apple 1 using the microwave 1 ." and info["score"] == 0.5
    assert env.step("examine apple 1")[0] == "this is a hot apple 1 ."
    _, reward, done, info = _play(env, ["go to fridge 1", "put apple 1 in/on fridge 1"])[-1]
    assert (reward, done, info["won"], info["score"]) == (1.0, True, True, 1.0)


def test_observation_wording():
    env = HouseholdEnv()
    observation, _ = env.reset_layout(_kitchen(Goal("pick_and_place", "apple", "fridge")), "medium")
    assert observation.endswith("your task is to : put a apple in fridge .")
    expected = {
        "go to countertop 1": "you arrive at countertop 1 . on the countertop 1 , you see a apple 1 , and a mug 1 .",
        "go to fridge 1": "you arrive at fridge 1 . the fridge 1 is closed .",
        "open fridge 1": "you open the fridge 1 . the fridge 1 is open . in it , you see nothing .",
        "go to sidetable 1": "you arrive at sidetable 1 . on the sidetable 1 , you see a desklamp 1 .",
        "inventory": "you are not carrying anything .",
    }
    assert {action: env.step(action)[0] for action in expected} == expected


def test_score_counts_goal_components():
    env = HouseholdEnv()
    extra = (("apple 2", "drawer 1"),)
    env.reset_layout(_kitchen(Goal("pick_two", "apple", "fridge"), extra), "medium")
    scores = [
        step[3]["score"]
        for step in _play(
            env,
            [
                "go to countertop 1",
                "take apple 1 from countertop 1",
                "go to fridge 1",
                "open fridge 1",
                "put apple 1 in/on fridge 1",
                "go to drawer 1",
                "open drawer 1",
                "take apple 2 from drawer 1",
                "go to fridge 1",
                "put apple 2 in/on fridge 1",
            ],
        )
    ]
    assert scores == [0.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5, 0.5, 1.0]
    env.reset_layout(_kitchen(Goal("look_at_obj_in_light", "mug", "")), "medium")
    steps = _play(env, ["go to countertop 1", "take mug 1 from countertop 1", "go to sidetable 1", "use desklamp 1"])
    assert [s[3]["score"] for s in steps] == [0.0, 0.5, 0.5, 1.0] and steps[-1][2]


def test_abstract_labels_pick_and_place():
    env = HouseholdEnv()
    env.reset_layout(_kitchen(Goal("pick_and_place", "apple", "fridge")), "medium")
    expected = {
        "go to fridge 1": "NAVIGATE_DESTINATION",
        "go to countertop 1": "SEARCH_ENV",
        "go to microwave 1": "SEARCH_ENV",
        "take apple 1 from countertop 1": "TAKE_TARGET",
        "take mug 1 from countertop 1": "OTHER",
        "open fridge 1": "OPEN_DESTINATION",
        "open drawer 1": "OPEN_SOURCE",
        "close cabinet 1": "SEARCH",
        "put apple 1 in/on fridge 1": "PUT_TARGET_DESTINATION",
        "put apple 1 in/on microwave 1": "PUT_TARGET_OTHER",
        "put apple 1 in/on countertop 1": "PUT_TARGET_OTHER",
        "put mug 1 in/on fridge 1": "OTHER",
        "heat apple 1 with microwave 1": "TRANSFORM_TARGET",
        "use desklamp 1": "ACTIVATE_TOOL",
        "examine apple 1": "OBSERVE_OTHER",
        "look": "OBSERVE_ENV",
        "inventory": "INVENTORY",
        "go to kitchen": "NAVIGATE_ROOM",
        "dance": "OTHER",
        "go to moon 1": "OTHER",
    }
    assert {action: env.abstract_action(action) for action in expected} == expected


def test_abstract_labels_transform_pick_two_and_look():
    env = HouseholdEnv()
    env.reset_layout(_kitchen(Goal("pick_heat_then_place", "apple", "countertop")), "medium")
    assert env.abstract_action("go to microwave 1") == "NAVIGATE_TOOL"
    assert env.abstract_action("open microwave 1") == "OPEN_TOOL"
    assert env.abstract_action("put apple 1 in/on microwave 1") == "PUT_TARGET_TOOL"
    assert env.abstract_action("go to countertop 1") == "NAVIGATE_DESTINATION"
    env.reset_layout(_kitchen(Goal("pick_two", "apple", "fridge")), "medium")
    assert env.abstract_action("take apple 1 from countertop 1") == "TAKE_UNPLACED_TARGET"
    assert env.abstract_action("take apple 1 from fridge 1") == "RETAKE_PLACED_TARGET"
    env.reset_layout(_kitchen(Goal("look_at_obj_in_light", "mug", "")), "medium")
    assert env.abstract_action("go to sidetable 1") == "SEARCH_ENV"  # the agent has not seen the lamp yet
    _play(env, ["go to sidetable 1"])
    assert env.abstract_action("use desklamp 1") == "ACTIVATE_LAMP"
    _play(env, ["go to countertop 1", "take mug 1 from countertop 1"])
    assert env.abstract_action("go to sidetable 1") == "NAVIGATE_LAMP"
    assert env.abstract_action("examine mug 1") == "EXAMINE_TARGET"
    assert env.abstract_action("examine apple 1") == "OBSERVE_OTHER"
    _play(env, ["go to sidetable 1"])
    assert env.abstract_action("use desklamp 1") == "INSPECT_TARGET"


KEY_PAIRS = [
    (
        Goal("pick_and_place", "apple", "fridge"),
        Goal("pick_and_place", "pen", "drawer"),
        [
            "go to countertop 1",
            "take apple 1 from countertop 1",
            "go to fridge 1",
            "open fridge 1",
            "put apple 1 in/on fridge 1",
        ],
        ["go to desk 1", "take pen 2 from desk 1", "go to drawer 3", "open drawer 3", "put pen 2 in/on drawer 3"],
    ),
    (
        Goal("pick_heat_then_place", "mug", "fridge"),
        Goal("pick_heat_then_place", "mug", "drawer"),
        [
            "go to sidetable 1",
            "go to countertop 1",
            "take mug 1 from countertop 1",
            "inventory",
            "go to microwave 1",
            "heat mug 1 with microwave 1",
            "go to sidetable 1",
            "go to fridge 1",
            "open fridge 1",
            "put mug 1 in/on fridge 1",
        ],
        [
            "go to desk 1",
            "go to shelf 2",
            "take mug 3 from shelf 2",
            "go to kitchen",
            "go to microwave 1",
            "heat mug 3 with microwave 1",
            "go to bedroom",
            "go to drawer 3",
            "open drawer 3",
            "put mug 3 in/on drawer 3",
        ],
    ),
]


@pytest.mark.parametrize("goal_a,goal_b,actions_a,actions_b", KEY_PAIRS)
def test_progress_key_is_shared_by_worlds_with_the_same_visible_progress(goal_a, goal_b, actions_a, actions_b):
    """Different rooms, names, targets, destinations and unseen objects; the same agent-visible facts at
    every step: where B changes room, A stays put ('inventory') or walks to a receptacle that is neither
    tool nor destination, which leaves the same tracked facts."""
    env_a, env_b = HouseholdEnv(), HouseholdEnv()
    keys_a = [env_a.reset_layout(_kitchen(goal_a), "medium")[1]["progress_key"]]
    keys_a += [step[3]["progress_key"] for step in _play(env_a, actions_a)]
    keys_b = [env_b.reset_layout(_bedroom(goal_b), "medium")[1]["progress_key"]]
    keys_b += [step[3]["progress_key"] for step in _play(env_b, actions_b)]
    assert env_a.world.layout.goal != env_b.world.layout.goal
    assert env_a.step("look")[3]["won"] and env_b.step("look")[3]["won"]
    assert len(set(keys_a)) > len(actions_a) // 2  # the key does move with progress
    assert keys_a == keys_b


def test_progress_key_ignores_unvisited_receptacles_and_depends_on_visited_ones():
    env = HouseholdEnv()
    goal = Goal("pick_and_place", "apple", "fridge")
    plain, moved = _kitchen(goal), _kitchen(goal, (("apple 2", "drawer 1"),))
    moved = dataclasses.replace(
        moved, placements=tuple((obj, "drawer 1" if obj == "bread 1" else rec) for obj, rec in moved.placements)
    )
    route = ["go to countertop 1", "take apple 1 from countertop 1", "go to fridge 1", "open fridge 1"]
    keys = []
    for layout in (plain, moved):
        env.reset_layout(layout, "medium")
        keys.append([step[3]["progress_key"] for step in _play(env, route)])
    assert keys[0] == keys[1]
    peek = ["go to drawer 1", "open drawer 1"]  # the drawer holds an apple only in `moved`
    for layout in (plain, moved):
        env.reset_layout(layout, "medium")
        keys.append(_play(env, peek)[-1][3]["progress_key"])
    assert keys[2] != keys[3] and "seen=1" in keys[3] and "seen=0" in keys[2]


def test_progress_key_ignores_moving_a_distractor_between_receptacles_the_walkthrough_skips():
    env, rng = HouseholdEnv(), random.Random(0)
    checked = 0
    for task in HouseholdSuite().tasks("train", "hard", 100):
        layout = generate_layout(task.seed, TIERS["hard"])
        env.reset_layout(layout, "hard")
        plan = env.walkthrough()
        visited = {a.removeprefix("go to ") for a in plan if a.startswith("go to ")}
        unvisited = [r.name for r in layout.receptacles if r.name not in visited]
        movable = [
            i
            for i, (obj, rec) in enumerate(layout.placements)
            if rec in unvisited and kind_of(obj) != layout.goal.target
        ]
        if len(unvisited) < 2 or not movable:
            continue
        i = rng.choice(movable)
        placements = list(layout.placements)
        placements[i] = (placements[i][0], rng.choice([r for r in unvisited if r != placements[i][1]]))
        altered = dataclasses.replace(layout, placements=tuple(placements))
        traces = []
        for world in (layout, altered):
            env.reset_layout(world, "hard")
            traces.append([step[3]["progress_key"] for step in _play(env, plan)])
        assert traces[0] == traces[1]
        checked += 1
    assert checked >= 30


def test_progress_key_holds_no_instance_or_entity_names():
    suite, env, rng = HouseholdSuite(), HouseholdEnv(), random.Random(1)
    names = set(OBJECT_TYPES) | RECEPTACLE_KINDS
    for task in suite.tasks("train", "hard", 30):
        for step in _random_episode(env, task, rng, 50)[1:]:
            key = step[4]["progress_key"]
            assert " " not in key and not names & set(re.split(r"[|:,=]", key)), key


def test_labels_and_keys_are_pure_functions_of_goal_and_the_text_the_agent_saw():
    """A tracker fed only command and observation strings, no world at all."""
    goal, tracker = Goal("pick_and_place", "apple", "fridge"), Tracker()
    tracker.update("go to countertop 1", "you arrive at countertop 1 . on the countertop 1 , you see a apple 1 .")
    assert progress_key(goal, tracker) == (
        "role_v1|pick_and_place|place:role=unknown,held=0,near=0,seen=1,dest_seen=0,stage=1|done=0"
    )
    tracker.update("take apple 1 from countertop 1", "you pick up the apple 1 from the countertop 1 .")
    assert abstract_action_label(goal, tracker, "go to fridge 1") == "NAVIGATE_DESTINATION"
    tracker.update("go to fridge 1", "you arrive at fridge 1 . the fridge 1 is closed .")
    assert progress_key(goal, tracker) == (
        "role_v1|pick_and_place|place:role=held,held=1,near=1,seen=1,dest_seen=1,stage=2|done=0"
    )
    tracker.update("open fridge 1", "you open the fridge 1 . the fridge 1 is open . in it , you see nothing .")
    tracker.update("put apple 1 in/on fridge 1", "you put the apple 1 in/on the fridge 1 .")
    assert progress_key(goal, tracker) == (
        "role_v1|pick_and_place|place:role=at_target_recep,held=0,near=1,seen=1,dest_seen=1,stage=3|done=1"
    )


def test_corpus_covers_every_word_of_an_unseen_random_episode():
    suite = HouseholdSuite()
    vocabulary = {w for line in suite.corpus(n_tasks=60) for w in re.split(r"[\s.,]+", line) if w}
    assert len(vocabulary) < 400
    env, rng = HouseholdEnv(), random.Random(7)
    for tier in TIERS:
        for task in suite.tasks("test", tier, 10, offset=400):
            trace = _random_episode(env, task, rng, 50)
            texts = [trace[0][0], *trace[0][1]["admissible_commands"]]
            texts += [text for step in trace[1:] for text in (step[1], *step[4]["admissible_commands"])]
            missing = {w for text in texts for w in re.split(r"[\s.,]+", text) if w} - vocabulary
            assert not missing, missing


def test_a_thousand_random_steps_take_under_two_seconds():
    suite, env, rng = HouseholdSuite(), HouseholdEnv(), random.Random(0)
    tasks = suite.tasks("train", "hard", 50)
    _, info = env.reset(tasks[0])
    start, steps = time.perf_counter(), 0
    while steps < 1000:
        _, _, done, info = env.step(rng.choice(info["admissible_commands"]))
        steps += 1
        if done or steps % 50 == 0:
            _, info = env.reset(tasks[steps % 50])
    assert time.perf_counter() - start < 2.0


def test_the_corpus_digest_is_remembered_under_the_code_that_played_it(tmp_path, monkeypatch):
    """A run's start needs only the digest of household's corpus (it names the tiny model): after the first
    process played it, the next ones read it from the models folder; another suite seed, a changed
    fingerprint (another Python here; an edit of the environments' code likewise) or an unreadable memo play
    it again, and a suite whose corpus comes from outside the code (TextWorld's games) is played every time.
    The tiny model's directory is the one its real corpus names, also when a remembered digest is wrong."""
    import json
    import sys

    from horizonrl.config import load_config
    from horizonrl.envs import corpus_digest, sha256_lines
    from horizonrl.models.loading import tiny_model_dir
    from horizonrl.run.learner import initial_model_dir

    played = []

    def corpus() -> list[str]:
        played.append(1)
        return ["go to fridge 1", "open fridge 1"]

    digest = sha256_lines(corpus())
    played.clear()
    assert [corpus_digest("household", "easy", 0, corpus, tmp_path) for _ in range(3)] == [digest] * 3
    assert len(played) == 1
    assert corpus_digest("household", "easy", 1, corpus, tmp_path) == digest and len(played) == 2  # another seed
    monkeypatch.setattr(sys, "version", sys.version + " (another build)")
    assert corpus_digest("household", "easy", 0, corpus, tmp_path) == digest and len(played) == 3
    (tmp_path / "corpus-household-easy-0.json").write_text("{not json")
    assert corpus_digest("household", "easy", 0, corpus, tmp_path) == digest and len(played) == 4
    assert corpus_digest("textworld-coin", "easy", 0, corpus, tmp_path) == digest and len(played) == 5
    assert corpus_digest("textworld-coin", "easy", 0, corpus, tmp_path) == digest and len(played) == 6
    monkeypatch.undo()

    cfg = load_config(None, [f"data_dir={tmp_path / 'data'}", "model.tiny.hidden_size=16", "model.tiny.num_heads=2"])
    first = initial_model_dir(cfg, HouseholdSuite(cfg.env.suite_seed))
    real = sha256_lines(HouseholdSuite(cfg.env.suite_seed).corpus())
    assert json.loads((first / "horizonrl.json").read_text())["corpus"] == real
    corpus_of_seed = HouseholdSuite(cfg.env.suite_seed).corpus  # played again: a remembered digest gone stale
    assert tiny_model_dir(cfg.data_dir, "household", cfg.model, corpus_of_seed, corpus_sha256="0" * 64) == first
    monkeypatch.setattr(HouseholdSuite, "corpus", lambda self, n_tasks=200: pytest.fail("played again"))
    assert initial_model_dir(cfg, HouseholdSuite(cfg.env.suite_seed)) == first
