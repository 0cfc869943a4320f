"""The engine contract: token ids in, token ids out, with what the learner needs per token."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


class TokenTrie:
    """Prefix tree over token-id sequences; constrains decoding to a set of commands.

    Each sequence ends with the end-of-turn id, so reaching a leaf means the command is complete.
    """

    def __init__(self, sequences: list[list[int]], texts: list[str] | None = None) -> None:
        self.root: dict[int, dict] = {}
        self.texts: dict[tuple[int, ...], str] = {}  # full id sequence -> command text
        for k, seq in enumerate(sequences):
            node = self.root
            for t in seq:
                node = node.setdefault(t, {})
            if texts is not None:
                if self.texts.get(tuple(seq), texts[k]) != texts[k]:  # keeping one would hide the other
                    raise ValueError(
                        f"commands {self.texts[tuple(seq)]!r} and {texts[k]!r} have the same token ids "
                        f"{list(seq)}: the tokenizer cannot tell them apart, so one could never be chosen"
                    )
                self.texts[tuple(seq)] = texts[k]


def allowed_log_softmax(logits: torch.Tensor, allowed: list[list[int]]) -> torch.Tensor:
    """log-softmax of (n, V) ``logits`` over the full vocabulary, or over row i's ``allowed[i]`` ids where
    that list is non-empty (admissible mode). The sampler and the learner both call this, so the
    recorded and the recomputed log-probs are of the same distribution."""
    if any(allowed):  # one masked fill and one scatter for the batch (a row-by-row loop costs per row)
        bias = torch.zeros_like(logits)
        rows = [i for i, ids in enumerate(allowed) if ids]
        bias[torch.tensor(rows, device=logits.device)] = float("-inf")
        bias[
            torch.tensor([i for i in rows for _ in allowed[i]], device=logits.device),
            torch.tensor([t for i in rows for t in allowed[i]], device=logits.device),
        ] = 0.0
        logits = logits + bias
    return torch.log_softmax(logits, dim=-1)


@dataclass
class Generation:
    """One sampled action. Lists have one entry per generated token."""

    token_ids: list[int]
    logprobs: list[float]  # log-prob of the token under the distribution it was sampled from
    entropy: list[float]  # entropy of that distribution (full vocabulary, or the allowed set)
    policy_mask: list[bool]  # False where the token was forced (a single allowed continuation)
    allowed: list[list[int]] = field(default_factory=list)  # candidate ids per token ([] = full vocab)
    finished: bool = True  # ended with the end-of-turn token (False: cut at the token budget)
    error: str = ""  # why the engine produced no action (e.g. its server died); the episode ends as an error


@dataclass(frozen=True)
class SampleRequest:
    """One engine call: a batch of token-id prompts and how to sample an action after each. Every engine
    and session takes this one record, so a sampling setting is added in one place, not in each signature."""

    prompts: list[list[int]]  # for ``Session.extend``: each slot's new ids, appended to its sequence
    tries: list[TokenTrie | None]  # per prompt: the admissible commands (None: free text)
    max_new_tokens: int
    temperature: float
    greedy: bool
    seed: int


class Session(Protocol):
    """A batch of episodes whose sequences grow turn by turn (full-history context)."""

    def extend(self, slots: list[int], request: SampleRequest) -> list[Generation]:
        """Append ``request.prompts[k]`` (new ids) to episode ``slots[k]`` and sample its next action; absent
        slots are done."""
        ...


class Engine(Protocol):
    def session(self) -> Session:
        """A cache-carrying session for full-history rollouts."""
        ...

    def generate(self, request: SampleRequest) -> list[Generation]:
        """Sample one action per prompt, all prompts in one batch."""
        ...
