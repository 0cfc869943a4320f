"""The user's own TextWorld games (``env.games``): found, checked and split before any work starts.

``env.games`` is a folder (searched recursively) or a glob (``games/*.z8``, ``~/tw/**/*.z8``); a game
is a ``.z8`` story file with the ``.json`` TextWorld writes beside it (``tw-make`` does both). Its name
is its path relative to the *base* (the folder, or the glob's leading part without wildcards), and
that name is the task's ``family``, so stored episodes name the game they played.

Splits: a ``splits.yaml`` in the base (``train: [a.z8, ...]``, ``dev: [...]``, ``test: [...]``) lists
them, and games it does not list are not played; without one, a game is in ``test`` when
``derive_seed(suite_seed, "textworld-games", name) % 10 == 0``, in ``dev`` when 1, else in ``train``.
The hash depends only on the name and the seed, so adding games never moves the others.

Every game that will be played is checked before any work starts, each problem named with its path:
TextWorld 1.7 refuses Glulx (``.ulx``); a missing or unreadable ``.json``; a story file whose header
TextWorld's interpreter (Frotz, through Jericho) would reject (not a Z-machine version 8 file, shorter
than its header says, or a wrong checksum). Frotz ends the whole process on such a file instead of
raising, so the check reads the header rather than loading the game. The walkthrough is the game's own
(``Game.walkthrough``: the ``.json``'s metadata, else derived from its quests); the horizon is the
generated games' of the same challenge and tier (``TextWorldSuite.max_turns``). A symlink (a game file
or a folder) is followed, and the game keeps its name under the base; ``env.games`` naming one story file
is a one-game suite, that game in every split, with no ``splits.yaml`` read.
"""

from __future__ import annotations

import glob
import os
import random
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml

from horizonrl.seeding import derive_seed

SPLITS = ("train", "dev", "test")
SPLITS_FILE = "splits.yaml"
SUFFIXES = (".z8", ".ulx")  # what is looked for; .ulx only to be named as unplayable
HASH_SHARE = 10  # hash % 10: 0 -> test, 1 -> dev, else train
_MAX_LISTED = 20  # problems listed in one error


@dataclass(frozen=True)
class UserGame:
    """One checked game: its name (the task's family), its story file, its walkthrough if it has one."""

    name: str
    path: Path
    walkthrough: tuple[str, ...] | None


@dataclass(frozen=True)
class GameFolder:
    """The games of ``env.games``, by name, and the names of each split in play order."""

    source: str
    base: Path
    games: Mapping[str, UserGame]
    splits: Mapping[str, tuple[str, ...]]
    rule: str  # how the splits were made, for error messages

    def names(self, split: str) -> tuple[str, ...]:
        """The split's games; a split with none is an error naming the folder and the rule."""
        names = self.splits[split]
        if not names:
            raise ValueError(
                f"env.games = {self.source!r}: no game falls in split {split!r} ({self.rule}); "
                f"write {self.base / SPLITS_FILE} to choose the splits"
            )
        return names


def load_games(source: str, seed: int) -> GameFolder:
    """Find, split and check the games of ``source`` (a folder or a glob); ``ValueError`` names each problem."""
    base, paths = _find(source)
    names = {path.relative_to(base).as_posix(): path for path in paths}
    if _is_one_file(source):  # one game: a suite of that game alone, in every split; no splits.yaml read
        splits, rule = {s: list(names) for s in SPLITS}, "one game file, played in every split"
    elif (base / SPLITS_FILE).is_file():
        splits, rule = _read_splits(base, names, source)
    else:
        splits, rule = _hash_splits(names, seed), "hash rule"
    played = sorted({name for split in splits.values() for name in split})
    games, problems = {}, []
    for name in played:
        try:
            games[name] = _check(name, names[name])
        except ValueError as err:
            problems.append(str(err))
    if problems:
        more = f"\n  ... and {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else ""
        raise ValueError(
            f"env.games = {source!r}: {len(problems)} game(s) TextWorld cannot load:\n  "
            + "\n  ".join(problems[:_MAX_LISTED])
            + more
        )
    ordered = {s: tuple(_shuffled(splits[s], seed, s)) for s in SPLITS}
    return GameFolder(source, base, MappingProxyType(games), MappingProxyType(ordered), rule)


def _find(source: str) -> tuple[Path, list[Path]]:
    """(base, story files): a folder searched recursively, one file, or a glob's matches."""
    expanded = str(Path(source).expanduser())
    if glob.has_magic(expanded):
        parts = Path(expanded).parts
        fixed = next(i for i, part in enumerate(parts) if glob.has_magic(part))
        base = Path(*parts[:fixed]) if fixed else Path(".")
        paths = [
            Path(p) for p in glob.glob(expanded, recursive=True) if Path(p).suffix in SUFFIXES and Path(p).is_file()
        ]
        if not paths:
            raise ValueError(f"env.games = {source!r}: the pattern matches no game file ({' or '.join(SUFFIXES)})")
    else:
        path = Path(expanded)
        if path.is_file():
            if path.suffix not in SUFFIXES:
                raise ValueError(
                    f"env.games = {source!r}: {path.absolute()} is not a game file ({' or '.join(SUFFIXES)})"
                )
            return path.parent.absolute(), [path.absolute()]
        if not path.is_dir():
            raise ValueError(f"env.games = {source!r}: no such folder or game file ({path.absolute()})")
        base = path
        # glob's ``**`` follows symlinked folders (Path.rglob does not); a symlinked file is a file
        found = [Path(p) for p in glob.glob(glob.escape(str(path)) + "/**/*", recursive=True)]
        broken = [p for p in found if p.suffix in SUFFIXES and p.is_symlink() and not p.exists()]
        if broken:
            raise ValueError(
                f"env.games = {source!r}: {broken[0].absolute()} is a symlink to {os.readlink(broken[0])}, "
                "which does not exist"
            )
        paths = [p for p in found if p.suffix in SUFFIXES and p.is_file()]
        if not paths:
            raise ValueError(
                f"env.games = {source!r}: the folder {path.absolute()} holds no game file "
                f"({' or '.join(SUFFIXES)}, searched recursively)"
            )
    # absolute, not resolved: a game reached through a symlink keeps its name under the base
    return base.absolute(), sorted(p.absolute() for p in paths)


