"""Batched sampling with a transformers causal LM, all active episodes of a batch in lockstep.

Per token it records the log-prob under the distribution actually sampled from (temperature applied;
in admissible mode renormalised over the trie's allowed tokens, which is the policy's real
distribution), that distribution's entropy, and whether the token was forced (one allowed continuation:
no choice, so no policy-gradient signal).

A ``Session`` keeps one KV cache for a batch of episodes across turns (full-history context): each turn
only the new tokens (the observation) are prefilled, not the whole history. Rows of finished episodes
are dropped from the cache. Within a turn, new tokens are left-padded to a common width; padding is
masked out and position ids count real tokens only, so every episode sees exactly its own sequence.

Every tensor lives on the model's device (``device``); sampling uses a generator on that device, so a
seed reproduces on one device type (CPU and CUDA draw different streams).
"""

from __future__ import annotations

from collections import Counter

import torch

from horizonrl.engines.base import Generation, TokenTrie, allowed_log_softmax


class TransformersEngine:
    """Sampler over a ``transformers`` model that the trainer updates in place."""

    def __init__(self, model: torch.nn.Module, pad_id: int, end_ids: list[int], device: str = "cpu") -> None:
        self.model = model
        self.pad_id = pad_id
        self.end_ids = set(end_ids)
        self.device = torch.device(device)
        self.counts: Counter[str] = Counter()  # prefill_real, prefill_computed, decode_real, decode_computed

    def session(self) -> "Session":
        return Session(self)

    def generate(self, prompts: list[list[int]], tries: list[TokenTrie | None], max_new_tokens: int, temperature: float, greedy: bool, seed: int) -> list[Generation]:
        """One action per prompt from fresh prompts (window context)."""
        return Session(self, keep_cache=False).extend(list(range(len(prompts))), prompts, tries, max_new_tokens, temperature, greedy, seed)


class Session:
    """A KV cache over a fixed set of episode slots, extended turn by turn."""

    def __init__(self, engine: TransformersEngine, keep_cache: bool = True) -> None:
        self.e = engine
        self.keep_cache = keep_cache
        self.slots: list[int] = []
        self.cache = None
        self.attn: torch.Tensor | None = None  # (R, Lc) 1 = real token
        self.next_pos: torch.Tensor | None = None  # (R,) position id of each row's next token

    @torch.no_grad()
    def extend(self, slots: list[int], new_ids: list[list[int]], tries: list[TokenTrie | None], max_new_tokens: int, temperature: float, greedy: bool, seed: int) -> list[Generation]:
        """Append ``new_ids[k]`` to slot ``slots[k]``'s sequence and sample its action; slots absent
        from ``slots`` are finished and leave the cache."""
        model = self.e.model
        was_training = model.training
        model.eval()
        try:
            self._select(slots)
            logits = self._prefill(new_ids)
            return self._decode(logits, tries, max_new_tokens, temperature, greedy, seed)
        finally:
            model.train(was_training)

    def _select(self, slots: list[int]) -> None:
        if self.cache is not None:
            keep = torch.tensor([self.slots.index(s) for s in slots], device=self.e.device)
            self.cache.batch_select_indices(keep)
            self.attn, self.next_pos = self.attn[keep], self.next_pos[keep]
        else:
            self.next_pos = torch.zeros(len(slots), dtype=torch.long, device=self.e.device)
        self.slots = list(slots)

    def _prefill(self, new_ids: list[list[int]]) -> torch.Tensor:
        D = max(len(x) for x in new_ids)
        ids = torch.full((len(new_ids), D), self.e.pad_id, dtype=torch.long)  # built on the CPU, moved once
        block = torch.zeros((len(new_ids), D), dtype=torch.long)
        for i, x in enumerate(new_ids):
            ids[i, D - len(x) :] = torch.tensor(x, dtype=torch.long)
            block[i, D - len(x) :] = 1
        ids, block = ids.to(self.e.device), block.to(self.e.device)
        pos = self.next_pos[:, None] + (block.cumsum(1) - 1).clamp_min(0)  # (R, D)
        self.attn = block if self.attn is None else torch.cat([self.attn, block], dim=1)
        out = self.e.model(input_ids=ids, attention_mask=self.attn, position_ids=pos, cache=self.cache, use_cache=True, logits_to_keep=1)
        self.cache = out.cache
        self.next_pos = self.next_pos + block.sum(1)
        self.e.counts.update(prefill_real=int(block.sum()), prefill_computed=block.numel())
        return out.logits[:, -1].float()  # (R, V)

    def _feed(self, tok: torch.Tensor, fed: torch.Tensor) -> torch.Tensor:
        """Append one token per row (pad where ``fed`` is False) and return the next logits (R, V)."""
        ids = torch.where(fed, tok, torch.full_like(tok, self.e.pad_id))
        self.attn = torch.cat([self.attn, fed[:, None].long()], dim=1)
        out = self.e.model(input_ids=ids[:, None], attention_mask=self.attn, position_ids=self.next_pos[:, None], cache=self.cache, use_cache=True)
        self.cache = out.cache
        self.next_pos = self.next_pos + fed.long()
        self.e.counts.update(decode_real=int(fed.sum()), decode_computed=fed.numel())
        return out.logits[:, -1].float()

    def _decode(self, logits, tries, max_new_tokens, temperature, greedy, seed) -> list[Generation]:
        R = len(self.slots)
        gen = torch.Generator(device=self.e.device).manual_seed(seed)
        nodes = [t.root if t is not None else None for t in tries]
        results = [Generation([], [], [], [], []) for _ in range(R)]
        active = torch.ones(R, dtype=torch.bool, device=self.e.device)
        for _ in range(max_new_tokens):
            allowed = [sorted(n.keys()) if n is not None else [] for n in nodes]
            logp = allowed_log_softmax(logits / temperature, allowed)  # (R, V)
            tok = logp.argmax(-1) if greedy else torch.multinomial(logp.exp(), 1, generator=gen).squeeze(-1)
            ent = -(logp.exp() * logp.nan_to_num(neginf=0.0)).sum(-1)
            chosen = logp.gather(1, tok[:, None]).squeeze(-1)
            fed = active.clone()
            toks, chosen_l, ent_l = tok.tolist(), chosen.tolist(), ent.tolist()  # one device sync per step
            for i in torch.nonzero(active).flatten().tolist():
                t = toks[i]
                r = results[i]
                r.token_ids.append(t)
                r.logprobs.append(chosen_l[i])
                r.entropy.append(ent_l[i])
                r.policy_mask.append(len(allowed[i]) != 1)
                r.allowed.append(allowed[i] if nodes[i] is not None else [])
                if nodes[i] is not None:
                    nodes[i] = nodes[i][t]
                if t in self.e.end_ids or (nodes[i] is not None and not nodes[i]):
                    active[i] = False
            if active.any() or self.keep_cache:
                logits = self._feed(tok, fed)  # the last tokens enter the cache too, for the next turn
            if not active.any():
                break
        for i, r in enumerate(results):
            r.finished = not bool(active[i])
        return results
