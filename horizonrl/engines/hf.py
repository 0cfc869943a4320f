"""Batched sampling with a transformers causal LM: one prefill and a KV-cached decode loop per turn.

All active episodes of a batch decode in lockstep. Per token it records the log-prob under the
distribution actually sampled from (temperature applied; in admissible mode renormalised over the
trie's allowed tokens, which is the policy's real distribution), that distribution's entropy, and whether
the token was forced (one allowed continuation: no choice, so no policy-gradient signal).
"""

from __future__ import annotations

import torch

from horizonrl.engines.base import Generation, TokenTrie


class TransformersEngine:
    """Sampler over a ``transformers`` model that the trainer updates in place."""

    def __init__(self, model: torch.nn.Module, pad_id: int, end_ids: list[int], device: str = "cpu") -> None:
        self.model = model
        self.pad_id = pad_id
        self.end_ids = set(end_ids)
        self.device = torch.device(device)

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        tries: list[TokenTrie | None],
        max_new_tokens: int,
        temperature: float,
        greedy: bool,
        seed: int,
    ) -> list[Generation]:
        was_training = self.model.training
        self.model.eval()
        try:
            return self._generate(prompts, tries, max_new_tokens, temperature, greedy, seed)
        finally:
            self.model.train(was_training)

    def _generate(self, prompts, tries, max_new_tokens, temperature, greedy, seed) -> list[Generation]:
        B = len(prompts)
        gen = torch.Generator(device="cpu").manual_seed(seed)
        input_ids, attn = self._left_pad(prompts)  # (B, L)
        pos = (attn.cumsum(-1) - 1).clamp_min(0)
        out = self.model(input_ids=input_ids, attention_mask=attn, position_ids=pos, use_cache=True)
        past, logits = out.past_key_values, out.logits[:, -1].float()  # (B, V)
        nodes = [t.root if t is not None else None for t in tries]
        results = [Generation([], [], [], [], []) for _ in range(B)]
        active = torch.ones(B, dtype=torch.bool)
        next_pos = pos[:, -1] + 1  # (B,)
        for _ in range(max_new_tokens):
            allowed = [sorted(n.keys()) if n is not None else [] for n in nodes]
            logp = self._log_probs(logits / temperature, allowed)  # (B, V)
            if greedy:
                tok = logp.argmax(-1)
            else:
                tok = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(-1)  # (B,)
            ent = -(logp.exp() * logp.nan_to_num(neginf=0.0)).sum(-1)
            chosen_lp = logp.gather(1, tok[:, None]).squeeze(-1)
            for i in torch.nonzero(active).flatten().tolist():
                t = int(tok[i])
                r = results[i]
                r.token_ids.append(t)
                r.logprobs.append(float(chosen_lp[i]))
                r.entropy.append(float(ent[i]))
                r.policy_mask.append(len(allowed[i]) != 1)
                r.allowed.append(allowed[i] if nodes[i] is not None else [])
                if nodes[i] is not None:
                    nodes[i] = nodes[i][t]
                if t in self.end_ids or (nodes[i] is not None and not nodes[i]):
                    active[i] = False
            if not active.any():
                break
            feed = torch.where(active, tok, torch.full_like(tok, self.pad_id))
            attn = torch.cat([attn, active[:, None].long()], dim=1)
            out = self.model(input_ids=feed[:, None], attention_mask=attn, position_ids=next_pos[:, None], past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[:, -1].float()
            next_pos = next_pos + 1
        for i, r in enumerate(results):
            r.finished = not bool(active[i])
        return results

    def _left_pad(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        L = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), L), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(prompts), L), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, L - len(p) :] = torch.tensor(p, dtype=torch.long)
            attn[i, L - len(p) :] = 1
        return ids.to(self.device), attn.to(self.device)

    @staticmethod
    def _log_probs(scaled: torch.Tensor, allowed: list[list[int]]) -> torch.Tensor:
        """log-softmax over the full vocabulary, or over each row's allowed ids where it has some."""
        if any(allowed):
            bias = torch.zeros_like(scaled)
            for i, ids in enumerate(allowed):
                if ids:
                    bias[i].fill_(float("-inf"))
                    bias[i, ids] = 0.0
            scaled = scaled + bias
        return torch.log_softmax(scaled, dim=-1)
