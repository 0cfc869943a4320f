"""Batched sampling with a transformers causal LM: the episodes of a batch decode in lockstep, and an
episode leaves the decode batch the step its action ends.

Per token it records the log-prob under the distribution actually sampled from (temperature applied;
in admissible mode renormalised over the trie's allowed tokens, which is the policy's real
distribution), that distribution's entropy, and whether the token was forced (one allowed continuation:
no choice, so no policy-gradient signal).

A ``Session`` keeps one KV cache for a batch of episodes across turns (full-history context): each turn
prefills only the new tokens (the observation), not the whole history. Position ids are explicit and
padding is masked, so where a row's columns sit in the cache changes nothing but the holes. Each turn's
cache is one preallocated slab, (2 x layers, rows, kv_heads, columns, head_dim), written in place:

* the slab is sized once per turn (the rows' longest history plus the longest new tokens and the
  token budget) and each row's history is gathered into it once, its real columns packed to the
  right, so the rows of a prefill bucket end at one column and every bucket ends at the same one;
* prefill: rows are grouped by the length of their new tokens into buckets (the fewest buckets whose
  padding stays within ``PREFILL_SLACK`` of the real tokens), each a run of slab rows prefilled
  left-padded to its own longest row; attention reads a view of the slab ([rows, :, start:cursor]) and
  the layer writes the new keys and values at the cursor (``_SlabLayer``): no concatenation, no copy;
* decode: one column per step, written in place the same way, over the live rows, which are always
  the slab's first rows. A row whose action ends (end token, trie leaf or token budget) leaves the
  batch at once: it swaps places with the last row that stays (two rows copied, not the batch), keeps
  its cache in the slab for the next turn, and its last token (sampled, not yet fed) is prepended to
  its next turn's new tokens: the same token at the same position, so every row sees exactly its own
  sequence, as when finished rows were fed padding to the end of the longest action. A row's place in
  the batch changes none of its floats (each row of a matmul is computed alone), only the holes do.

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

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from horizonrl.engines.base import Generation, SampleRequest, allowed_log_softmax

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

    def generate(self, request: SampleRequest) -> list[Generation]:
        """One action per prompt from fresh prompts (window context)."""
        return Session(self, keep_cache=False).extend(list(range(len(request.prompts))), request)


class _SlabLayer(DynamicLayer):
    """One layer's keys and values as views of a preallocated slab (rows, kv_heads, C, head_dim): a call
    reads ``slab[rows, :, start:cursor]`` and its new keys and values are written in place at the cursor
    (``at`` places the view before each call)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.slab_keys, self.slab_values = keys, values
        self.device, self.is_initialized = keys.device, True
        self.at(slice(0, 0), 0, 0)

    def at(self, rows: slice, start: int, cursor: int) -> None:
        self.rows, self.start, self.cursor = rows, start, cursor
        self.keys = self.slab_keys[rows, :, start:cursor]
        self.values = self.slab_values[rows, :, start:cursor]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        end = self.cursor + key_states.shape[-2]
        self.slab_keys[self.rows, :, self.cursor : end] = key_states
        self.slab_values[self.rows, :, self.cursor : end] = value_states
        self.at(self.rows, self.start, end)
        return self.keys, self.values


class _Slab:
    """One turn's KV cache: every layer's keys and values in one tensor ``kv`` (2 x layers, rows, kv_heads,
    C, head_dim), so a turn's allocation, gather and row swaps are one operation each whatever the depth.
    It is allocated empty: the session writes every column a call reads before the call (zeros in the
    holes left of each row's history: masked columns add exactly zero, but only if finite), and zeroing
    the whole slab cost as much as a turn's gather; ``attn`` (rows, C) is 1 at
    real columns, ``next_pos`` (rows,) the position id of each row's next token."""

    def __init__(self, model: torch.nn.Module, rows: int, columns: int, device: torch.device) -> None:
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        dtype = next(model.parameters()).dtype
        self.kv = torch.empty((2 * cfg.num_hidden_layers, rows, heads, columns, dim), dtype=dtype, device=device)
        self.cache = DynamicCache()
        for k in range(cfg.num_hidden_layers):
            self.cache.layers.append(_SlabLayer(self.kv[2 * k], self.kv[2 * k + 1]))
        self.attn = torch.zeros((rows, columns), dtype=torch.long, device=device)
        self.next_pos = torch.zeros(rows, dtype=torch.long, device=device)

    def at(self, rows: slice, start: int, cursor: int) -> DynamicCache:
        """The cache as a view of ``rows`` from column ``start``, the next column written at ``cursor``."""
        for layer in self.cache.layers:
            layer.at(rows, start, cursor)
        return self.cache

    def swap(self, a: list[int], b: list[int], start: int, end: int, keep_a: bool) -> None:
        """Rows ``b`` move to rows ``a`` (columns start:end); rows ``a`` move to ``b`` too if ``keep_a``.
        Row by row: a few rows move per step, and a plain copy of a row is cheaper than an indexed
        gather and scatter of them."""
        for view in (self.kv[:, :, :, start:end].transpose(0, 1), self.attn[:, start:end], self.next_pos):
            for p, q in zip(a, b):
                kept = view[p].clone() if keep_a else None
                view[p].copy_(view[q])
                if keep_a:
                    view[q].copy_(kept)


