"""TextWorld challenge games (``textworld-coin``, ``textworld-treasure``, ``textworld-cooking``).

Games come from TextWorld's own generator, ``tw-make <challenge> <options> --seed S``, one game per task
seed, cached as ``<data>/envs/textworld/<game-set>/<S>.z8`` (with its ``.json``) and reused. A game is
generated in a private temporary folder and moved into place with ``os.replace`` (the ``.json`` first,
then the ``.z8`` that marks the game complete), so concurrent runs never read a half-written game;
two runs that race on one seed write identical files.

Tiers carry the challenge's difficulty options: presets ``easy``/``medium``/``hard`` or an explicit
spec in the challenge's own terms, ``level7`` (coin collector 1-300, treasure hunter 1-30) or
``recipe2-take2-go6-open-cook-cut[-drop]`` (cooking). Splits are disjoint seed lists; the cooking
challenge also draws ``train``/``dev``/``test`` games from its own food splits (``--split
train|valid|test``), so its test games use foods and preparations unseen in training.

``info["score"]`` is the game's score over its max score; the reward is 1 on the turn the game is
won, as in ``household``. The progress key and the action labels read only the objective, the recipe
once the agent has read it, the observations and the reported score (``progress.py``); the
walkthrough is read only by ``walkthrough()`` (tests).

With ``games`` (``env.games``) the suite plays the user's own games instead (``textworld_games.py``:
how they are found, checked and split); the challenge then only picks the progress key (cooking's
adds whether the recipe was read) and the tier is only a label in task ids.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from horizonrl.envs.base import Task, played_lines
from horizonrl.envs.progress import action_label, content_words, game_info, render_key, tidy
from horizonrl.envs.textworld_games import GameFolder, UserGame, load_games
from horizonrl.seeding import derive_seed

CHALLENGES = MappingProxyType(
    {
        "textworld-coin": "tw-coin_collector",
        "textworld-treasure": "tw-treasure_hunter",
        "textworld-cooking": "tw-cooking",
    }
)
PRESETS = MappingProxyType(
    {
        "tw-coin_collector": {"easy": "level5", "medium": "level105", "hard": "level205"},
        "tw-treasure_hunter": {"easy": "level5", "medium": "level15", "hard": "level25"},
        "tw-cooking": {
            "easy": "recipe1-take1-go1",
            "medium": "recipe2-take2-go6-open-cook-cut",
            "hard": "recipe3-take3-go9-open-cook-cut-drop",
        },
    }
)
COOKING_SPLITS = MappingProxyType({"train": "train", "dev": "valid", "test": "test"})  # ours -> tw-cooking's
TEST_SHARE = 10  # a seed is in test iff seed % 10 == 0, in dev iff == 1 (cooking), else in train
FROTZ_SEED = 1234  # the z-machine's random seed: fixed so that replaying a game's actions replays its text
_log = logging.getLogger(__name__)  # reaches the terminal and Prefect through PREFECT_LOGGING_EXTRA_LOGGERS=horizonrl
GENERATE_TIMEOUT_S = 600
VERBS = (
    "go",
    "take",
    "drop",
    "put",
    "insert",
    "open",
    "close",
    "unlock",
    "lock",
    "examine",
    "look",
    "inventory",
    "eat",
    "cook",
    "slice",
    "dice",
    "chop",
    "prepare",
    "read",
)
_NOISE = re.compile(r"^([\s_$|\\/<>]*|>.*)$")  # the title's ASCII art; the prompt with its status bar


@dataclass(frozen=True)
class GameSpec:
    """One game set: the challenge, its ``tw-make`` options and the horizon they call for."""

    challenge: str
    options: tuple[str, ...]
    horizon: int
    name: str  # folder name under data/envs/textworld


def game_spec(challenge: str, tier: str, split: str) -> GameSpec:
    """The ``tw-make`` options of ``tier`` (a preset or an explicit spec); cooking adds its food split."""
    spec = PRESETS[challenge].get(tier, tier)
    if challenge == "tw-cooking":
        options, horizon = _cooking_options(spec)
        options += ("--split", COOKING_SPLITS[split])
        return GameSpec(challenge, options, horizon, f"{challenge}-{spec}-{COOKING_SPLITS[split]}")
    match = re.fullmatch(r"level(\d+)", spec)
    if match is None:
        raise ValueError(f"{challenge}: tier {tier!r} is neither a preset {tuple(PRESETS[challenge])} nor 'level<N>'")
    level = int(match.group(1))
    return GameSpec(challenge, ("--level", str(level)), _level_horizon(challenge, level), f"{challenge}-{spec}")


def _level_horizon(challenge: str, level: int) -> int:
    """10 + 2 turns a room (coin collector) or 3 (treasure hunter: doors, containers, keys)."""
    if challenge == "tw-coin_collector":
        rooms = ((level - 1) // 100 + 1) * ((level - 1) % 100 + 1)
        return 10 + 2 * rooms
    rooms = 5 if level <= 10 else 10 if level <= 20 else 20
    return 10 + 3 * rooms


def _cooking_options(spec: str) -> tuple[tuple[str, ...], int]:
    """'recipe2-take2-go6-open-cook-cut' -> tw-make flags; horizon 20 + 10 a recipe item + 2 a room."""
    values = {"recipe": 1, "take": 0, "go": 1}
    options: list[str] = []
    for part in spec.split("-"):
        match = re.fullmatch(r"(recipe|take|go)(\d+)", part)
        if match:
            values[match.group(1)] = int(match.group(2))
        elif part in ("open", "cook", "cut", "drop"):
            options.append(f"--{part}")
        else:
            raise ValueError(
                f"tw-cooking: unknown tier part {part!r} in {spec!r} (recipeN, takeN, goN, open, cook, cut, drop)"
            )
    flags = [f"--{name}={value}" for name, value in values.items()]
    return tuple(flags + options), 20 + 10 * values["recipe"] + 2 * values["go"]


def tw_make_path() -> str:
    """The ``tw-make`` script of the running interpreter's environment (a venv need not be on PATH)."""
    beside = Path(sys.executable).with_name("tw-make")
    found = str(beside) if beside.exists() else shutil.which("tw-make")
    if found is None:
        raise RuntimeError("tw-make not found: install the extra, `pip install -e '.[textworld]'` (textworld==1.7.0)")
    return found


