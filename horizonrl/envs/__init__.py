"""Environment suites by name. Factories import their module lazily, so an optional package
(TextWorld, ScienceWorld, ALFWorld, WebShop, AppWorld) is needed only when its suite is used.

``textworld-coin|treasure|cooking``: TextWorld challenge games (tier: easy/medium/hard, ``level7``, or a
cooking spec), or with ``games`` (``env.games``) the user's own games from a folder or glob;
``scienceworld-<task>`` for each of ScienceWorld's 30 tasks (tier: easy/medium/hard or simplifications);
``alfworld``, ``webshop``, ``appworld``: adapters to the installed benchmarks."""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import sys
from collections.abc import Callable
from pathlib import Path

from horizonrl.envs.base import Env, EnvSuite, Task
from horizonrl.envs.scienceworld_env import TASK_NAMES as SCIENCEWORLD_TASKS  # a name list; imports no scienceworld
from horizonrl.files import write_json


def _household(seed: int) -> EnvSuite:
    from horizonrl.envs.household import HouseholdSuite

    return HouseholdSuite(seed=seed)


def _textworld(name: str) -> Callable[[int], EnvSuite]:
    def factory(seed: int) -> EnvSuite:
        from horizonrl.envs.textworld_env import TextWorldSuite

        return TextWorldSuite(name, seed=seed)

    return factory


def _scienceworld(task_name: str) -> Callable[[int], EnvSuite]:
    def factory(seed: int) -> EnvSuite:
        from horizonrl.envs.scienceworld_env import ScienceWorldSuite

        return ScienceWorldSuite(task_name, seed=seed)

    return factory


def _adapter(name: str) -> Callable[[int], EnvSuite]:
    def factory(seed: int) -> EnvSuite:
        from horizonrl.envs.adapters import ADAPTERS

        return ADAPTERS[name](seed=seed)

    return factory


# Suites whose every text is built from fixed word lists that their corpus covers (tested in
# tests/test_household.py): the word tokenizer needs no character fallback there, and leaving it out
# keeps the default run's vocabulary, seeded weights and rollouts what they were before the fallback.
CLOSED_TEXT = frozenset({"household"})

SUITES: dict[str, Callable[[int], EnvSuite]] = {
    "household": _household,
    **{name: _textworld(name) for name in ("textworld-coin", "textworld-treasure", "textworld-cooking")},
    **{f"scienceworld-{task}": _scienceworld(task) for task in SCIENCEWORLD_TASKS},
    **{name: _adapter(name) for name in ("alfworld", "webshop", "appworld")},
}


def check_tier(name: str, tier: str) -> None:
    """Raise ``ValueError`` naming the allowed values when ``tier`` is not a tier of suite ``name`` (a phrase
    that follows the field's name), read from the suites' own tables without building a suite (the adapters'
    benchmarks check their own)."""
    if name == "household":
        from horizonrl.envs.household_world import TIERS

        allowed = tuple(TIERS)
        if tier not in TIERS:
            raise ValueError(f"is not a tier of household; allowed: {', '.join(allowed)}")
        return
    try:
        if name.startswith("textworld-"):
            from horizonrl.envs.textworld_env import CHALLENGES, game_spec

            game_spec(CHALLENGES[name], tier, "train")
        elif name.startswith("scienceworld-"):
            from horizonrl.envs.scienceworld_env import simplification

            simplification(tier)
    except ValueError as err:
        raise ValueError(f"is not a tier of {name}: {err}") from err


def check_games(name: str, games: str, seed: int) -> None:
    """Raise ``ValueError`` naming ``env.games`` unless ``name`` is a TextWorld suite and every game of
    ``games`` loads (the check ``TextWorldSuite`` makes, here before any work starts)."""
    _textworld_only(name)
    from horizonrl.envs.textworld_games import load_games

    load_games(games, seed)


def _textworld_only(name: str) -> None:
    if not name.startswith("textworld-"):
        textworld = ", ".join(n for n in SUITES if n.startswith("textworld-"))
        raise ValueError(
            f"env.games is only for the TextWorld suites ({textworld}); env.name = {name!r} makes its own tasks"
        )


