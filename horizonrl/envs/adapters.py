"""Adapters to benchmarks that need a package and downloaded data: ALFWorld, WebShop, AppWorld.

Each suite follows its benchmark's own protocol and splits, and fails at construction with a
``MissingBenchmark`` error that says what to install and where the data must be. Each environment
drives a *backend* (the benchmark's own object) through a small factory, so its mapping of
observations and actions onto this project's protocol is tested on recorded examples without the
benchmark installed.

* ``alfworld``: ALFWorld's TextWorld games (``json_2.1.1``; train / ``valid_seen`` as dev /
  ``valid_unseen`` as test), started as ``AlfredTWEnv`` does (``AlfredDemangler(shuffle=False)``,
  ``AlfredInfos``). Tier: ``all`` or one task type. Reward 1 on a win.
* ``webshop``: ``WebAgentTextEnv`` in text mode on human goals, split by goal index as in the WebShop
  baselines (test 0-499, dev 500-1499, train 1500-). Actions ``search[...]`` / ``click[...]``;
  ``info["score"]`` is WebShop's purchase reward, won iff it is 1.
* ``appworld``: ``AppWorld(task_id)``; an action is Python code for ``world.execute``; done once the
  code calls ``apis.supervisor.complete_task``; won iff ``world.evaluate()`` succeeds; score is the
  share of the task's tests passed. Tier ``normal`` or ``challenge`` picks ``test_normal`` or
  ``test_challenge``.

Progress keys and labels use only the instruction and what the agent saw (``progress.py``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from horizonrl.envs.base import Task
from horizonrl.envs.progress import action_label, content_words, render_key, split_command, tidy
from horizonrl.seeding import derive_seed

ALFWORLD_SPLITS = {"train": "train", "dev": "valid_seen", "test": "valid_unseen"}
ALFWORLD_FAMILIES = (
    "pick_and_place_simple",
    "look_at_obj_in_light",
    "pick_clean_then_place_in_recep",
    "pick_heat_then_place_in_recep",
    "pick_cool_then_place_in_recep",
    "pick_two_obj_and_place",
)
ALFWORLD_VERBS = (
    "go to",
    "take",
    "put",
    "move",
    "open",
    "close",
    "heat",
    "cool",
    "clean",
    "slice",
    "use",
    "examine",
    "look",
    "inventory",
    "toggle",
)
WEBSHOP_SPLITS = {"test": (0, 500), "dev": (500, 1500), "train": (1500, None)}
WEBSHOP_NAVIGATION = ("back to search", "next >", "< prev")
WEBSHOP_INFO = ("description", "features", "reviews", "attributes")
APPWORLD_SPLITS = {"train": "train", "dev": "dev", "test": "test_{tier}"}


class MissingBenchmark(RuntimeError):
    """The benchmark's package or data is not installed; the message says what to do."""


