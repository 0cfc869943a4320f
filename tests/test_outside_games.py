"""A user's own games as users keep them (issue 33): an outside cooking game whose commands hold words the
tokenizer never saw is still winnable through the action trie; games reached through symlinks, one game
file as a suite, and the horizon the run uses.

The outside game is made by calling ``tw-make tw-cooking`` directly, as a user would, once per module
(5-16 s); the tokenizer is trained on the household corpus, which has none of its food words.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from horizonrl.config import ModelConfig, TrainConfig
from horizonrl.engines.base import TokenTrie
from horizonrl.envs import CLOSED_TEXT, make_suite, suite_corpus
from horizonrl.envs.textworld_env import TextWorldSuite, game_spec, tw_make_path
from horizonrl.envs.textworld_games import load_games
from horizonrl.models.loading import tiny_model_dir
from horizonrl.models.tokenizers import load_tokenizer, train_word_tokenizer
from horizonrl.rollout.prompting import ChatFormat

pytestmark = pytest.mark.extra  # games made with TextWorld's tw-make


@pytest.fixture(scope="module")
def outside_game(tmp_path_factory) -> Path:
    """A cooking game with two recipe items, cooked and cut: its winning commands (``dice ... with knife``,
    ``cook ... with oven``) differ from other admissible ones (``slice ...``, ``... with stove``) only in
    words a household-trained tokenizer does not know."""
    path = tmp_path_factory.mktemp("outside") / "cook3.z8"
    done = subprocess.run(
        [tw_make_path(), "tw-cooking", "--recipe", "2", "--take", "2", "--go", "1", "--open", "--cook", "--cut"]
        + ["--split", "test", "--seed", "3", "--output", str(path), "--silent", "-f"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0 and path.is_file(), done.stderr[-2000:]
    return path


def _ids(fmt: ChatFormat, command: str) -> tuple[int, ...]:
    return tuple(fmt.command(command))


def test_every_admissible_command_of_an_outside_game_is_reachable_and_the_walkthrough_wins(
    outside_game, household_suite
):
    """Each state's admissible commands get distinct ids and decode back to themselves; the walkthrough is
    played by walking each winning command's ids down the trie and taking the text the trie gives back,
    as sampling does, and the game is won. The words-only tokenizer (the old one) maps the unseen words to
    ``<|unk|>``: there the same states have commands with equal ids, and the trie refuses them, naming both."""
    corpus = household_suite.corpus(50)
    tokenizer, words_only = train_word_tokenizer(corpus), train_word_tokenizer(corpus, fallback=False)
    fmt, old = ChatFormat.for_tokenizer(tokenizer), ChatFormat.for_tokenizer(words_only)
    suite = TextWorldSuite("textworld-cooking", games=str(outside_game))
    env = suite.make()
    _, info = env.reset(suite.tasks("test", "easy", 1)[0])
    collided = []
    for action in env.walkthrough():
        commands = info["admissible_commands"]
        for c in commands:
            assert tokenizer.decode(tokenizer.encode(c, add_special_tokens=False)) == c
        assert len({_ids(fmt, c) for c in commands}) == len(commands)
        trie = TokenTrie([list(_ids(fmt, c)) for c in commands], commands)
        node, path = trie.root, []
        for t in _ids(fmt, action):  # what the sampler walks when it picks this command
            assert t in node
            node, path = node[t], [*path, t]
        assert node == {}
        chosen = trie.texts[tuple(path)]
        assert chosen == action
        if len({_ids(old, c) for c in commands}) < len(commands):
            collided.append(commands)
        _, _, done, info = env.step(chosen)
    env.close()
    assert info["won"]
    assert collided, "no state had commands the old tokenizer could not tell apart: the test would check nothing"
    with pytest.raises(ValueError, match=r"commands '.+' and '.+' have the same token ids"):
        TokenTrie([list(_ids(old, c)) for c in collided[0]], collided[0])


def test_fallback_keeps_every_word_id_and_the_default_model_is_unchanged(household_suite, tmp_path):
    """The fallback only appends character pieces: each word keeps its id and known text encodes as
    before. Household's text is closed (``CLOSED_TEXT``), so its tiny model is built exactly as before the
    fallback: same cache key (the spec of 1e42924), same vocabulary, so a seed's default rollouts are the
    same bit for bit."""
    corpus = household_suite.corpus(50)
    words_only = train_word_tokenizer(corpus, fallback=False)
    tokenizer = train_word_tokenizer(corpus)
    assert len(tokenizer) > len(words_only)
    vocab = tokenizer.get_vocab()
    assert all(vocab[w] == i for w, i in words_only.get_vocab().items())
    for line in corpus[:300]:
        assert tokenizer.encode(line, add_special_tokens=False) == words_only.encode(line, add_special_tokens=False)
    assert "household" in CLOSED_TEXT
    cfg = ModelConfig()
    folder = tiny_model_dir(tmp_path, "household", cfg, corpus)
    spec = {  # what 1e42924 hashed into the folder name
        "env": "household",
        "tiny": cfg.tiny.model_dump(),
        "seed": cfg.init_seed,
        "corpus": hashlib.sha256("\n".join(corpus).encode()).hexdigest(),
    }
    assert folder.name.endswith(hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12])
    assert load_tokenizer(folder).get_vocab() == words_only.get_vocab()


def test_the_corpus_covers_the_configured_tier_and_every_user_game(outside_game, tmp_path):
    """A folder of the outside game and a symlink to it: the corpus plays every game, so the tokenizer
    trained on it has each game's words as words."""
    folder = tmp_path / "games"
    folder.mkdir()
    for suffix in (".z8", ".json"):
        os.symlink(outside_game.with_suffix(suffix), folder / f"cook{suffix}")
    (folder / "splits.yaml").write_text("test: [cook.z8]\n")  # no train game: the corpus still reads it
    suite = TextWorldSuite("textworld-cooking", games=str(folder))
    words = {w for line in suite_corpus(suite, "easy") for w in line.split()}
    walkthrough = json.loads(outside_game.with_suffix(".json").read_text())["metadata"]["walkthrough"]
    assert {w for command in walkthrough for w in command.split()} <= words


