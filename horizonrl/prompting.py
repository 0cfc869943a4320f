"""Turning an episode into the token ids the policy sees, without ever re-tokenising its own output.

Two context modes (config ``rollout.context``):

* ``full``: one growing sequence ``system(goal) user(o_0) a_0 user(o_1) a_1 ...``. Each turn stores only
  the ids added since the previous action (``prompt_ids`` is a delta), so the trajectory is rebuilt by
  concatenation (layout T, ALGORITHMS.md 0.1).
* ``window``: each turn's prompt is ``system(goal)`` plus the last H turns plus the new observation, so
  every turn is its own sequence (layout S); ``prompt_ids`` is the whole prompt.

Past actions re-enter the context as the ids the engine produced, never as re-encoded text.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class ChatFormat:
    """ChatML when the tokenizer knows ``<|im_start|>``, else a plain 'Observation:/Action:' format."""

    tokenizer: PreTrainedTokenizerBase
    chatml: bool
    end_id: int  # token that ends an assistant turn
    after_action: tuple[int, ...]  # ids appended to the context after the end token (e.g. a newline)
    _commands: dict[str, list[int]] = field(default_factory=dict, compare=False, repr=False)  # encode cache

    @classmethod
    def for_tokenizer(cls, tokenizer: PreTrainedTokenizerBase) -> "ChatFormat":
        vocab = tokenizer.get_vocab()
        chatml = "<|im_start|>" in vocab and "<|im_end|>" in vocab
        end_id = vocab["<|im_end|>"] if chatml else int(tokenizer.eos_token_id)
        after = tuple(tokenizer("\n", add_special_tokens=False).input_ids)
        return cls(tokenizer, chatml, end_id, after)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def system(self, goal: str) -> list[int]:
        if self.chatml:
            return self.encode(f"<|im_start|>system\n{goal}<|im_end|>\n")
        return self.encode(f"Task: {goal}\n")

    def user(self, observation: str) -> list[int]:
        """The observation message followed by the assistant header the action is generated after."""
        if self.chatml:
            return self.encode(f"<|im_start|>user\n{observation}<|im_end|>\n<|im_start|>assistant\n")
        return self.encode(f"Observation: {observation}\nAction:")

    def close(self, action_ids: list[int]) -> list[int]:
        """Ids that follow a generated action in the context: the end token if it was cut off, then a newline."""
        missing_end = [] if action_ids and action_ids[-1] == self.end_id else [self.end_id]
        return missing_end + list(self.after_action)

    def command(self, text: str) -> list[int]:
        """Ids of an admissible command as the policy must emit it, end token included (cached)."""
        ids = self._commands.get(text)
        if ids is None:
            ids = self._commands[text] = self.encode(text) + [self.end_id]
        return ids


def window_prompt(fmt: ChatFormat, goal_ids: list[int], history: list[tuple[list[int], list[int]]], obs_ids: list[int], h: int) -> list[int]:
    """``system(goal) + last h (user(o_j) + a_j) turns + user(o_now)``; ``history`` holds (obs_ids, action_ids)."""
    ids = list(goal_ids)
    for o_ids, a_ids in history[len(history) - h :] if h > 0 else []:
        ids += o_ids + a_ids + fmt.close(a_ids)
    return ids + obs_ids


def full_delta(fmt: ChatFormat, goal_ids: list[int], obs_ids: list[int], prev_action: list[int] | None) -> list[int]:
    """Ids added to the growing sequence before this turn's action (``prev_action`` None on turn 0)."""
    if prev_action is None:
        return list(goal_ids) + obs_ids
    return fmt.close(prev_action) + obs_ids
