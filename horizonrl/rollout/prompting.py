"""Turning an episode into the token ids the policy sees, without ever re-tokenising its own output.

Two context modes (config ``rollout.context``):

* ``full``: one growing sequence ``system(goal) user(o_0) a_0 close user(o_1) a_1 close ...``. Each turn
  stores only the ids added since the previous action (``prompt_ids`` is a delta), so the trajectory is
  rebuilt by concatenation (layout T, docs/algorithms.md §0.1).
* ``window``: each turn's prompt is ``system(goal)`` plus the last H turns plus the new observation, so
  every turn is its own sequence (layout S); ``prompt_ids`` is the whole prompt.

Past actions re-enter the context as the ids the engine produced, never as re-encoded text.

The pieces are rendered by the tokenizer's own chat template (ChatML for the word-level tokenizer; Qwen3's
or Llama 3's for the genuine ones). ``ChatFormat`` renders a reference conversation
``[system, user, assistant, user]`` with marker contents once, finds where each message starts and ends,
and from then on renders each new message with its real content in that same conversation and keeps
only its own part: ``system(goal)``; ``user(o)``, the observation message followed by the template's
generation prompt (the assistant header; for Qwen3 with thinking off, its empty
``<think>\\n\\n</think>\\n\\n`` block, so those ids are prompt, not policy); and ``close``, what follows an
assistant reply (Qwen3 ``<|im_end|>\\n``, Llama 3 ``<|eot_id|>``). Each piece begins or ends at a special
token, where byte-level BPE never merges across, so the concatenated pieces are the ids of the rendered
conversation. One deliberate difference: a past reply stays in the context exactly as generated (a
template may rewrite history, e.g. Qwen3 drops past thinking), because the learner must see what the
sampler saw.

Free-mode replies follow ``free_format`` (``parse_action``): ``plain``, the whole reply is the command;
``react``, a thought then one final line ``Action: <command>`` (the system message says so).

Two prompts (config ``rollout.prompt``): ``compact``, the goal alone as the system message and the bare
observation as each user message (a model trained from scratch in the project needs nothing else);
``listed``, for a pretrained chat model: the project's system message (what the game is, the task, the
reply format) and each observation followed by the admissible commands of that turn, listed one a line,
since a model that has never seen the game cannot guess its command language. Every rendered conversation
has a system message, so a template's default one (SmolLM2's "You are a helpful AI assistant named
SmolLM...") never enters the context.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

# Marker contents of the reference conversation: plain words that no template rewrites.
_GOAL, _OBS, _ACT, _NEXT = "GOALMARKER", "OBSMARKER", "ACTMARKER", "NEXTMARKER"
ACTION_PREFIX = "Action:"
REACT_INSTRUCTION = "Think about the situation, then reply with one final line: Action: <command>"
PROMPTS = ("compact", "listed")
LISTED_SYSTEM = (
    "You are playing a text adventure game. Each turn you read what you observe and the admissible commands, "
    "and choose one command to play."
)
LISTED_REPLY = "Reply with one admissible command only, written exactly as listed."
COMMANDS_HEADER = "Admissible commands:"


@dataclass(frozen=True)
class _Template:
    """The reference conversation's text, cut where the messages the format renders begin and end."""

    before_user: str  # everything up to the last user message (system, user, assistant, close)
    after_system: str  # everything after the system message
    system_parts: tuple[str, str] | None  # (before, after) the goal where the template puts it verbatim
    user_parts: tuple[str, str] | None  # (before, after) an observation, likewise; None: render each time


@dataclass(frozen=True)
class ChatStyle:
    """How a run renders its turns over a tokenizer's template (``rollout``'s format fields): the player reads
    its ``ChatFormat`` off the first checkpoint it plays, in this style."""

    enable_thinking: bool = False
    free_format: str = "plain"
    format_penalty: float = 0.0
    prompt: str = "compact"

    def format(self, tokenizer: PreTrainedTokenizerBase) -> ChatFormat:
        return ChatFormat.for_tokenizer(
            tokenizer,
            enable_thinking=self.enable_thinking,
            free_format=self.free_format,
            format_penalty=self.format_penalty,
            prompt=self.prompt,
        )