def ensure_game(root: Path, spec: GameSpec, seed: int) -> Path:
    """The cached game of ``seed``, generated with ``tw-make`` on first use (atomic, race-safe)."""
    path = root / spec.name / f"{seed}.z8"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    _log.info(
        "TextWorld: generating game %s seed %d with tw-make (3-6 s a game, cached in %s)", spec.name, seed, path.parent
    )
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".tmp-{seed}-") as tmp:
        out = Path(tmp) / "game.z8"
        command = [
            tw_make_path(),
            spec.challenge,
            *spec.options,
            "--seed",
            str(seed),
            "--output",
            str(out),
            "--silent",
            "-f",
        ]
        done = subprocess.run(command, capture_output=True, text=True, timeout=GENERATE_TIMEOUT_S)
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(f"tw-make failed ({' '.join(command[1:])}): {(done.stderr or done.stdout)[-2000:]}")
        os.replace(out.with_suffix(".json"), path.with_suffix(".json"))
        os.replace(out, path)
    return path


def clean(feedback: str) -> str:
    """The game's text without the ASCII-art title and the '> -= Room =-0/2' prompt line, tidied."""
    return tidy("\n".join(line for line in feedback.splitlines() if not _NOISE.match(line)))


def split_of(seed: int, splits: tuple[str, ...]) -> str:
    """'test' for seed % 10 == 0, 'dev' for 1 where the suite has a dev split, else 'train'."""
    bucket = seed % TEST_SHARE
    if bucket == 0:
        return "test"
    return "dev" if bucket == 1 and "dev" in splits else "train"


@dataclass
class Tracker:
    """What the agent knows: the objective, the recipe once read, the score the game reported."""

    objective: str = ""
    recipe: str = ""
    score: int = 0
    max_score: int = 1

    @property
    def goal_words(self) -> frozenset[str]:
        return content_words(self.objective + " " + self.recipe)

    def observe(self, observation: str) -> None:
        """The cookbook's text joins the goal: its ingredients are what the task is about."""
        if "Ingredients :" in observation and not self.recipe:
            self.recipe = observation


def progress_key(challenge: str, tracker: Tracker) -> str:
    """'tw_v1|tw-cooking|score=2/5|recipe=1': score so far (sub-goals reached) and, for cooking, recipe read."""
    fields: dict[str, Any] = {"score": f"{tracker.score}/{tracker.max_score}"}
    if challenge == "tw-cooking":
        fields["recipe"] = bool(tracker.recipe)
    return render_key(f"tw_v1|{challenge}", fields)


