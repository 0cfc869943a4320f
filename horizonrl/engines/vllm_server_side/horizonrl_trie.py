"""A vLLM logits processor that runs inside the vLLM server (vLLM's own environment, never imported by the
project): it constrains a request's tokens to a token trie sent with the request, so an admissible action
costs one request instead of one per token with a choice (``horizonrl/engines/vllm.py``).

The server loads it at start (``--logits-processors horizonrl_trie:TrieLogitsProcessor``, this folder on
its ``PYTHONPATH``). A request carries its trie as ``vllm_xargs {"horizonrl_trie": [...]}``: the token ids
of each command in turn, each followed by -1. At every step the request's output so far is walked down the
trie and every token but the node's children gets -inf, before temperature and sampling; so with
``--logprobs-mode processed_logprobs`` the returned log-probs are over the allowed set, exactly as
``allowed_token_ids`` gives them per step, and a token with one continuation has log-prob 0.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

KEY = "horizonrl_trie"


def build_trie(flat: list[Any]) -> dict[int, dict]:
    """``[a, b, end, -1, a, c, end, -1]`` -> nested dicts token -> children."""
    root: dict[int, dict] = {}
    node = root
    for t in flat:
        t = int(t)
        if t < 0:
            node = root
        else:
            node = node.setdefault(t, {})
    return root


class TrieLogitsProcessor(AdapterLogitsProcessor):
    """Per request with a trie: -inf outside the children of the node its output has reached."""

    def is_argmax_invariant(self) -> bool:
        return False  # it changes which token is most likely: greedy requests need it too

    def new_req_logits_processor(self, params: Any) -> Any:
        flat = (params.extra_args or {}).get(KEY)
        if not flat:
            return None
        root = build_trie(flat)

        def constrain(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            node = root
            for t in output_ids:
                node = node.get(t)
                if node is None:  # left the trie (cannot happen under this mask): leave the logits alone
                    return logits
            if not node:  # a complete command; the request stops on its end id
                return logits
            keep = torch.tensor(list(node), device=logits.device)
            out = torch.full_like(logits, float("-inf"))
            out[keep] = logits[keep]
            return out

        return constrain