@dataclass(frozen=True)
class ChatFormat:
    """The tokenizer's chat template as per-turn id pieces, or a plain 'Task/Observation/Action' format
    for a tokenizer without one. Build it with ``for_tokenizer``."""

    tokenizer: PreTrainedTokenizerBase
    template: _Template | None  # None: the plain format
    end_id: int  # token that ends an assistant turn (the template's end-of-turn token)
    after_action: tuple[int, ...]  # ids appended to the context after the end token (e.g. a newline)
    stop_ids: tuple[int, ...]  # tokens that end generation: the end-of-turn token and the tokenizer's eos
    enable_thinking: bool = False
    free_format: str = "plain"  # "plain" | "react"
    format_penalty: float = 0.0  # subtracted from the step reward of a format error
    prompt: str = "compact"  # "compact" | "listed" (module docstring)
    _commands: dict[str, list[int]] = field(default_factory=dict, compare=False, repr=False)  # encode cache

    @classmethod
    def for_tokenizer(
        cls,
        tokenizer: PreTrainedTokenizerBase,
        *,
        enable_thinking: bool = False,
        free_format: str = "plain",
        format_penalty: float = 0.0,
        prompt: str = "compact",
    ) -> ChatFormat:
        """Read the pieces off the tokenizer's chat template. ``enable_thinking`` needs a template that has
        a thinking block (``<think>`` in the vocabulary)."""
        if enable_thinking and "<think>" not in tokenizer.get_vocab():
            raise ValueError(
                "rollout.enable_thinking: this tokenizer's chat template has no thinking block (no <think> token)"
            )
        if free_format not in ("plain", "react"):
            raise ValueError(f"rollout.free_format = {free_format!r}: expected plain or react")
        if prompt not in PROMPTS:
            raise ValueError(f"rollout.prompt = {prompt!r}: expected {' or '.join(PROMPTS)}")
        options = dict(
            enable_thinking=enable_thinking, free_format=free_format, format_penalty=format_penalty, prompt=prompt
        )
        eos = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
        if tokenizer.chat_template is None:
            after = tuple(tokenizer("\n", add_special_tokens=False).input_ids)
            return cls(tokenizer, None, eos[0], after, tuple(eos), **options)
        template, close = _read_template(tokenizer, enable_thinking)
        ids = list(tokenizer(close, add_special_tokens=False).input_ids)
        if not ids or tokenizer.convert_ids_to_tokens(ids[0]) not in tokenizer.all_special_tokens + list(
            tokenizer.get_added_vocab()
        ):
            raise ValueError(
                f"chat template: an assistant message is closed by {close!r}, which does not start with a special token"
            )
        stop = tuple(dict.fromkeys([ids[0], *eos]))
        return cls(tokenizer, template, ids[0], tuple(ids[1:]), stop, **options)

    def encode(self, text: str) -> list[int]:
        return self.encode_many([text])[0]

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        """Each text's ids, in one tokenizer call (its per-call cost paid once for a turn's batch)."""
        return [list(ids) for ids in self.tokenizer(texts, add_special_tokens=False).input_ids]

    def _render(self, messages: list[dict[str, str]]) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, enable_thinking=self.enable_thinking
        )

    def system(self, goal: str) -> list[int]:
        """The system message: the goal (``compact``; with the ReAct instruction in ``react`` format), or the
        project's instructions naming the task and the reply format (``listed``)."""
        react = self.free_format == "react"
        if self.prompt == "listed":
            goal = f"{LISTED_SYSTEM}\nTask: {goal}\n{REACT_INSTRUCTION if react else LISTED_REPLY}"
        elif react:
            goal = f"{goal}\n{REACT_INSTRUCTION}"
        if self.template is None:
            return self.encode(f"{goal}\n" if self.prompt == "listed" else f"Task: {goal}\n")
        if self.template.system_parts is not None:
            return self.encode(goal.join(self.template.system_parts))
        text = self._render(_reference(goal))
        return self.encode(_cut(text, "", self.template.after_system, "system message"))

    def user(self, observation: str, commands: list[str] | None = None) -> list[int]:
        """The observation message followed by the assistant header the action is generated after; with the
        ``listed`` prompt the turn's admissible ``commands`` follow the observation."""
        return self.users([observation], None if commands is None else [commands])[0]

    def users(self, observations: list[str], commands: list[list[str]] | None = None) -> list[list[int]]:
        """``user`` of each observation (with its admissible commands), tokenized in one call (a turn's batch
        of episodes). The ``compact`` prompt ignores ``commands``; ``listed`` needs them."""
        if self.prompt == "listed":
            if commands is None or len(commands) != len(observations):
                raise ValueError("rollout.prompt = 'listed': every observation needs its admissible commands")
            observations = [
                f"{o.rstrip()}\n\n{COMMANDS_HEADER}\n" + "\n".join(c) for o, c in zip(observations, commands)
            ]
        return self.encode_many([self._user_text(o) for o in observations])

    def _user_text(self, observation: str) -> str:
        if self.template is None:
            return f"Observation: {observation}\nAction:"
        if self.template.user_parts is not None:
            return observation.join(self.template.user_parts)
        return _cut(self._render(_reference(_GOAL, observation)), self.template.before_user, "", "user message")

    def close(self, action_ids: list[int]) -> list[int]:
        """Ids that follow a generated action in the context: the end token if it was cut off, then the rest
        of the template's close (ChatML's newline)."""
        missing_end = [] if action_ids and action_ids[-1] == self.end_id else [self.end_id]
        return missing_end + list(self.after_action)

    def command(self, text: str) -> list[int]:
        """Ids of an admissible command as the policy must emit it, end token included (cached). The
        command is encoded on its own: every template puts a reply right after a special token or a
        newline, where the tokenizer starts a fresh word, so these are its ids in the rendered context."""
        ids = self._commands.get(text)
        if ids is None:
            ids = self._commands[text] = self.encode(text) + [self.end_id]
        return ids

    def parse_action(self, ids: list[int], finished: bool) -> tuple[str, bool]:
        """(command, format_valid) of a free-mode reply's ``ids``. A reply cut at the token budget, empty,
        with an unclosed thinking block, or (``react``) whose last non-empty line is not the one
        ``Action: <command>`` line, is a format error; its command is what could be read ("" if nothing)."""
        if ids and ids[-1] in self.stop_ids:
            ids = ids[:-1]
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        ok = finished
        if "</think>" in text:  # a thinking block (policy tokens) comes before the answer
            text = text.rsplit("</think>", 1)[1]
        elif "<think>" in text:
            text, ok = "", False
        if self.free_format == "plain":
            command = text.strip()
            return command, ok and bool(command)
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        actions = [line for line in lines if line.startswith(ACTION_PREFIX)]
        command = actions[-1][len(ACTION_PREFIX) :].strip() if actions else ""
        return command, ok and len(actions) == 1 and lines[-1] == actions[0] and bool(command)


