"""ALFWorld, WebShop and AppWorld adapters: the install message when a benchmark is missing, and the
mapping of each benchmark's observations and actions onto the protocol, on small recorded examples
written by hand (no benchmark installed)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from horizonrl.envs import SUITES, make_suite
from horizonrl.envs.adapters import (
    AlfworldSuite,
    AppworldSuite,
    MissingBenchmark,
    WebshopSuite,
    appworld_label,
    webshop_page,
)
from horizonrl.envs.base import Task

# ---------------------------------------------------------------- missing benchmarks


@pytest.fixture
def nothing_installed(monkeypatch):
    """Make the three benchmark packages look absent, whatever this machine has."""
    real = importlib.util.find_spec
    absent = {"alfworld", "web_agent_site", "appworld"}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in absent else real(name, *a))


@pytest.mark.parametrize(
    "name,words",
    [
        ("alfworld", ["pip install alfworld", "alfworld-download", "ALFWORLD_DATA", "game.tw-pddl"]),
        ("webshop", ["github.com/princeton-nlp/WebShop", "setup.sh", "items_shuffle", "PYTHONPATH", "web_agent_site"]),
        ("appworld", ["pip install appworld", "appworld install", "appworld download data", "APPWORLD_ROOT"]),
    ],
)
def test_a_missing_package_says_what_to_install_and_where_the_data_goes(nothing_installed, name, words):
    assert name in SUITES
    with pytest.raises(MissingBenchmark) as err:
        make_suite(name)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_missing_data_names_the_missing_folders(tmp_path, monkeypatch):
    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path))
    with pytest.raises(MissingBenchmark, match="json_2.1.1/valid_unseen"):
        AlfworldSuite(start=lambda path, oracle=False: None)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "appworld" else real(n, *a))
    monkeypatch.setenv("APPWORLD_ROOT", str(tmp_path))
    with pytest.raises(MissingBenchmark, match=str(tmp_path / "data" / "datasets")):
        AppworldSuite()


# ---------------------------------------------------------------- ALFWorld


class RecordedGame:
    """A TextWorld env replaying recorded ALFWorld states (feedback, admissible commands, won)."""

    ADMISSIBLE = [
        "go to countertop 1",
        "go to diningtable 1",
        "go to fridge 1",
        "go to sinkbasin 1",
        "inventory",
        "look",
    ]
    STATES = {
        None: (
            "-= Welcome to TextWorld, ALFRED! =-\n\nYou are in the middle of a room. Looking quickly around you, "
            "you see a countertop 1, a diningtable 1, a fridge 1, and a sinkbasin 1.\n\n"
            "Your task is to: put a clean lettuce in diningtable.",
            False,
        ),
        "go to countertop 1": ("You arrive at loc 5. On the countertop 1, you see a lettuce 1, and a knife 1.", False),
        "take lettuce 1 from countertop 1": ("You pick up the lettuce 1 from the countertop 1.", False),
        "go to sinkbasin 1": ("You arrive at loc 8. On the sinkbasin 1, you see nothing.", False),
        "clean lettuce 1 with sinkbasin 1": ("You clean the lettuce 1 using the sinkbasin 1.", False),
        "go to diningtable 1": ("You arrive at loc 2. On the diningtable 1, you see a bread 1.", False),
        "put lettuce 1 in/on diningtable 1": ("You put the lettuce 1 in/on the diningtable 1.", True),
        "jump": ("Nothing happens.", False),
    }
    PLAN = [
        "go to countertop 1",
        "take lettuce 1 from countertop 1",
        "go to sinkbasin 1",
        "clean lettuce 1 with sinkbasin 1",
        "go to diningtable 1",
        "put lettuce 1 in/on diningtable 1",
    ]

    def __init__(self, path: str, oracle: bool = False) -> None:
        self.path, self.oracle, self.closed = path, oracle, False

    def _state(self, command):
        feedback, won = self.STATES[command]
        follow = {
            "take lettuce 1 from countertop 1",
            "clean lettuce 1 with sinkbasin 1",
            "put lettuce 1 in/on diningtable 1",
        }
        state = {
            "feedback": feedback,
            "won": won,
            "admissible_commands": list(reversed(self.ADMISSIBLE)) + sorted(follow),
        }
        return state | ({"policy_commands": list(self.PLAN)} if self.oracle else {})

    def reset(self):
        return self._state(None)

    def step(self, command):
        state = self._state(command)
        return state, float(state["won"]), state["won"]

    def close(self):
        self.closed = True


def _alfworld_data(root):
    """Three splits of hand-made game folders: one movable trial and one unsolvable game are skipped."""
    folders = {
        "train": [
            "pick_clean_then_place_in_recep-Lettuce-None-DiningTable-17/trial_1",
            "pick_and_place_simple-Mug-None-Desk-3/trial_2",
            "pick_and_place_simple-Pen-None-Desk-3/trial_3",
            "pick_and_place_with_movable_recep-Pen-Bowl-Desk-3/trial_4",
            "look_at_obj_in_light-Book-None-DeskLamp-5/trial_5",
        ],
        "valid_seen": ["pick_and_place_simple-Cup-None-Shelf-1/trial_6"],
        "valid_unseen": ["pick_two_obj_and_place-Cd-None-Safe-2/trial_7"],
    }
    for split, names in folders.items():
        for name in names:
            folder = root / "json_2.1.1" / split / name
            folder.mkdir(parents=True)
            (folder / "game.tw-pddl").write_text(json.dumps({"solvable": "Pen" not in name or "movable" in name}))
            (folder / "traj_data.json").write_text("{}")


def test_alfworld_splits_tiers_and_skipped_games(tmp_path):
    _alfworld_data(tmp_path)
    suite = AlfworldSuite(data_dir=tmp_path, start=RecordedGame)
    train = suite.tasks("train", "all", 10)
    assert sorted(t.family for t in train) == [
        "look_at_obj_in_light",
        "pick_and_place_simple",
        "pick_clean_then_place_in_recep",
    ]
    assert [t.family for t in suite.tasks("train", "pick_and_place_simple", 10)] == ["pick_and_place_simple"]
    assert [(t.split, t.family) for t in suite.tasks("test", "all", 10)] == [("test", "pick_two_obj_and_place")]
    paths = {s: {str(suite.games(s)[t.seed]) for t in suite.tasks(s, "all", 10)} for s in ("train", "dev", "test")}
    assert not paths["train"] & paths["dev"] and not paths["train"] & paths["test"]
    assert suite.tasks("train", "all", 2, offset=1) == train[1:3]
    with pytest.raises(ValueError):
        suite.tasks("train", "pick_anything", 1)


def test_alfworld_maps_observations_actions_and_progress(tmp_path):
    _alfworld_data(tmp_path)
    suite = AlfworldSuite(data_dir=tmp_path, start=RecordedGame)
    task = next(t for t in suite.tasks("train", "all", 10) if t.family == "pick_clean_then_place_in_recep")
    env = suite.make()
    observation, info = env.reset(task)
    assert observation.endswith("Your task is to : put a clean lettuce in diningtable .")
    assert env.goal() == info["goal"] == "put a clean lettuce in diningtable ."
    assert info["admissible_commands"] == sorted(info["admissible_commands"]) and info["score"] == 0.0
    assert (
        info["progress_key"] == "alfworld_v1|pick_clean_then_place_in_recep|held_goal=0|at_goal=0|transformed=0|won=0"
    )
    assert env.walkthrough() == RecordedGame.PLAN
    observation, reward, done, info = env.step("jump")
    assert (observation, reward, done, info["valid"]) == ("Nothing happens .", 0.0, False, False)
    labels, keys = [], []
    for action in RecordedGame.PLAN:
        labels.append(env.abstract_action(action))
        observation, reward, done, info = env.step(action)
        keys.append(info["progress_key"].split("|", 2)[2])
    assert labels == ["GO_TO_OTHER", "TAKE_GOAL", "GO_TO_OTHER", "CLEAN_GOAL", "GO_TO_GOAL", "PUT_GOAL"]
    assert keys == [
        "held_goal=0|at_goal=0|transformed=0|won=0",
        "held_goal=1|at_goal=0|transformed=0|won=0",
        "held_goal=1|at_goal=0|transformed=0|won=0",
        "held_goal=1|at_goal=0|transformed=1|won=0",
        "held_goal=1|at_goal=1|transformed=1|won=0",
        "held_goal=0|at_goal=1|transformed=1|won=1",
    ]
    assert (reward, done, info["won"], info["score"]) == (1.0, True, True, 1.0)
    env.close()


# ---------------------------------------------------------------- WebShop

INSTRUCTION = "i need a red cotton t-shirt in size small , and price lower than 30.00 dollars"
ITEM = ["back to search", "< prev", "description", "features", "reviews", "buy now", "red", "blue", "small", "large"]
PAGES = {  # action -> (text observation, has_search_bar, clickables, reward, done)
    None: (f"WebShop [SEP] Instruction: [SEP] {INSTRUCTION} [SEP] Search", True, ["search"], 0.0, False),
    "search[red cotton t-shirt]": (
        "Back to Search [SEP] Page 1 (Total results: 50) [SEP] Next > [SEP] B09ABC1234 [SEP] Red Cotton Tee [SEP] "
        "$19.99 [SEP] B08XYZ9876 [SEP] Blue Shirt [SEP] $25.00",
        False,
        ["back to search", "next >", "b09abc1234", "b08xyz9876"],
        0.0,
        False,
    ),
    "click[b09abc1234]": (
        "Back to Search [SEP] < Prev [SEP] color [SEP] red [SEP] blue [SEP] size [SEP] small [SEP] "
        "large [SEP] Red Cotton Tee [SEP] Price: $19.99 [SEP] Buy Now",
        False,
        ITEM,
        0.0,
        False,
    ),
    "click[red]": ("You have clicked red .", False, ITEM, 0.0, False),
    "click[large]": ("You have clicked large .", False, ITEM, 0.0, False),
    "click[description]": (
        "Back to Search [SEP] < Prev [SEP] A soft red tee .",
        False,
        ["back to search", "< prev"],
        0.0,
        False,
    ),
    "click[< prev]": ("Back to Search [SEP] < Prev [SEP] Buy Now", False, ITEM, 0.0, False),
    "click[buy now]": (
        "Thank you for shopping with us! [SEP] Your score (min 0.0, max 1.0) [SEP] 0.75",
        False,
        [],
        0.75,
        True,
    ),
}


class RecordedShop:
    """A WebAgentTextEnv replaying recorded pages; ``session`` is the goal index."""

    def __init__(self) -> None:
        self.page, self.sessions = PAGES[None], []

    def reset(self, session=None):
        self.sessions.append(session)
        self.page = PAGES[None]
        return self.page[0], None

    def get_instruction_text(self):
        return INSTRUCTION

    def get_available_actions(self):
        return {"has_search_bar": self.page[1], "clickables": list(self.page[2])}

    def step(self, action):
        self.page = PAGES.get(action, self.page)  # WebShop ignores an action it cannot parse or click
        return self.page[0], self.page[3], self.page[4], None


def test_webshop_splits_follow_the_baselines_goal_ranges():
    suite = WebshopSuite(backend=RecordedShop, n_goals=2000)
    seeds = {split: {t.seed for t in suite.tasks(split, "all", 5000)} for split in ("train", "dev", "test")}
    assert seeds["test"] == set(range(500)) and seeds["dev"] == set(range(500, 1500))
    assert seeds["train"] == set(range(1500, 2000))


def test_webshop_maps_pages_actions_and_progress():
    shop = RecordedShop()
    env = WebshopSuite(backend=lambda: shop, n_goals=2000).make()
    observation, info = env.reset(Task("webshop", "test", "all", 0, 7, "webshop"))
    assert shop.sessions == [7] and observation.splitlines()[:2] == ["WebShop", "Instruction :"]
    assert info["admissible_commands"] == [f"search[{INSTRUCTION}]"] and info["goal"] == INSTRUCTION
    assert info["progress_key"] == "webshop_v1|page=search|options=0"
    script = [
        "search[red cotton t-shirt]",
        "click[b09abc1234]",
        "click[red]",
        "click[large]",
        "click[description]",
        "click[< prev]",
        "click[buy now]",
    ]
    labels, pages, valid = [], [], []
    for action in script:
        labels.append(env.abstract_action(action))
        observation, reward, done, info = env.step(action)
        pages.append(info["progress_key"].removeprefix("webshop_v1|"))
        valid.append(info["valid"])
    assert labels == ["SEARCH", "OPEN_ITEM", "OPTION_GOAL", "OPTION_OTHER", "INSPECT_ITEM", "NAVIGATE", "BUY"]
    assert pages == [
        "page=results|options=0",
        "page=item|options=0",
        "page=item|options=1",
        "page=item|options=2",
        "page=detail|options=2",
        "page=item|options=2",
        "page=done|options=2",
    ]
    assert valid == [True] * 7  # a free-text search is valid on the search page
    assert (reward, done, info["won"], info["score"]) == (0.0, True, False, 0.75)  # bought, but not a match
    assert webshop_page({"has_search_bar": False, "clickables": ["back to search", "b0123456789"[:10]]}) == "results"
    assert env.step("click[nonexistent]")[3]["valid"] is False


# ---------------------------------------------------------------- AppWorld


class RecordedWorld:
    """An AppWorld task replaying recorded outputs of ``execute``."""

    OUTPUTS = {
        "print(apis.api_docs.show_app_descriptions())": "[{'name': 'spotify', 'description': 'music'}]",
        "apis.supervisor.show_account_passwords()": "[{'account_name': 'spotify', 'password': 'x'}]",
        "token = apis.spotify.login(username='a@b.c', password='x')": "",
        "apis.venmo.show_balance()": "Execution failed. Traceback:\n  Exception: not logged in",
        "n = len(apis.spotify.show_song_library(access_token=token))": "",
        "apis.supervisor.complete_task(answer=n)": "",
    }

    def __init__(self, task_id: str) -> None:
        self.task_id, self.completed, self.closed = task_id, False, False
        self.task = type("T", (), {"instruction": "How many songs are in my Spotify song library?"})()

    def execute(self, code):
        self.completed = self.completed or "complete_task" in code
        return self.OUTPUTS.get(code, "Execution failed. Traceback:\n  NameError")

    def task_completed(self):
        return self.completed

    def evaluate(self):
        return type(
            "E", (), {"to_dict": lambda self: {"success": False, "passes": ["a", "b", "c"], "failures": ["d"]}}
        )()

    def close(self):
        self.closed = True


def test_appworld_maps_code_outputs_completion_and_tests():
    opened = []

    def open_world(task_id):
        opened.append(RecordedWorld(task_id))
        return opened[-1]

    suite = AppworldSuite(open_world=open_world, load_task_ids=lambda dataset: [f"{dataset}_{i}" for i in range(4)])
    assert [t.seed for t in suite.tasks("test", "challenge", 9)] != [] and len(suite.tasks("dev", "normal", 9)) == 4
    env = suite.make()
    task = suite.tasks("test", "challenge", 1)[0]
    observation, info = env.reset(task)
    assert opened[-1].task_id == f"test_challenge_{task.seed}" and observation == info["goal"] == env.goal()
    assert info["admissible_commands"] == [] and info["progress_key"] == "appworld_v1|ok_calls=0|last_failed=0"
    labels, rows = [], []
    for code in RecordedWorld.OUTPUTS:
        labels.append(env.abstract_action(code))
        observation, reward, done, info = env.step(code)
        rows.append((info["valid"], done, info["progress_key"].removeprefix("appworld_v1|")))
    assert labels == ["READ_DOCS", "SUPERVISOR", "CALL_GOAL", "CALL_OTHER", "CALL_GOAL", "COMPLETE"]
    assert rows == [
        (True, False, "ok_calls=1|last_failed=0"),
        (True, False, "ok_calls=2|last_failed=0"),
        (True, False, "ok_calls=3|last_failed=0"),
        (False, False, "ok_calls=3|last_failed=1"),
        (True, False, "ok_calls=4|last_failed=0"),
        (True, True, "ok_calls=5|last_failed=0"),
    ]
    assert (reward, info["won"], info["score"]) == (0.0, False, 0.75)  # 3 of 4 tests passed
    assert appworld_label(frozenset(), "x = 1") == "CODE"
    env.reset(task)
    assert opened[-2].closed  # a new episode closes the previous world
    env.close()
    assert opened[-1].closed