class TextWorldEnv:
    """One TextWorld episode; ``reset(task)`` loads (generating once) the task's game, or with ``games``
    the user's game named by the task's family."""

    def __init__(self, challenge: str, root: Path, games: Mapping[str, UserGame] | None = None) -> None:
        self.challenge, self.root, self.games = challenge, root, games
        self._game: Any = None
        self._path: Path | None = None
        self._user: UserGame | None = None  # the user's game being played (with ``games``)
        self._tracker = Tracker()
        self._obs, self._info = "", {}
        self._done = False

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        import textworld

        self.close()
        self._user = self._user_game(task)
        self._path = (
            self._user.path
            if self._user
            else ensure_game(self.root, game_spec(self.challenge, task.tier, task.split), task.seed)
        )
        request = textworld.EnvInfos(
            admissible_commands=True, won=True, lost=True, score=True, max_score=True, objective=True
        )
        try:
            with warnings.catch_warnings():  # jericho cannot read TextWorld's score; TextWorld's wrapper tracks it
                warnings.filterwarnings("ignore", message=".*is not fully supported.*")
                self._game = textworld.start(str(self._path), request_infos=request)
            self._game.seed(FROTZ_SEED)
            state = self._game.reset()
        except Exception as err:
            raise ValueError(f"{self._path}: TextWorld cannot load the game ({type(err).__name__}: {err})") from err
        self._tracker = Tracker(objective=tidy(state["objective"]), max_score=int(state["max_score"]))
        self._done = False
        self._obs = clean(state.feedback)
        self._info = self._info_of(state, valid=True)
        return self._obs, self._info

    def _user_game(self, task: Task) -> UserGame | None:
        if self.games is None:
            return None
        if task.family not in self.games:
            raise ValueError(f"task {task.task_id}: {task.family!r} is not one of this suite's games")
        return self.games[task.family]

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        """Play ``action`` as typed (the game answers inadmissible ones too); after the end, nothing moves."""
        if self._done:
            return self._obs, 0.0, True, {**self._info, "valid": False}
        command = " ".join(action.split())
        valid = command in self._info["admissible_commands"]
        state, _, _ = self._game.step(command)
        self._obs = clean(state.feedback)
        self._tracker.observe(self._obs)
        self._tracker.score = int(state["score"])
        self._info = self._info_of(state, valid)
        self._done = bool(state["won"] or state["lost"])
        return self._obs, float(bool(state["won"])), self._done, self._info

    def _info_of(self, state: Any, valid: bool) -> dict[str, Any]:
        score = min(1.0, max(0.0, int(state["score"]) / max(1, int(state["max_score"]))))
        key, commands = progress_key(self.challenge, self._tracker), state["admissible_commands"] or []
        return game_info(
            bool(state["won"]), bool(state["lost"]), commands, valid, score, key, self.challenge, self.goal()
        )

    def goal(self) -> str:
        return self._tracker.objective

    def abstract_action(self, action: str) -> str:
        return action_label(action, VERBS, self._tracker.goal_words)

    def walkthrough(self) -> list[str]:
        """The generator's own walkthrough, from the game's ``.json`` (tests and warm-start only); a user's
        game's is TextWorld's ``Game.walkthrough``, and a game without one is an error naming it."""
        if self._path is None:
            raise RuntimeError("TextWorldEnv: call reset() first")
        if self._user is not None:
            if self._user.walkthrough is None:
                raise ValueError(
                    f"{self._path}: the game has no walkthrough (none in its .json metadata, none "
                    "TextWorld can derive from its quests)"
                )
            return list(self._user.walkthrough)
        return list(json.loads(self._path.with_suffix(".json").read_text())["metadata"]["walkthrough"])

    def close(self) -> None:
        if self._game is not None:
            self._game.close()
            self._game = None


@dataclass
class _Seeds:
    """Seeds of one tier found so far, by split: a growing cache, so ``tasks`` never re-enumerates."""

    counter: int = 0
    found: dict[str, list[int]] = field(default_factory=lambda: {"train": [], "dev": [], "test": []})


