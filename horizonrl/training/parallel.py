"""One rank's part of a data-parallel PPO update over torch.distributed (gloo on CPU, nccl on CUDA).

Every rank holds all of the iteration's rows and draws the same minibatches (same seed); each takes a
disjoint, fixed share of every minibatch's trajectories, balanced by token count (``balanced_shares``).
The loss's divisors (LOOP's fixed minibatch divisor, the token-mean count, docs/algorithms.md §1.5 and
§0.3) are computed by the trainer over the *whole* minibatch before it is split, so each rank's loss is
its share of the single-process loss and the gradients are *summed* over ranks (not averaged): the
update equals the single-process one up to float summation order.

The gradients are all-reduced in one flat bucket after the rank's micro-batches (what DDP's reducer
does, done here explicitly): ranks run different numbers of micro-batches (and a rank may get no
trajectory of a short minibatch), and the trainer calls the decoder and the output head, not a
wrapper's ``forward``, so ``DistributedDataParallel``'s hooks would neither fire per step nor match up.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


def balanced_shares(weights: list[int], n: int) -> list[list[int]]:
    """Indices of ``weights`` split into ``n`` disjoint shares of about equal total weight: heaviest first,
    each to the lightest share so far (ties: the lower share). Deterministic, so every rank computes the
    same split; each share lists its indices ascending."""
    shares: list[list[int]] = [[] for _ in range(n)]
    load = [0] * n
    for i in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        r = min(range(n), key=lambda r: (load[r], r))
        shares[r].append(i)
        load[r] += weights[i]
    return [sorted(s) for s in shares]


@dataclass
class Ranks:
    """This process's place in the update's process group, and the time it spent in collectives."""

    rank: int
    world_size: int
    comm_s: float = 0.0  # seconds in collectives since the update started
    steps: int = 0  # minibatch steps since the update started (taken or skipped)

    @classmethod
    def current(cls) -> Ranks:
        """The default process group's rank and size (``torch.distributed`` must be initialised)."""
        return cls(dist.get_rank(), dist.get_world_size())

    def share(self, units: list[list[int]], token_counts: list[int]) -> list[list[int]]:
        """This rank's units of a minibatch; ``token_counts[k]``: the tokens of ``units[k]``."""
        return [units[k] for k in balanced_shares(token_counts, self.world_size)[self.rank]]

    def gather(self, obj: object) -> list:
        """``obj`` of every rank, in rank order (a pickled all-gather: small objects only)."""
        t0 = time.perf_counter()
        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj)
        self.comm_s += time.perf_counter() - t0
        return out

    def sum_stats(self, out: dict[str, float]) -> dict[str, float]:
        """Every rank's step figures summed key by key (a key a rank lacks counts 0). The figures are sums
        over the rank's micro-batches already weighted by whole-minibatch counts, so the sum is the
        single-process figure."""
        merged: dict[str, float] = {}
        for part in self.gather(out):
            for k, v in part.items():
                merged[k] = merged.get(k, 0.0) + v
        return merged

    def all_reduce_grads(self, params: list[torch.nn.Parameter]) -> None:
        """Sum the gradients of ``params`` over ranks in one flat bucket. A parameter no rank gave a
        gradient keeps ``grad = None`` (so AdamW skips it, as in one process); one that some rank did
        gets the sum, zeros standing in for the ranks without."""
        if not params:
            return
        t0 = time.perf_counter()
        ref = params[0]
        flags = torch.tensor([p.grad is not None for p in params], dtype=torch.float32, device=ref.device)  # (k,)
        flat = torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to(torch.float32) for p in params]
            + [flags]
        )  # (sum numel + k,)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        grads = flat[: flat.numel() - len(params)]
        has = flat[flat.numel() - len(params) :]
        for k, p in enumerate(params):
            part = grads[offset : offset + p.numel()].view_as(p).to(p.dtype)
            offset += p.numel()
            p.grad = part.clone() if has[k] > 0 else None
        self.comm_s += time.perf_counter() - t0

    def any_above(self, value: float, limit: float) -> tuple[bool, float]:
        """(whether any rank's ``value`` is above ``limit`` or not a number, the largest value): one
        decision taken alike on every rank."""
        values = self.gather(value)
        bad = any(not (v <= limit) for v in values)  # NaN counts as above
        finite = [v for v in values if not math.isnan(v)]
        return bad, (max(finite) if len(finite) == len(values) else float("nan"))