def _is_one_file(source: str) -> bool:
    expanded = str(Path(source).expanduser())
    return not glob.has_magic(expanded) and Path(expanded).is_file()


def _hash_splits(names: Mapping[str, Path], seed: int) -> dict[str, list[str]]:
    splits: dict[str, list[str]] = {s: [] for s in SPLITS}
    for name in names:
        bucket = derive_seed(seed, "textworld-games", name) % HASH_SHARE
        splits["test" if bucket == 0 else "dev" if bucket == 1 else "train"].append(name)
    return splits


def _read_splits(base: Path, names: Mapping[str, Path], source: str) -> tuple[dict[str, list[str]], str]:
    """``splits.yaml``: split -> list of game names; every name a game found, none in two splits."""
    path = base / SPLITS_FILE
    where = f"env.games = {source!r}: {path}"
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ValueError(f"{where} is not valid YAML: {err}") from err
    if not isinstance(raw, dict) or not set(raw) <= set(SPLITS):
        raise ValueError(f"{where} must map {', '.join(SPLITS)} to lists of game names")
    splits: dict[str, list[str]] = {s: [] for s in SPLITS}
    seen: dict[str, str] = {}
    for split, listed in raw.items():
        if not isinstance(listed, list) or not all(isinstance(n, str) for n in listed):
            raise ValueError(f"{where}: {split} must be a list of game names (paths relative to {base})")
        for name in listed:
            if name not in names:
                raise ValueError(f"{where}: {split} lists {name!r}, which is not a game of the folder")
            if name in seen:
                raise ValueError(f"{where}: {name!r} is in both {seen[name]} and {split}")
            seen[name] = split
            splits[split].append(name)
    return splits, f"listed in {path}"


def _shuffled(names: list[str], seed: int, split: str) -> list[str]:
    """Play order of a split: fixed by the suite seed, not by file names (which may follow difficulty)."""
    order = sorted(names)
    random.Random(derive_seed(seed, "textworld-games", split)).shuffle(order)
    return order


def _check(name: str, path: Path) -> UserGame:
    """The game, or ``ValueError`` naming its path and why TextWorld cannot load it."""
    if path.suffix == ".ulx":
        raise ValueError(
            f"{path}: Glulx (.ulx) games are not supported by TextWorld 1.7 (textworld.start refuses "
            "them); compile the game to .z8"
        )
    if not path.with_suffix(".json").is_file() and path.is_symlink():
        path = path.resolve()  # a symlinked story file alone: its .json lies beside its target
    meta = path.with_suffix(".json")
    if not meta.is_file():
        raise ValueError(
            f"{path}: no {meta.name} beside it (TextWorld reads the game's score, objective and "
            "admissible commands from the .json that tw-make writes next to the .z8)"
        )
    problem = story_problem(path.read_bytes())
    if problem:
        raise ValueError(f"{path}: {problem}")
    return UserGame(name, path, _walkthrough(meta))


def story_problem(story: bytes) -> str | None:
    """Why Frotz would refuse ``story`` as a version-8 Z-machine file, or None: the header's version byte,
    its file length (word 0x1A, in units of 8 bytes) and checksum (word 0x1C: the sum of the bytes from
    0x40 to that length, mod 2^16)."""
    if len(story) < 0x40 or story[0] != 8:
        return (
            f"not a Z-machine version 8 story file (header version byte {story[0] if story else None}, "
            f"{len(story)} bytes)"
        )
    length = int.from_bytes(story[0x1A:0x1C], "big") * 8
    if length < 0x40 or len(story) < length:
        return f"truncated or damaged story file: its header says {length} bytes, the file has {len(story)}"
    if sum(story[0x40:length]) % 2**16 != int.from_bytes(story[0x1C:0x1E], "big"):
        return "damaged story file: its checksum does not match its header"
    return None


def _walkthrough(meta: Path) -> tuple[str, ...] | None:
    """The game's own walkthrough (``.json`` metadata, else from its quests), or None; an unreadable
    ``.json`` is an error naming it."""
    try:
        import textworld
    except ImportError as err:
        raise RuntimeError("env.games needs TextWorld: `pip install -e '.[textworld]'` (textworld==1.7.0)") from err
    try:
        game: Any = textworld.Game.load(str(meta))
    except Exception as err:  # noqa: BLE001 (any failure of TextWorld's reader is the file's problem)
        raise ValueError(f"{meta}: not a TextWorld game description ({type(err).__name__}: {err})") from err
    try:
        walkthrough = game.walkthrough
    except Exception:  # noqa: BLE001 (no winning policy TextWorld can derive: the game has no walkthrough)
        walkthrough = None
    return tuple(walkthrough) if walkthrough else None
