"""Batched sampling with a transformers causal LM: the episodes of a batch decode in lockstep, and an
episode leaves the decode batch the step its action ends.

Per token it records the log-prob under the distribution actually sampled from (temperature applied;
in admissible mode renormalised over the trie's allowed tokens, which is the policy's real
distribution), that distribution's entropy, and whether the token was forced (one allowed continuation:
no choice, so no policy-gradient signal).

A ``Session`` keeps one KV cache for a batch of episodes across turns (full-history context): each turn
prefills only the new tokens (the observation), not the whole history. Position ids are explicit and
padding is masked, so where a row's columns sit in the cache changes nothing but the holes; the session
uses that three ways:

* prefill: rows are grouped by the length of their new tokens into buckets (the fewest buckets whose
  padding stays within ``PREFILL_SLACK`` of the real tokens), each prefilled left-padded to its own
  longest row;
* decode: a row whose action ends (end token, trie leaf or token budget) leaves the batch at once. Its
  cache rows are set aside for the next turn, and its last token (sampled, not yet fed) is prepended to
  its next turn's new tokens: the same token at the same position, so every row sees exactly its own
  sequence, as when finished rows were fed padding to the end of the longest action;
* between calls the cache is reassembled with each row's real columns packed to the right end, so the
  holes (padding, rows that left early) are dropped and the cache is as long as the longest row.

Sampling is ``torch.multinomial``'s own draw for one sample per row, argmax(p / q) with q ~ Exp(1),
drawn for every row of the call at every step, rows that left included: a row leaving the batch
changes no other row's random numbers, and a seed draws the stream it drew when every row was fed to
the end. The floats may still move in the last bits: MKL's sgemm takes other kernels for small batches
(below 4 rows on one thread; some sizes below 12 on two), so a row's logits depend on how many rows share
its forward call to ~1e-7, as they did before on which episodes were still playing.

Every tensor lives on the model's device (``device``); sampling uses a generator on that device, so a
seed reproduces on one device type (CPU and CUDA draw different streams).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from horizonrl.engines.base import Generation, TokenTrie, allowed_log_softmax

PREFILL_SLACK = (
    0.1  # padding allowed in prefill, as a share of the real new tokens: fewer calls against fewer positions
)


class TransformersEngine:
    """Sampler over a ``transformers`` model that the trainer updates in place."""

    def __init__(self, model: torch.nn.Module, pad_id: int, end_ids: list[int], device: str = "cpu") -> None:
        self.model = model
        self.pad_id = pad_id
        self.end_ids = set(end_ids)
        self.device = torch.device(device)
        self.counts: Counter[str] = Counter()  # prefill_real, prefill_computed, decode_real, decode_computed

    def session(self) -> Session:
        return Session(self)

    def generate(
        self,
        prompts: list[list[int]],
        tries: list[TokenTrie | None],
        max_new_tokens: int,
        temperature: float,
        greedy: bool,
        seed: int,
    ) -> list[Generation]:
        """One action per prompt from fresh prompts (window context)."""
        return Session(self, keep_cache=False).extend(
            list(range(len(prompts))), prompts, tries, max_new_tokens, temperature, greedy, seed
        )


@dataclass
class _Block:
    """Rows of a KV cache: ``cache`` holds (rows, kv_heads, L, head_dim) keys and values per layer (None
    before the first prefill), ``attn`` (rows, L) is 1 at real columns, ``next_pos`` (rows,) is the
    position id of each row's next token."""

    cache: DynamicCache | None
    attn: torch.Tensor
    next_pos: torch.Tensor

    def take(self, idx: torch.Tensor) -> _Block:
        """A copy of rows ``idx``."""
        return _Block(
            _wrap([(layer.keys[idx], layer.values[idx]) for layer in self.cache.layers]),
            self.attn[idx],
            self.next_pos[idx],
        )

    def keep(self, idx: torch.Tensor) -> None:
        """Keep rows ``idx`` only."""
        self.cache.batch_select_indices(idx)
        self.attn, self.next_pos = self.attn[idx], self.next_pos[idx]