def make_suite(name: str, seed: int = 0, games: str | None = None, data_dir: str | None = None) -> EnvSuite:
    """Suite ``name`` with task seed ``seed``; ``games``: the user's TextWorld games (``env.games``);
    ``data_dir``: the run's data folder, under which TextWorld caches the games it generates
    (``<data_dir>/envs/textworld``; the working directory's ``data/`` when None)."""
    if name not in SUITES:
        raise ValueError(f"env.name = {name!r} is unknown; known: {', '.join(sorted(SUITES))}")
    if games is None and not name.startswith("textworld-"):
        return SUITES[name](seed)
    _textworld_only(name)
    from horizonrl.envs.textworld_env import TextWorldSuite

    root = Path(data_dir) / "envs" / "textworld" if data_dir is not None else None
    return TextWorldSuite(name, seed=seed, root=root, games=games)


def suite_corpus(suite: EnvSuite, tier: str) -> list[str]:
    """The text a word tokenizer is trained on: ``suite.corpus`` at the configured ``tier`` where the
    suite's corpus depends on the tier (TextWorld, ScienceWorld), else its one corpus (household's
    covers every tier)."""
    if "tier" in inspect.signature(suite.corpus).parameters:
        return suite.corpus(tier=tier)  # type: ignore[call-arg]
    return suite.corpus()


# Suites whose corpus is a function of this package's code alone (no game files, simulator or other
# package's data): its digest can be remembered across processes, keyed by that code (``corpus_digest``).
CODE_CORPUS = frozenset({"household"})


def corpus_digest(name: str, tier: str, seed: int, corpus: Callable[[], list[str]], cache_dir: str | Path) -> str:
    """sha256 of the lines ``corpus()`` returns: ``suite_corpus`` at ``tier`` of suite ``name`` built with
    ``seed`` (its tasks, and so the episodes played, depend on it), the key of a tiny model's word
    tokenizer. For a suite of ``CODE_CORPUS`` it is remembered in ``cache_dir/corpus-<name>-<tier>-<seed>.json``
    beside the source fingerprint it was computed under (every file of this package and the Python version):
    playing household's corpus costs ~1 CPU-s, which every process's start paid again. A fingerprint that
    differs, as after an edit of any environment's code, plays it again."""
    if name not in CODE_CORPUS:
        return sha256_lines(corpus())
    fingerprint = hashlib.sha256(sys.version.encode())
    for source in sorted(Path(__file__).parent.glob("*.py")):
        fingerprint.update(source.name.encode() + b"\0" + source.read_bytes())
    memo = Path(cache_dir) / f"corpus-{name}-{tier}-{seed}.json"
    try:
        stored = json.loads(memo.read_text())
        if stored["fingerprint"] == fingerprint.hexdigest():
            return stored["sha256"]
    except (OSError, ValueError, KeyError, TypeError):  # none yet, or unreadable: computed and written again
        pass
    digest = sha256_lines(corpus())
    memo.parent.mkdir(parents=True, exist_ok=True)
    write_json({"fingerprint": fingerprint.hexdigest(), "sha256": digest}, memo)
    return digest


def sha256_lines(lines: list[str]) -> str:
    """The digest of a corpus, as a tiny model's key holds it."""
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def suite_ref(name: str, games: str | None = None, data_dir: str | None = None) -> str | Callable[[int], EnvSuite]:
    """What a worker process builds its suite from (``EnvPool``): the name, or a picklable factory of
    the suite on the user's games or in the run's data folder."""
    if games is None and data_dir is None:
        return name
    return functools.partial(make_suite, name, games=games, data_dir=data_dir)


__all__ = [
    "CLOSED_TEXT",
    "CODE_CORPUS",
    "Env",
    "EnvSuite",
    "Task",
    "SUITES",
    "check_games",
    "check_tier",
    "corpus_digest",
    "sha256_lines",
    "make_suite",
    "suite_corpus",
    "suite_ref",
]
