"""Agent-side helpers shared by the benchmark environments (TextWorld, ScienceWorld, adapters).

BLPO (docs/algorithms.md §2.3-2.4) needs a progress key and a goal-relative action label computed only from
what the agent has seen: the task description, the observations it got back and the score the game
reported. These helpers never read a walkthrough, a gold path or the simulator's hidden state.

* ``tidy(text)``: the observation text as the agent gets it: punctuation spaced off words (the word-level
  tokenizer splits on whitespace only), blanks collapsed, one line per non-empty line.
* ``content_words(text)``: lower-case words minus stop words; the "is it in the task description" test.
* ``verb_label(verb, argument, goal_words)``: ``TAKE_GOAL`` when a word of the argument appears in the
  task description, ``TAKE_OTHER`` when not, ``LOOK`` when the verb takes no argument.
* ``action_label(action, verbs, goal_words)``: ``verb_label`` of a command split by ``split_command``.
* ``render_key(prefix, fields)``: ``prefix|name=value|...`` with booleans as 0/1.
* ``game_info(...)``: the ``info`` a benchmark game's episode returns after reset and every step.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

STOP_WORDS = frozenset(
    "a an the and or of to in on at into onto from with for by is are be it its this that these those you your "
    "i me my we us our he she they them then there here so as if not no do does did have has had will would "
    "can could should must may might up out off over under again once first next after before all any some "
    "each what which who how when where why thing things something ok okay good got that's it's".split()
)
_PUNCTUATION = re.compile(r"""((?<!\d)[.,]|[.,](?!\d)|[!?;:()"\[\]])""")  # '30.00' and '1,000' stay whole
_WORD = re.compile(r"[a-z0-9][a-z0-9'-]*")


def tidy(text: str) -> str:
    """Space punctuation off words (not the point of '19.99'), collapse blanks inside lines, drop empty lines."""
    lines = (" ".join(_PUNCTUATION.sub(r" \1 ", line).split()) for line in text.splitlines())
    return "\n".join(line for line in lines if line)


def content_words(text: str) -> frozenset[str]:
    """Lower-case words of ``text`` that are not stop words (numbers kept: 'banana 2' names an object)."""
    return frozenset(w for w in _WORD.findall(text.lower()) if w not in STOP_WORDS)


def split_command(action: str, verbs: Iterable[str]) -> tuple[str, str]:
    """(verb, argument): the longest of ``verbs`` that prefixes the command, else its first word."""
    text = " ".join(action.lower().split())
    for verb in sorted(verbs, key=len, reverse=True):
        if text == verb or text.startswith(verb + " "):
            return verb, text[len(verb) :].strip()
    first, _, rest = text.partition(" ")
    return first, rest


def verb_label(verb: str, argument: str, goal_words: frozenset[str]) -> str:
    """Goal-relative label: VERB_GOAL if a content word of ``argument`` is in the goal, VERB_OTHER if not."""
    if not verb:
        return "OTHER"
    name = verb.upper().replace(" ", "_").replace("-", "_")
    if not content_words(argument):
        return name
    return f"{name}_GOAL" if content_words(argument) & goal_words else f"{name}_OTHER"


def action_label(action: str, verbs: Iterable[str], goal_words: frozenset[str]) -> str:
    """A command's goal-relative label (docs/algorithms.md §2.4): its verb (the longest of ``verbs`` that
    prefixes it) and whether its argument is named in the goal: FOCUS_ON_GOAL, TAKE_OTHER, WAIT."""
    verb, argument = split_command(action, verbs)
    return verb_label(verb, argument, goal_words)


def render_key(prefix: str, fields: dict[str, Any]) -> str:
    """'prefix|score=2/5|recipe=1': the progress key, booleans as 0/1, no spaces."""
    values = (f"{name}={int(v) if isinstance(v, bool) else v}" for name, v in fields.items())
    return "|".join([prefix, *values]).replace(" ", "_")


def game_info(
    won: bool, lost: bool, commands: Iterable[str], valid: bool, score: float, key: str, family: str, goal: str
) -> dict[str, Any]:
    """The ``info`` of a benchmark game's step (``envs.base``): outcome, the sorted admissible ``commands``,
    whether the action was one, the ``score`` in [0, 1], the progress ``key`` (BLPO), the game ``family``
    and the ``goal`` as the agent read it."""
    return {
        "won": won,
        "lost": lost,
        "admissible_commands": sorted(commands),
        "valid": valid,
        "score": score,
        "progress_key": key,
        "family": family,
        "goal": goal,
    }