def _pick(kv: torch.Tensor, src: torch.Tensor, column: torch.Tensor) -> torch.Tensor:
    """``out[:, j, :, c] = kv[:, src[j], :, column[j, c]]`` for every (j, c), (2 x layers, len(src), heads,
    width, d). ``kv`` (2 x layers, rows, heads, L, d) is read as rows of ``d`` floats, so this is one
    ``index_select`` (copying whole rows is what it is fast at; advanced indexing over two dimensions is
    several times slower)."""
    planes, rows, heads, length, d = kv.shape
    dev = kv.device
    flat = (src[:, None, None] * heads + torch.arange(heads, device=dev)[None, :, None]) * length + column[:, None, :]
    flat = torch.arange(planes, device=dev)[:, None, None, None] * (rows * heads * length) + flat[None]
    return torch.index_select(kv.reshape(-1, d), 0, flat.reshape(-1)).view(planes, len(src), heads, column.shape[1], d)


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
        self.slab: _Slab | None = None  # the cache after the last call
        self.row: dict[int, int] = {}  # slot -> its row in the slab
        self.pending: dict[int, int] = {}  # slot -> its last sampled token, not yet in the cache

    @torch.no_grad()
    def extend(self, slots: list[int], request: SampleRequest) -> list[Generation]:
        """Append ``request.prompts[k]`` to slot ``slots[k]``'s sequence and sample its action; slots absent
        from ``slots`` are finished and leave the cache."""
        model = self.e.model
        was_training = model.training
        model.eval()
        try:
            inputs = [
                ([self.pending[s]] if s in self.pending else []) + list(ids) for s, ids in zip(slots, request.prompts)
            ]
            slab, live, logits, start, cursor = self._prefill(slots, inputs, request.max_new_tokens)
            self.slab, self.row, self.pending = None, {}, {}
            return self._decode(slots, slab, live, logits, start, cursor, request)
        finally:
            model.train(was_training)

    def _prefill(
        self, slots: list[int], inputs: list[list[int]], max_new_tokens: int
    ) -> tuple[_Slab, list[int], torch.Tensor, int, int]:
        """This turn's slab with every row's history gathered and its new tokens prefilled, bucket by
        bucket: the slab, its rows' order (indices into ``slots``), their next-token logits (R, V), and
        the columns decoding starts from and writes next."""
        dev = self.e.device
        old = self.slab
        history = [0] * len(slots)
        if old is not None:
            real = old.attn.sum(1).tolist()
            history = [real[self.row[s]] for s in slots]
        buckets = _buckets([len(x) for x in inputs], PREFILL_SLACK)
        new = [max(len(inputs[i]) for i in b) for b in buckets]  # D_b
        longest = [max(history[i] for i in b) for b in buckets]  # H_b
        end = max(h + d for h, d in zip(longest, new))  # every bucket ends its new tokens at this column
        slab = _Slab(self.e.model, len(slots), end + max(max_new_tokens - 1, 0), dev)
        order, logits, first = [], [], 0
        for bucket, d, h in zip(buckets, new, longest):
            rows = slice(first, first + len(bucket))
            past = end - d  # the bucket's history ends here, right-packed
            slab.kv[:, rows, :, : past - h] = 0  # the holes before the history, read (masked) from ``start``
            if h:
                self._gather(old, slab, [self.row[slots[i]] for i in bucket], rows, past - h, past)
            logits.append(self._prefill_rows(slab, rows, [inputs[i] for i in bucket], past - h, past))
            order += bucket
            first += len(bucket)
        start = min(end - d - h for d, h in zip(new, longest))
        return slab, order, torch.cat(logits), start, end

    @staticmethod
    def _gather(old: _Slab, slab: _Slab, src_rows: list[int], rows: slice, start: int, past: int) -> None:
        """Rows ``src_rows`` of ``old``, their real columns in order, packed right to end at ``past`` in
        ``slab[rows]`` (columns ``start:past``); a shorter row's first columns are holes (column 0, masked)."""
        dev = old.attn.device
        src = torch.tensor(src_rows, device=dev)
        a = old.attn[src]
        width = past - start
        j, col = a.nonzero(as_tuple=True)  # real columns, row by row, left to right
        to = (width - a.sum(1))[j] + a.cumsum(1)[j, col] - 1
        column = torch.zeros((len(src_rows), width), dtype=torch.long, device=dev)
        column[j, to] = col
        attn = torch.zeros((len(src_rows), width), dtype=torch.long, device=dev)
        attn[j, to] = 1
        slab.attn[rows, start:past] = attn
        slab.next_pos[rows] = old.next_pos[src]
        slab.kv[:, rows, :, start:past] = _pick(old.kv, src, column)

    def _prefill_rows(self, slab: _Slab, rows: slice, new_ids: list[list[int]], start: int, past: int) -> torch.Tensor:
        """Prefill ``new_ids`` (left-padded to the longest) into ``slab[rows]`` from column ``past``, the
        history read from ``start``; the next-token logits (n, V)."""
        D = max(len(x) for x in new_ids)
        pad = [D - len(x) for x in new_ids]
        ids = torch.tensor([[self.e.pad_id] * p + list(x) for p, x in zip(pad, new_ids)], device=self.e.device)
        mask = torch.tensor([[0] * p + [1] * (D - p) for p in pad], device=self.e.device)
        pos = slab.next_pos[rows, None] + (mask.cumsum(1) - 1).clamp_min(0)  # (n, D)
        slab.attn[rows, past : past + D] = mask
        out = self.e.model(
            input_ids=ids,
            attention_mask=slab.attn[rows, start : past + D].clone(),  # copies: the slab's change later
            position_ids=pos,
            cache=slab.at(rows, start, past),
            use_cache=True,
            logits_to_keep=1,
        )
        slab.next_pos[rows] += mask.sum(1)
        self.e.counts.update(prefill_real=int(mask.sum()), prefill_computed=mask.numel())
        return out.logits[:, -1].float()

    def _feed(self, slab: _Slab, n: int, start: int, cursor: int, tok: torch.Tensor) -> torch.Tensor:
        """Append one token to each of the slab's first ``n`` rows at column ``cursor``; the next logits (n, V)."""
        slab.attn[:n, cursor] = 1
        out = self.e.model(
            input_ids=tok[:, None],
            attention_mask=slab.attn[:n, start : cursor + 1].clone(),
            position_ids=slab.next_pos[:n, None].clone(),
            cache=slab.at(slice(0, n), start, cursor),
            use_cache=True,
        )
        slab.next_pos[:n] += 1
        self.e.counts.update(decode_real=n, decode_computed=n)
        return out.logits[:, -1].float()

    def _decode(self, slots, slab, live, logits, start, cursor, request: SampleRequest) -> list[Generation]:
        """Sample until every row's action has ended; the slab's first rows are the rows still decoding,
        ``live`` (indices into ``slots``), in that order, ``logits`` theirs."""
        R, dev = len(slots), self.e.device
        max_new_tokens, temperature = request.max_new_tokens, request.temperature
        gen = torch.Generator(device=dev).manual_seed(request.seed)
        nodes = [t.root if t is not None else None for t in request.tries]
        results = [Generation([], [], [], [], [], finished=False) for _ in range(R)]
        for step in range(max_new_tokens):
            allowed = [sorted(nodes[i].keys()) if nodes[i] is not None else [] for i in live]
            logp = allowed_log_softmax(logits / temperature, allowed)  # (n, V)
            if request.greedy:
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
                order = self._leave(slots, live, slab, toks, stay, start, cursor)
                live = [live[k] for k in order]
                if stay:
                    tok = tok[torch.tensor(order, device=dev)]
            if not stay:
                break
            logits = self._feed(slab, len(live), start, cursor, tok)
            cursor += 1
        return results

    def _leave(self, slots, live, slab, toks, stay, start, cursor) -> list[int]:
        """Rows not in ``stay`` leave the batch: each leaving row among the first ``len(stay)`` swaps
        places with a staying row after them, so the rows still decoding are the slab's first ones. The
        leaving rows keep their cache there for the next turn (full context), their last token pending.
        Returns the rows still decoding, in their new order (positions in ``live``)."""
        n = len(stay)
        kept = set(stay)
        holes = [k for k in range(n) if k not in kept]
        movers = [k for k in stay if k >= n]
        if holes:
            slab.swap(holes, movers, start, cursor, keep_a=self.keep_cache)
        place = dict(zip(movers, holes)) | dict(zip(holes, movers))  # old position -> new position
        if self.keep_cache:
            for k in range(len(live)):
                if k not in kept:
                    s = slots[live[k]]
                    self.row[s] = place.get(k, k)
                    self.pending[s] = toks[k]
            self.slab = slab
        order = list(range(n))
        for hole, mover in zip(holes, movers):
            order[hole] = mover
        return order