def _wrap(kv: list[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    """A ``DynamicCache`` over these per-layer (keys, values), without copying them."""
    cache = DynamicCache()
    for k, v in kv:
        layer = DynamicLayer()
        layer.lazy_initialization(k, v)
        layer.keys, layer.values = k, v
        cache.layers.append(layer)
    return cache


def _pick(t: torch.Tensor, src: torch.Tensor, column: torch.Tensor, out: torch.Tensor) -> None:
    """``out[j, :, c] = t[src[j], :, column[j, c]]`` for every (j, c). ``t`` (rows, heads, L, d) is read
    as rows of ``d`` floats, so this is one ``index_select`` into ``out`` (copying whole rows is what it
    is fast at; advanced indexing over two dimensions is several times slower)."""
    _, heads, length, d = t.shape
    flat = (src[:, None, None] * heads + torch.arange(heads, device=t.device)[None, :, None]) * length + column[
        :, None, :
    ]
    torch.index_select(t.reshape(-1, d), 0, flat.reshape(-1), out=out.view(-1, d))


def _assemble(sources: list[tuple[_Block, torch.Tensor]]) -> _Block:
    """A block of the rows ``src`` of each ``(block, src)``, one source after the other, each row with its
    real columns, in order, packed to the right end: the holes are dropped, so the block is as long as
    its longest row."""
    device = sources[0][1].device
    n = sum(len(src) for _, src in sources)
    width = max(int(block.attn[src].sum(1).max()) for block, src in sources)
    attn = torch.zeros((n, width), dtype=torch.long, device=device)
    next_pos = torch.empty(n, dtype=torch.long, device=device)
    kv = [
        (
            layer.keys.new_empty((n, layer.keys.shape[1], width, layer.keys.shape[3])),
            layer.values.new_empty((n, layer.values.shape[1], width, layer.values.shape[3])),
        )
        for layer in sources[0][0].cache.layers
    ]
    start = 0
    for block, src in sources:
        end = start + len(src)
        a = block.attn[src]
        j, col = a.nonzero(as_tuple=True)  # real columns, row by row, left to right
        to = (width - a.sum(1))[j] + a.cumsum(1)[j, col] - 1
        column = torch.zeros((len(src), width), dtype=torch.long, device=device)  # holes read column 0: masked
        column[j, to] = col
        attn[start + j, to] = 1
        next_pos[start:end] = block.next_pos[src]
        for (k, v), layer in zip(kv, block.cache.layers):
            _pick(layer.keys, src, column, k[start:end])
            _pick(layer.values, src, column, v[start:end])
        start = end
    return _Block(_wrap(kv), attn, next_pos)


def _buckets(lengths: list[int], slack: float) -> list[list[int]]:
    """Rows grouped for prefill, each group left-padded to its longest: starting from one group per
    length, neighbours (by length) are merged cheapest first while the padding stays within ``slack``
    of the real tokens. Rows keep their order within a group."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[tuple[int, list[int]]] = []  # (width, rows), widest first
    for i in order:
        if groups and groups[-1][0] == lengths[i]:
            groups[-1][1].append(i)
        else:
            groups.append((lengths[i], [i]))
    budget, padding = slack * sum(lengths), 0
    while len(groups) > 1:
        cost, k = min((len(groups[k + 1][1]) * (groups[k][0] - groups[k + 1][0]), k) for k in range(len(groups) - 1))
        if padding + cost > budget:
            break
        padding += cost
        groups[k] = (groups[k][0], groups[k][1] + groups.pop(k + 1)[1])
    return [sorted(rows) for _, rows in groups]


class Session:
    """A KV cache over a set of episode slots, extended turn by turn."""

    def __init__(self, engine: TransformersEngine, keep_cache: bool = True) -> None:
        self.e = engine
        self.keep_cache = keep_cache
        self.parts: list[_Block] = []  # the cache after the last call, in blocks of rows
        self.where: dict[int, tuple[int, int]] = {}  # slot -> (part, row in it)
        self.pending: dict[int, int] = {}  # slot -> its last sampled token, not yet in the cache

    @torch.no_grad()
    def extend(
        self,
        slots: list[int],
        new_ids: list[list[int]],
        tries: list[TokenTrie | None],
        max_new_tokens: int,
        temperature: float,
        greedy: bool,
        seed: int,
    ) -> list[Generation]:
        """Append ``new_ids[k]`` to slot ``slots[k]``'s sequence and sample its action; slots absent
        from ``slots`` are finished and leave the cache."""
        model = self.e.model
        was_training = model.training
        model.eval()
        try:
            inputs = [([self.pending[s]] if s in self.pending else []) + list(ids) for s, ids in zip(slots, new_ids)]
            block, live, logits = self._prefill(slots, inputs)
            self.parts, self.where, self.pending = [], {}, {}
            return self._decode(slots, block, live, logits, tries, max_new_tokens, temperature, greedy, seed)
        finally:
            model.train(was_training)

    def _rows(self, slots: list[int], rows: list[int]) -> tuple[_Block, list[int]]:
        """The cached rows of ``slots[rows]`` (empty rows in a fresh session), and their order in the
        block (grouped by the part that held them)."""
        dev = self.e.device
        if not self.parts:
            n = len(rows)
            return _Block(
                None, torch.zeros((n, 0), dtype=torch.long, device=dev), torch.zeros(n, dtype=torch.long, device=dev)
            ), rows
        by_part: dict[int, list[tuple[int, int]]] = {}
        for i in rows:
            part, row = self.where[slots[i]]
            by_part.setdefault(part, []).append((row, i))
        order = [i for p in by_part for _, i in by_part[p]]
        return _assemble(
            [(self.parts[p], torch.tensor([row for row, _ in by_part[p]], device=dev)) for p in by_part]
        ), order

    def _prefill(self, slots: list[int], inputs: list[list[int]]) -> tuple[_Block, list[int], torch.Tensor]:
        """Prefill every row's new tokens, bucket by bucket: the rows' block, the order of its rows
        (indices into ``slots``) and their next-token logits (R, V)."""
        done, order, logits = [], [], []
        for bucket in _buckets([len(x) for x in inputs], PREFILL_SLACK):
            block, rows = self._rows(slots, bucket)
            logits.append(self._prefill_block(block, [inputs[i] for i in rows]))
            done.append(block)
            order += rows
        if len(done) > 1:
            done = [_assemble([(block, torch.arange(len(block.attn), device=self.e.device)) for block in done])]
        return done[0], order, torch.cat(logits)

    def _prefill_block(self, block: _Block, new_ids: list[list[int]]) -> torch.Tensor:
        """Append ``new_ids`` (left-padded to the longest) to ``block``; the next-token logits (n, V)."""
        D = max(len(x) for x in new_ids)
        ids = torch.full((len(new_ids), D), self.e.pad_id, dtype=torch.long)  # built on the CPU, moved once
        mask = torch.zeros((len(new_ids), D), dtype=torch.long)
        for i, x in enumerate(new_ids):
            ids[i, D - len(x) :] = torch.tensor(x, dtype=torch.long)
            mask[i, D - len(x) :] = 1
        ids, mask = ids.to(self.e.device), mask.to(self.e.device)
        pos = block.next_pos[:, None] + (mask.cumsum(1) - 1).clamp_min(0)  # (n, D)
        block.attn = torch.cat([block.attn, mask], dim=1)
        out = self.e.model(
            input_ids=ids,
            attention_mask=block.attn,
            position_ids=pos,
            cache=block.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        block.cache = out.cache
        block.next_pos = block.next_pos + mask.sum(1)
        self.e.counts.update(prefill_real=int(mask.sum()), prefill_computed=mask.numel())
        return out.logits[:, -1].float()

    def _feed(self, block: _Block, tok: torch.Tensor) -> torch.Tensor:
        """Append one token per row of ``block``; the next logits (n, V)."""
        block.attn = torch.cat([block.attn, torch.ones_like(tok)[:, None]], dim=1)
        out = self.e.model(
            input_ids=tok[:, None],
            attention_mask=block.attn,
            position_ids=block.next_pos[:, None],
            cache=block.cache,
            use_cache=True,
        )
        block.cache = out.cache
        block.next_pos = block.next_pos + 1
        self.e.counts.update(decode_real=len(tok), decode_computed=len(tok))
        return out.logits[:, -1].float()

    def _decode(self, slots, block, live, logits, tries, max_new_tokens, temperature, greedy, seed) -> list[Generation]:
        """Sample until every row's action has ended; ``block`` and ``logits`` hold the rows still
        decoding, ``live`` (indices into ``slots``), in that order."""
        R, dev = len(slots), self.e.device
        gen = torch.Generator(device=dev).manual_seed(seed)
        nodes = [t.root if t is not None else None for t in tries]
        results = [Generation([], [], [], [], [], finished=False) for _ in range(R)]
        for step in range(max_new_tokens):
            allowed = [sorted(nodes[i].keys()) if nodes[i] is not None else [] for i in live]
            logp = allowed_log_softmax(logits / temperature, allowed)  # (n, V)
            if greedy:
                tok = logp.argmax(-1)
            else:  # torch.multinomial's draw for every row of the call, so leaving rows shift no one's numbers
                q = torch.empty((R, logp.shape[-1]), device=dev).exponential_(1, generator=gen)
                tok = (logp.exp() / (q if live == list(range(R)) else q[torch.tensor(live, device=dev)])).argmax(-1)
            ent = -(logp.exp() * logp.nan_to_num(neginf=0.0)).sum(-1)
            chosen = logp.gather(1, tok[:, None]).squeeze(-1)
            toks, chosen_l, ent_l = tok.tolist(), chosen.tolist(), ent.tolist()  # one device sync per step
            stay = []
            for k, i in enumerate(live):
                t = toks[k]
                r = results[i]
                r.token_ids.append(t)
                r.logprobs.append(chosen_l[k])
                r.entropy.append(ent_l[k])
                r.policy_mask.append(len(allowed[k]) != 1)
                r.allowed.append(allowed[k] if nodes[i] is not None else [])
                if nodes[i] is not None:
                    nodes[i] = nodes[i][t]
                if t in self.e.end_ids or (nodes[i] is not None and not nodes[i]):
                    r.finished = True
                elif step + 1 < max_new_tokens:
                    stay.append(k)
            if len(stay) < len(live):
                self._leave(slots, live, block, toks, stay)
            if not stay:
                break
            if len(stay) < len(live):
                idx = torch.tensor(stay, device=dev)
                block.keep(idx)
                tok = tok[idx]
            live = [live[k] for k in stay]
            logits = self._feed(block, tok)
        return results

    def _leave(self, slots: list[int], live: list[int], block: _Block, toks: list[int], stay: list[int]) -> None:
        """Rows of ``block`` not in ``stay`` leave the batch: kept for the next turn (full context) with
        their last token pending."""
        if not self.keep_cache:
            return
        kept = set(stay)
        leave = [k for k in range(len(live)) if k not in kept]
        part = block if not stay else block.take(torch.tensor(leave, device=self.e.device))
        for j, k in enumerate(leave):
            s = slots[live[k]]
            self.where[s] = (len(self.parts), k if not stay else j)
            self.pending[s] = toks[k]
        self.parts.append(part)