def _require(module: str, what: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise MissingBenchmark(what)


def _shuffled(items: list, *key: object) -> list:
    order = list(items)
    random.Random(derive_seed(*key)).shuffle(order)
    return order


# ---------------------------------------------------------------- ALFWorld

ALFWORLD_HELP = (
    "alfworld needs the ALFWorld package and its game files: `pip install alfworld` (it brings "
    "textworld), then `alfworld-download`, which writes json_2.1.1/{train,valid_seen,"
    "valid_unseen}/<task>/<trial>/game.tw-pddl under $ALFWORLD_DATA (default ~/.cache/alfworld)."
)


def alfworld_start(path: str, oracle: bool = False) -> Any:
    """A TextWorld env on one ALFWorld game, wrapped as ``AlfredTWEnv.init_env`` wraps it."""
    import textworld
    from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos

    infos = textworld.EnvInfos(won=True, admissible_commands=True, extras=["gamefile"], policy_commands=oracle)
    return textworld.start(path, request_infos=infos, wrappers=[AlfredDemangler(shuffle=False), AlfredInfos])


@dataclass
class AlfworldTracker:
    """From the goal and the valid commands played: holding a goal object, at a goal place, transformed."""

    goal_words: frozenset[str] = frozenset()
    held: str = ""
    at: str = ""
    transformed: bool = False

    def update(self, action: str) -> None:
        verb, argument = split_command(action, ALFWORLD_VERBS)
        if verb == "go to":
            self.at = argument
        elif verb == "take":
            self.held = argument.partition(" from ")[0]
        elif verb in ("put", "move"):
            self.held = ""
        elif verb in ("heat", "cool", "clean") and content_words(argument.partition(" with ")[0]) & self.goal_words:
            self.transformed = True

    def key(self, family: str, won: bool) -> str:
        return render_key(
            f"alfworld_v1|{family}",
            {
                "held_goal": bool(content_words(self.held) & self.goal_words),
                "at_goal": bool(content_words(self.at) & self.goal_words),
                "transformed": self.transformed,
                "won": won,
            },
        )


class AlfworldEnv:
    """One ALFWorld game; ``start(path)`` returns the wrapped TextWorld env (``alfworld_start``)."""

    def __init__(self, games: Callable[[Task], str], start: Callable[..., Any] = alfworld_start) -> None:
        self._games, self._start = games, start
        self._game: Any = None
        self._path, self._family, self._goal = "", "", ""
        self._tracker = AlfworldTracker()
        self._info: dict[str, Any] = {}

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        self.close()
        self._path, self._family = self._games(task), task.family
        self._game = self._start(self._path)
        state = self._game.reset()
        observation = tidy(state["feedback"])
        self._goal = observation.rpartition("Your task is to :")[2].strip()
        self._tracker = AlfworldTracker(goal_words=content_words(self._goal))
        self._info = self._info_of(state, valid=True)
        return observation, self._info

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        command = " ".join(action.split())
        valid = command in self._info["admissible_commands"]
        state, _, done = self._game.step(command)
        if valid:
            self._tracker.update(command)
        self._info = self._info_of(state, valid)
        return tidy(state["feedback"]), float(self._info["won"]), bool(done) or self._info["won"], self._info

    def _info_of(self, state: Any, valid: bool) -> dict[str, Any]:
        won = bool(state["won"])
        return {
            "won": won,
            "admissible_commands": sorted(state["admissible_commands"]),
            "valid": valid,
            "score": float(won),
            "progress_key": self._tracker.key(self._family, won),
            "family": self._family,
            "goal": self._goal,
        }

    def goal(self) -> str:
        return self._goal

    def abstract_action(self, action: str) -> str:
        return action_label(action, ALFWORLD_VERBS, self._tracker.goal_words)

    def walkthrough(self) -> list[str]:
        """The PDDL planner's policy from a second env on the same game (tests and warm-start only)."""
        oracle = self._start(self._path, oracle=True)
        try:
            return list(oracle.reset()["policy_commands"])
        finally:
            oracle.close()

    def close(self) -> None:
        if self._game is not None:
            self._game.close()
            self._game = None


class AlfworldSuite:
    """ALFWorld's games per split; task seed = position of the game in the split's sorted game list."""

    name = "alfworld"

    def __init__(
        self, seed: int = 0, data_dir: str | Path | None = None, start: Callable[..., Any] | None = None
    ) -> None:
        if start is None:
            _require("alfworld", ALFWORLD_HELP)
        self.seed, self._start = seed, start or alfworld_start
        self.data_dir = Path(data_dir or os.environ.get("ALFWORLD_DATA", "~/.cache/alfworld")).expanduser()
        missing = [s for s in ALFWORLD_SPLITS.values() if not (self.data_dir / "json_2.1.1" / s).is_dir()]
        if missing:
            raise MissingBenchmark(
                f"{ALFWORLD_HELP} Missing under {self.data_dir}: " + ", ".join(f"json_2.1.1/{s}" for s in missing)
            )
        self._lists: dict[str, list[Path]] = {}

    def games(self, split: str) -> list[Path]:
        """Every game file of the split, sorted (the index is the task seed)."""
        if split not in self._lists:
            root = self.data_dir / "json_2.1.1" / ALFWORLD_SPLITS[split]
            self._lists[split] = sorted(root.glob("*/*/game.tw-pddl"))
        return self._lists[split]

    def tasks(self, split: str, tier: str, n: int, offset: int = 0) -> list[Task]:
        """Solvable games of the tier's task types (not movable or sliced, as ``AlfredTWEnv`` skips)."""
        if tier != "all" and tier not in ALFWORLD_FAMILIES:
            raise ValueError(f"alfworld: tier must be 'all' or one of {ALFWORLD_FAMILIES}")
        chosen = []
        for index in _shuffled(range(len(self.games(split))), self.seed, self.name, split, tier):
            path = self.games(split)[index]
            family = path.parent.parent.name.partition("-")[0]
            if (
                tier in ("all", family)
                and "movable" not in str(path)
                and "Sliced" not in str(path)
                and json.loads(path.read_text()).get("solvable", True)
            ):
                chosen.append((index, family))
            if len(chosen) == offset + n:
                break
        return [Task(self.name, split, tier, offset + i, s, f) for i, (s, f) in enumerate(chosen[offset:])]

    def make(self) -> AlfworldEnv:
        return AlfworldEnv(lambda task: str(self.games(task.split)[task.seed]), self._start)

    def max_turns(self, tier: str) -> int:
        return 50

    def corpus(self, n_tasks: int = 200) -> list[str]:
        env, lines = self.make(), []
        for task in self.tasks("train", "all", min(n_tasks, 20)):
            observation, info = env.reset(task)
            lines += [observation, *info["admissible_commands"]]
            for action in env.walkthrough():
                observation, _, _, info = env.step(action)
                lines += [observation, *info["admissible_commands"]]
        env.close()
        return list(dict.fromkeys(lines))


# ---------------------------------------------------------------- WebShop

WEBSHOP_HELP = (
    "webshop needs the WebShop repository and its product data: `git clone "
    "https://github.com/princeton-nlp/WebShop`, run its `./setup.sh -d small` (or `-d all`), which "
    "installs its requirements (pyserini needs Java), downloads data/items_shuffle*.json, "
    "data/items_ins_v2*.json and data/items_human_ins.json and builds search_engine/indexes*, then put "
    "the repository on PYTHONPATH so that `import web_agent_site` works."
)


@dataclass
class WebshopState:
    """The visible page: its kind, the options clicked since the last item was opened."""

    page: str = "search"
    options: set[str] = field(default_factory=set)


def webshop_page(available: dict[str, Any]) -> str:
    """search / results / item / detail, from the clickables WebShop reports for the page."""
    clickables = available.get("clickables", [])
    if available.get("has_search_bar"):
        return "search"
    if "buy now" in clickables:
        return "item"
    return (
        "results" if "next >" in clickables or any(re.fullmatch(r"b[0-9a-z]{9}", c) for c in clickables) else "detail"
    )


def webshop_label(instruction_words: frozenset[str], page: str, action: str) -> str:
    """SEARCH, BUY, NAVIGATE, OPEN_ITEM, INSPECT_ITEM, OPTION_GOAL / OPTION_OTHER, INVALID."""
    verb, _, rest = action.strip().lower().partition("[")
    argument = rest.rstrip("]")
    if verb == "search":
        return "SEARCH"
    if verb != "click":
        return "INVALID"
    if argument == "buy now":
        return "BUY"
    if argument in WEBSHOP_NAVIGATION:
        return "NAVIGATE"
    if argument in WEBSHOP_INFO:
        return "INSPECT_ITEM"
    if page == "results":
        return "OPEN_ITEM"
    return "OPTION_GOAL" if content_words(argument) & instruction_words else "OPTION_OTHER"


class WebshopEnv:
    """One WebShop session; ``backend()`` returns a ``WebAgentTextEnv`` (text mode, shared server)."""

    def __init__(self, backend: Callable[[], Any]) -> None:
        self._backend, self._web = backend, None
        self._instruction, self._state, self._info = "", WebshopState(), {}

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        self._web = self._web or self._backend()
        observation, _ = self._web.reset(session=task.seed)
        self._instruction = tidy(self._web.get_instruction_text())
        self._state = WebshopState()
        self._info = self._info_of(reward=0.0, done=False, valid=True)
        return tidy(observation.replace("[SEP]", "\n")), self._info

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        command = action.strip()
        valid = command in self._info["admissible_commands"] or (
            command.startswith("search[") and self._state.page == "search"
        )
        observation, reward, done, _ = self._web.step(command)
        label = webshop_label(content_words(self._instruction), self._state.page, command)
        if label.startswith("OPTION"):
            self._state.options.add(command)
        elif label == "OPEN_ITEM":
            self._state.options.clear()
        self._info = self._info_of(float(reward), bool(done), valid)
        return tidy(observation.replace("[SEP]", "\n")), float(self._info["won"]), bool(done), self._info

    def _info_of(self, reward: float, done: bool, valid: bool) -> dict[str, Any]:
        available = self._web.get_available_actions()
        self._state.page = "done" if done else webshop_page(available)
        commands = [f"click[{c}]" for c in available.get("clickables", []) if c != "search"]
        if available.get("has_search_bar"):
            commands.append(f"search[{self._instruction.lower()}]")
        return {
            "won": done and reward >= 1.0,
            "admissible_commands": sorted(commands),
            "valid": valid,
            "score": reward,
            "family": "webshop",
            "goal": self._instruction,
            "progress_key": render_key(
                "webshop_v1", {"page": self._state.page, "options": min(len(self._state.options), 3)}
            ),
        }

    def goal(self) -> str:
        return self._instruction

    def abstract_action(self, action: str) -> str:
        return webshop_label(content_words(self._instruction), self._state.page, action)

    def walkthrough(self) -> list[str]:
        raise NotImplementedError("webshop: the environment has no oracle walkthrough for human goals")

    def close(self) -> None:
        self._web = None


class WebshopSuite:
    """WebShop human goals; one product server per process, shared by every environment."""

    name = "webshop"

    def __init__(
        self,
        seed: int = 0,
        num_products: int | None = 1000,
        backend: Callable[[], Any] | None = None,
        n_goals: int | None = None,
    ) -> None:
        if backend is None:
            _require("web_agent_site", WEBSHOP_HELP)
            from web_agent_site.utils import DEFAULT_FILE_PATH

            if not Path(DEFAULT_FILE_PATH).exists():
                raise MissingBenchmark(f"{WEBSHOP_HELP} Missing: {Path(DEFAULT_FILE_PATH).resolve()}")
        self.seed, self.num_products = seed, num_products
        self._backend, self._server, self._n_goals = backend, None, n_goals

    def _web(self) -> Any:
        if self._backend is not None:
            return self._backend()
        from web_agent_site.envs.web_agent_text_env import WebAgentTextEnv

        web = WebAgentTextEnv(
            observation_mode="text", num_products=self.num_products, human_goals=True, server=self._server
        )
        self._server = web.server
        return web

    def tasks(self, split: str, tier: str, n: int, offset: int = 0) -> list[Task]:
        if self._n_goals is None:
            self._n_goals = len(self._web().server.goals)
        start, stop = WEBSHOP_SPLITS[split]
        goals = _shuffled(list(range(start, min(stop or self._n_goals, self._n_goals))), self.seed, self.name, split)
        return [
            Task(self.name, split, tier, offset + i, g, "webshop") for i, g in enumerate(goals[offset : offset + n])
        ]

    def make(self) -> WebshopEnv:
        return WebshopEnv(self._web)

    def max_turns(self, tier: str) -> int:
        return 15

    def corpus(self, n_tasks: int = 200) -> list[str]:
        env, lines = self.make(), []
        for task in self.tasks("train", "all", min(n_tasks, 50)):
            observation, info = env.reset(task)
            lines += [observation, *info["admissible_commands"]]
        return list(dict.fromkeys(lines))


# ---------------------------------------------------------------- AppWorld

APPWORLD_HELP = (
    "appworld needs the AppWorld package and its data: `pip install appworld` (in its own "
    "environment if its pins clash), `appworld install`, then `appworld download data`, which writes "
    "./data (tasks, datasets, base_dbs) under $APPWORLD_ROOT (default: the working directory)."
)
_API_CALL = re.compile(r"apis\.(\w+)\.(\w+)")


def appworld_label(instruction_words: frozenset[str], code: str) -> str:
    """COMPLETE, SUPERVISOR, CALL_GOAL (an app the instruction names), CALL_OTHER, CODE (no API call)."""
    calls = _API_CALL.findall(code)
    if any(api == "complete_task" for _, api in calls):
        return "COMPLETE"
    if not calls:
        return "CODE"
    app = calls[0][0]
    if app in ("supervisor", "api_docs"):
        return "SUPERVISOR" if app == "supervisor" else "READ_DOCS"
    return "CALL_GOAL" if app in instruction_words else "CALL_OTHER"


class AppworldEnv:
    """One AppWorld task; ``open_world(task_id)`` returns an ``AppWorld`` (closed on reset and close)."""

    def __init__(self, open_world: Callable[[str], Any], task_id: Callable[[Task], str]) -> None:
        self._open, self._task_id, self._world = open_world, task_id, None
        self._instruction, self._ok_calls, self._info = "", 0, {}

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        self.close()
        self._world = self._open(self._task_id(task))
        self._instruction = str(self._world.task.instruction)
        self._ok_calls = 0
        self._info = self._info_of(won=False, score=0.0, valid=True, failed=False)
        return self._instruction, self._info

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        output = str(self._world.execute(action))
        failed = output.startswith("Execution failed")
        self._ok_calls += 0 if failed else 1
        done = bool(self._world.task_completed())
        result = self._world.evaluate().to_dict() if done else {}
        tests = len(result.get("passes", [])) + len(result.get("failures", []))
        score = len(result.get("passes", [])) / tests if tests else 0.0
        self._info = self._info_of(won=bool(result.get("success")), score=score, valid=not failed, failed=failed)
        return output, float(self._info["won"]), done, self._info

    def _info_of(self, won: bool, score: float, valid: bool, failed: bool) -> dict[str, Any]:
        key = render_key("appworld_v1", {"ok_calls": min(self._ok_calls, 5), "last_failed": failed})
        return {
            "won": won,
            "admissible_commands": [],
            "valid": valid,
            "score": score,
            "progress_key": key,
            "family": "appworld",
            "goal": self._instruction,
        }

    def goal(self) -> str:
        return self._instruction

    def abstract_action(self, action: str) -> str:
        return appworld_label(content_words(self._instruction), action)

    def walkthrough(self) -> list[str]:
        raise NotImplementedError("appworld: actions are free-form code; no walkthrough is exposed")

    def close(self) -> None:
        if self._world is not None:
            self._world.close()
            self._world = None


class AppworldSuite:
    """AppWorld's datasets; task seed = position of the task id in its dataset's list."""

    name = "appworld"

    def __init__(
        self,
        seed: int = 0,
        open_world: Callable[[str], Any] | None = None,
        load_task_ids: Callable[[str], list[str]] | None = None,
    ) -> None:
        if open_world is None or load_task_ids is None:
            _require("appworld", APPWORLD_HELP)
            root = Path(os.environ.get("APPWORLD_ROOT", ".")).resolve()
            if not (root / "data" / "datasets").is_dir():
                raise MissingBenchmark(f"{APPWORLD_HELP} Missing: {root / 'data' / 'datasets'}")
            from appworld import AppWorld
            from appworld import load_task_ids as appworld_task_ids

            open_world = open_world or (lambda task_id: AppWorld(task_id=task_id, experiment_name="horizonrl"))
            load_task_ids = load_task_ids or appworld_task_ids
        self.seed, self._open, self._load = seed, open_world, load_task_ids
        self._ids: dict[str, list[str]] = {}

    def task_ids(self, split: str, tier: str) -> list[str]:
        """The benchmark's task ids of the dataset that ``split`` and ``tier`` name."""
        if tier not in ("normal", "challenge"):
            raise ValueError("appworld: tier must be 'normal' or 'challenge' (it picks the test set)")
        dataset = APPWORLD_SPLITS[split].format(tier=tier)
        if dataset not in self._ids:
            self._ids[dataset] = list(self._load(dataset))
        return self._ids[dataset]

    def tasks(self, split: str, tier: str, n: int, offset: int = 0) -> list[Task]:
        order = _shuffled(list(range(len(self.task_ids(split, tier)))), self.seed, self.name, split, tier)
        return [
            Task(self.name, split, tier, offset + i, s, "appworld") for i, s in enumerate(order[offset : offset + n])
        ]

    def make(self) -> AppworldEnv:
        return AppworldEnv(self._open, lambda task: self.task_ids(task.split, task.tier)[task.seed])

    def max_turns(self, tier: str) -> int:
        return 40

    def corpus(self, n_tasks: int = 200) -> list[str]:
        env, lines = self.make(), []
        for task in self.tasks("train", "normal", min(n_tasks, 20)):
            lines.append(env.reset(task)[0])
        env.close()
        return lines


ADAPTERS: dict[str, Callable[..., Any]] = {
    "alfworld": AlfworldSuite,
    "webshop": WebshopSuite,
    "appworld": AppworldSuite,
}