def test_symlinked_games_one_game_file_and_the_horizon(outside_game, tmp_path):
    """Games kept as symlinks (files, and a folder of them) load under their link names and play; one
    game file is a suite of that game in every split even beside a ``splits.yaml`` that does not list it;
    a dangling link is named with ``env.games``; the horizon is the generated tier's unless
    ``env.max_turns`` is set, and the run's params say which."""
    from tasks.run import run_params

    store = tmp_path / "elsewhere"
    store.mkdir()
    for suffix in (".z8", ".json"):
        (store / f"cook{suffix}").write_bytes(outside_game.with_suffix(suffix).read_bytes())
    base = tmp_path / "links"
    (base / "sub").mkdir(parents=True)
    os.symlink(store / "cook.z8", base / "a.z8")  # the .z8 alone: its .json is read beside the target
    os.symlink(store, base / "sub" / "more")  # a symlinked folder
    folder = load_games(str(base), 0)
    assert sorted(folder.games) == ["a.z8", "sub/more/cook.z8"]

    (store / "splits.yaml").write_text("train: []\n")
    one = TextWorldSuite("textworld-cooking", games=str(store / "cook.z8"))
    assert {s: [t.family for t in one.tasks(s, "easy", 3)] for s in one.splits} == {
        s: ["cook.z8"] for s in ("train", "dev", "test")
    }
    env = one.make()
    env.reset(one.tasks("test", "easy", 1)[0])
    for action in env.walkthrough():
        *_, info = env.step(action)
    assert info["won"]
    env.close()

    os.symlink(tmp_path / "gone.z8", base / "gone.z8")
    with pytest.raises(ValueError, match=re.escape(f"env.games = {str(base)!r}: {base / 'gone.z8'} is a symlink to")):
        load_games(str(base), 0)

    raw = {"env": {"name": "textworld-cooking", "games": str(store / "cook.z8")}, "data_dir": str(tmp_path / "d")}
    games = make_suite("textworld-cooking", 0, str(store / "cook.z8"), str(tmp_path / "d"))
    assert run_params(TrainConfig.model_validate(raw), games)["env.horizon"] == str(
        game_spec("tw-cooking", "easy", "train").horizon
    )
    raw["env"]["max_turns"] = 7
    assert run_params(TrainConfig.model_validate(raw), games)["env.horizon"] == "7"
