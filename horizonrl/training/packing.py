"""Packed and prefix-shared (tree) decoder forwards for the update (docs/algorithms.md §1.6).

A micro-batch's rows are concatenated into one sequence of batch size 1, each row with its own position
ids, so no padded position is computed (``update.packing: packed``). Attention runs per *block* (a
contiguous run of packed tokens): a block attends causally to itself and, in full, to its context, the
packed tokens before it on its row. With ``update.packing: tree`` rows that share a token prefix (a task's
group: the same prompt; APPO's branches: their parent's tokens up to the branch point) place that prefix
once: rows sorted lexicographically share with their predecessor its longest common prefix, so each row adds
only its tokens after that prefix as one block whose context is the shared prefix's packed tokens. The
prefix's keys and values are gathered by index, so the gradient of every row's loss flows back through the
shared prefix as it would through the row's own copy: per-row values are the padded path's up to float
summation order.

Attention is SDPA called per block (the causal kernel for a block without context; an explicit
lower-right causal mask over context + block otherwise), through an attention function registered with
transformers' ``AttentionInterface`` and switched on for the packed call only.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ATTENTION = "horizonrl_packed"


@dataclass(frozen=True)
class Block:
    """Packed tokens ``start .. start + length - 1``; ``keys``: packed indices of context + block (None:
    no context, plain causal attention); ``mask``: (length, len(keys)) additive, lower-right causal (0 where
    attended, -inf elsewhere: SDPA would convert a boolean mask on every call)."""

    start: int
    length: int
    keys: torch.Tensor | None = None
    mask: torch.Tensor | None = None


@dataclass(frozen=True)
class Packing:
    """One micro-batch packed: ``ids`` and ``position_ids`` (1, N), ``blocks`` in packed order, and
    ``index[i]``: (L_i,) packed index of each position of row ``i``."""

    ids: torch.Tensor
    position_ids: torch.Tensor
    blocks: list[Block]
    index: list[np.ndarray]


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two id arrays."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def lexicographic(seqs: list[np.ndarray]) -> tuple[list[int], list[int]]:
    """Row order sorting ``seqs`` lexicographically, and each sorted row's common prefix with the previous
    one (0 for the first): the longest prefix it shares with any row before it in that order."""
    order = sorted(range(len(seqs)), key=lambda i: seqs[i].tolist())
    shared = [0] + [common_prefix(seqs[a], seqs[b]) for a, b in zip(order, order[1:])]
    return order, shared


def unique_tokens(seqs: list[np.ndarray]) -> int:
    """Tokens of ``seqs`` with every shared prefix counted once (the tree's packed length)."""
    if not seqs:
        return 0
    order, shared = lexicographic(seqs)
    return sum(len(seqs[i]) - s for i, s in zip(order, shared))


def pack(seqs: list[np.ndarray], share_prefixes: bool, device: torch.device) -> Packing:
    """``seqs`` packed into one sequence, each shared prefix once when ``share_prefixes``. A row that is
    wholly a prefix of an earlier one adds no block (it is read from that row's tokens)."""
    order, shared = lexicographic(seqs) if share_prefixes else (list(range(len(seqs))), [0] * len(seqs))
    index: list[np.ndarray] = [np.empty(0, dtype=np.int64)] * len(seqs)
    blocks: list[Block] = []
    ids, pos = [], []
    n, prev = 0, None
    for i, s in zip(order, shared):
        own = len(seqs[i]) - s
        new = np.arange(n, n + own, dtype=np.int64)
        index[i] = np.concatenate([index[prev][:s], new]) if s else new
        if own:
            ids.append(seqs[i][s:])
            pos.append(np.arange(s, len(seqs[i]), dtype=np.int64))
            if s:
                keys = torch.from_numpy(index[i]).to(device)
                causal = torch.ones(own, len(seqs[i]), dtype=torch.bool).tril(diagonal=s)
                mask = torch.zeros(causal.shape).masked_fill_(~causal, float("-inf")).to(device)
                blocks.append(Block(n, own, keys, mask))
            else:
                blocks.append(Block(n, own))
        n += own
        prev = i
    return Packing(
        torch.from_numpy(np.concatenate(ids))[None].to(device),
        torch.from_numpy(np.concatenate(pos))[None].to(device),
        blocks,
        index,
    )


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    packed_blocks: list[Block] | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention over a packed (1, N) sequence, block by block. query (1, h, N, d), key and value
    (1, h_kv, N, d); returns (1, N, h, d) as transformers' SDPA function does."""
    if packed_blocks is None or attention_mask is not None:
        raise ValueError("packed attention needs the packing's blocks and no attention mask (use decoder_hidden)")
    if sliding_window is not None:
        raise ValueError("packed attention does not implement a sliding window (update.packing: off)")
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    # one split per tensor and one gather for every block's context: a slice or gather per block would
    # scatter into a whole-sequence gradient per block in backward
    sizes = [b.length for b in packed_blocks]
    qs, ks, vs = query.split(sizes, dim=2), key.split(sizes, dim=2), value.split(sizes, dim=2)
    ctx = [b for b in packed_blocks if b.keys is not None]
    if ctx:
        index = torch.cat([b.keys for b in ctx])
        widths = [len(b.keys) for b in ctx]
        ctx_k = iter(key.index_select(2, index).split(widths, dim=2))
        ctx_v = iter(value.index_select(2, index).split(widths, dim=2))
    outs = []
    for b, q, k, v in zip(packed_blocks, qs, ks, vs):
        if b.keys is None:
            outs.append(F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scaling))
        else:
            k, v = next(ctx_k), next(ctx_v)
            mask = b.mask.to(q.dtype)  # float32 as built: a no-op unless the model runs in half precision
            outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling))
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION, packed_attention)


@contextmanager
def _attention(config, name: str) -> Iterator[None]:
    """The model's attention implementation switched to ``name`` for one call."""
    before = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = before


def decoder_hidden(decoder: torch.nn.Module, p: Packing) -> torch.Tensor:
    """The decoder's last hidden states of the packed sequence, (N, H). The prepared-mask mapping (no
    mask) keeps transformers from building an (N, N) mask the packed attention does not read."""
    with _attention(decoder.config, ATTENTION):
        out = decoder(
            input_ids=p.ids,
            position_ids=p.position_ids,
            attention_mask={"full_attention": None, "sliding_attention": None},
            use_cache=False,
            packed_blocks=p.blocks,
        )
    return out.last_hidden_state[0]