def _reference(goal: str, observation: str = _NEXT) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": goal},
        {"role": "user", "content": _OBS},
        {"role": "assistant", "content": _ACT},
        {"role": "user", "content": observation},
    ]


def _cut(text: str, head: str, tail: str, what: str) -> str:
    """``text`` without ``head`` and ``tail``, which the chat template must have rendered unchanged."""
    if not (text.startswith(head) and text.endswith(tail) and len(text) >= len(head) + len(tail)):
        raise ValueError(
            f"chat template: the {what} changes the rest of the conversation; it cannot be rendered turn by turn"
        )
    return text[len(head) : len(text) - len(tail)]


def _read_template(tokenizer: PreTrainedTokenizerBase, enable_thinking: bool) -> tuple[_Template, str]:
    """Cut the reference conversation into messages; returns the cuts and the text closing an assistant reply.

    A message begins at the special token that opens its role header (ChatML's ``<|im_start|>``, Llama 3's
    ``<|start_header_id|>``): the last special token before the role's name."""
    text = tokenizer.apply_chat_template(
        _reference(_GOAL), tokenize=False, add_generation_prompt=True, enable_thinking=enable_thinking
    )
    try:
        g, o, a, n = (text.index(m) for m in (_GOAL, _OBS, _ACT, _NEXT))
    except ValueError as err:
        raise ValueError(
            "chat template: it does not render a system, user, assistant, user conversation's contents"
        ) from err
    specials = set(tokenizer.all_special_tokens) | set(tokenizer.get_added_vocab())

    def message_start(lo: int, hi: int) -> int:
        """Index in ``text[lo:hi]`` (between two contents) where the user message's header begins."""
        role = text.rindex("user", lo, hi)
        starts = [i for i in range(lo, role) for s in specials if text.startswith(s, i) and i + len(s) <= role]
        if not starts:
            raise ValueError("chat template: no special token opens the user message")
        return max(starts)

    user1, user2 = message_start(g + len(_GOAL), o), message_start(a + len(_ACT), n)
    close = text[a + len(_ACT) : user2]
    system_parts, user_parts = (text[:g], text[g + len(_GOAL) : user1]), (text[user2:n], text[n + len(_NEXT) :])
    # Where the template inserts any content verbatim (ChatML, Qwen3; Llama 3 trims it), the pieces are
    # the parts around the marker, joined without a render per message (a probe with edge whitespace checks).
    probe = " \n a probe  \n"

    def render(goal, obs):
        return tokenizer.apply_chat_template(
            _reference(goal, obs), tokenize=False, add_generation_prompt=True, enable_thinking=enable_thinking
        )

    verbatim_system = render(probe, _NEXT) == probe.join(system_parts) + text[user1:]
    verbatim_user = render(_GOAL, probe) == text[:user2] + probe.join(user_parts)
    template = _Template(
        text[:user2], text[user1:], system_parts if verbatim_system else None, user_parts if verbatim_user else None
    )
    return template, close


def window_prompt(
    fmt: ChatFormat, goal_ids: list[int], history: list[tuple[list[int], list[int]]], obs_ids: list[int], h: int
) -> list[int]:
    """``system(goal) + last h (user(o_j) + a_j + close) turns + user(o_now)``.

    ``history`` holds (obs_ids, action_ids) per earlier turn."""
    ids = list(goal_ids)
    for o_ids, a_ids in history[len(history) - h :] if h > 0 else []:
        ids += o_ids + a_ids + fmt.close(a_ids)
    return ids + obs_ids


def full_delta(fmt: ChatFormat, goal_ids: list[int], obs_ids: list[int], prev_action: list[int] | None) -> list[int]:
    """Ids added to the growing sequence before this turn's action (``prev_action`` None on turn 0)."""
    if prev_action is None:
        return list(goal_ids) + obs_ids
    return fmt.close(prev_action) + obs_ids