class TextWorldSuite:
    """Tasks of one TextWorld challenge: disjoint seed lists per split, games generated on first use.

    Candidate ``counter = 0, 1, ...`` gets the game seed ``derive_seed(seed, name, tier, counter) mod 2^31``
    (``tw-make`` takes a 32-bit seed); ``split_of`` files it. ``tasks`` generates nothing; ``prepare``
    generates the games of a task list ahead of time, ``reset`` generates a missing one.

    With ``games`` (a folder or glob of the user's games) nothing is generated: the games are checked
    here (``load_games``: a bad one is a ``ValueError`` naming it), a split's tasks are its games in the
    seed's order (task seed = the game's index in the sorted names, family = its name), at most all of them.
    """

    def __init__(self, name: str, seed: int = 0, root: str | Path | None = None, games: str | None = None) -> None:
        self.name, self.seed = name, seed
        self.challenge = CHALLENGES[name]
        self.folder: GameFolder | None = load_games(games, seed) if games is not None else None
        self.splits = ("train", "dev", "test") if self.challenge == "tw-cooking" or self.folder else ("train", "test")
        self.root = Path(root) if root is not None else Path("data") / "envs" / "textworld"
        self._seeds: dict[str, _Seeds] = {}

    def tasks(self, split: str, tier: str, n: int, offset: int = 0) -> list[Task]:
        if split not in self.splits:
            raise ValueError(f"{self.name}: split must be one of {self.splits}")
        if self.folder is not None:
            index = {name: i for i, name in enumerate(sorted(self.folder.games))}
            names = self.folder.names(split)[offset : offset + n]
            return [Task(self.name, split, tier, offset + i, index[g], g) for i, g in enumerate(names)]
        game_spec(self.challenge, tier, split)  # validates the tier
        state = self._seeds.setdefault(tier, _Seeds())
        while len(state.found[split]) < offset + n:
            candidate = derive_seed(self.seed, self.name, tier, state.counter) % 2**31
            state.counter += 1
            state.found[split_of(candidate, self.splits)].append(candidate)
        seeds = state.found[split][offset : offset + n]
        return [Task(self.name, split, tier, offset + i, s, self.challenge) for i, s in enumerate(seeds)]

    def prepare(self, tasks: list[Task]) -> list[Path]:
        """Generate (or find) the games of ``tasks``, e.g. once before fanning out workers."""
        if self.folder is not None:
            return [self.folder.games[t.family].path for t in tasks]
        return [ensure_game(self.root, game_spec(self.challenge, t.tier, t.split), t.seed) for t in tasks]

    def make(self) -> TextWorldEnv:
        return TextWorldEnv(self.challenge, self.root, self.folder.games if self.folder else None)

    def max_turns(self, tier: str) -> int:
        """The tier's horizon, the user's games included: they stand in for the generated games of the same
        challenge and tier, so a run on them is cut where a run on those would be (``env.max_turns`` sets
        another; the run logs the one used as ``env.horizon``)."""
        return game_spec(self.challenge, tier, "train").horizon

    def corpus(self, n_tasks: int = 200, n_games: int = 4, tier: str = "easy") -> list[str]:
        """The challenge's text-grammar phrases, then walkthrough and random play on ``min(n_tasks,
        n_games)`` train games of the easy tier and, when ``tier`` is another, as many of ``tier`` (each
        new game costs a ``tw-make`` run of 3-6 s). The user's games: every game of every split is reset
        and its walkthrough played (where it has one), and ``n_games`` train games are also played at random,
        so the tokenizer has seen the words of the games it will be evaluated on too."""
        lines = _grammar_lines(self.challenge) if self.folder is None else []
        env = self.make()
        if self.folder is None:
            for t in dict.fromkeys(("easy", tier)):
                for task in self.tasks("train", t, min(n_tasks, n_games)):
                    lines += played_lines(env, task, oracle=True) + played_lines(env, task, oracle=False)
        else:
            index = {name: i for i, name in enumerate(sorted(self.folder.games))}
            for name in sorted(self.folder.games):
                task = Task(self.name, "train", tier, index[name], index[name], name)
                if self.folder.games[name].walkthrough is not None:
                    lines += played_lines(env, task, oracle=True)
                else:
                    observation, info = env.reset(task)
                    lines += [observation, *info["admissible_commands"]]
            for task in self.folder_tasks("train", min(n_tasks, n_games), tier):
                lines += played_lines(env, task, oracle=False)
        env.close()
        return list(dict.fromkeys(lines))

    def folder_tasks(self, split: str, n: int, tier: str) -> list[Task]:
        """Up to ``n`` tasks of ``split`` of the user's games; none when the split has no game."""
        assert self.folder is not None
        return self.tasks(split, tier, n) if self.folder.splits[split] else []


def _grammar_lines(challenge: str) -> list[str]:
    """Every alternative of the challenge's ``.twg`` grammars with its #symbols# and (types) removed."""
    import textworld

    folder = Path(textworld.__file__).parent / "challenges" / challenge.replace("-", "_") / "textworld_data"
    lines = []
    for path in sorted(folder.glob("text_grammars/*.twg")):
        for row in path.read_text().splitlines():
            _, _, values = row.partition(":")
            for value in values.split(";"):
                text = tidy(re.sub(r"#[^#]*#|\([^)]*\)|[<>{}\[\]]", " ", value))
                if text and not row.startswith("#"):
                    lines.append(text)
    return lines
