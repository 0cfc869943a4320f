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

``update.strategy: fsdp`` shards the parameters, their gradients and the AdamW state over the ranks with
FSDP2 (``fully_shard``: a unit per decoder layer, the rest in the root unit). The same uneven micro-batch
counts rule out FSDP's per-forward all-gathers (rank A's third forward would meet rank B's backward), so a
step runs as FSDP's gradient accumulation without communication: every unit is all-gathered once at the
step's start (``gather_weights``), the rank's micro-batches run with no collective, and one sync pass (a
forward and backward of one token through the root, its loss times 0) reduce-scatters the accumulated
gradients, summed (divide factor 1), and frees the whole weights. Clipping and AdamW then work on the
shards; ``full_state`` gathers the whole weights and AdamW state for the checkpoint, so it is the same
state as with one process. gloo has no ``PREMUL_SUM``: the reduction is forced to a plain sum.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from horizonrl.models.loading import resolve_device


def update_backend(model_device: str) -> str:
    """The process group's backend for ranks whose policy is on ``model_device`` (``model.device``): nccl on
    CUDA (collectives between GPUs, one GPU per rank), gloo on the CPU (nccl has no CPU tensors)."""
    return "nccl" if resolve_device(model_device).type == "cuda" else "gloo"


def rank_device(backend: str, local_rank: int) -> torch.device:
    """Where a rank holds its model: under nccl the GPU of its local rank (torchrun's ``LOCAL_RANK``; a Ray
    actor sees its one GPU as 0), under gloo the CPU."""
    return torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")


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
    root: torch.nn.Module | None = None  # update.strategy fsdp: the root unit around the policy (``shard``)
    units: list = field(default_factory=list)  # fsdp: every FSDP unit, the root last

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

    def reduce_grads(self, model: torch.nn.Module) -> None:
        """Sum the step's gradients over ranks: ddp all-reduces them (``all_reduce_grads``), fsdp runs the
        sync pass that reduce-scatters them into the shards."""
        if self.root is None:
            self.all_reduce_grads([p for p in model.parameters() if p.requires_grad])
            return
        t0 = time.perf_counter()
        self.root.set_requires_gradient_sync(True)
        self.root.set_reshard_after_backward(True)
        ids = torch.zeros((1, 1), dtype=torch.long, device=next(self.root.parameters()).device)
        (self.root(ids).float().sum() * 0.0).backward()  # adds exact zeros; the hooks reduce what is accumulated
        self.root.set_requires_gradient_sync(False)
        self.root.set_reshard_after_backward(False)
        self.comm_s += time.perf_counter() - t0

    def gather_weights(self) -> None:
        """fsdp: all-gather every unit's whole weights, kept until the next sync pass (a no-op where they
        are gathered already); ddp: nothing (every rank holds them)."""
        if self.root is None:
            return
        t0 = time.perf_counter()
        for unit in self.units:
            unit.unshard()
        self.comm_s += time.perf_counter() - t0

    def discard_grads(self, model: torch.nn.Module) -> None:
        """Drop a step's gradients without reducing them (a step abandoned on the trajectory KL): the
        optimizer's zero_grad does not reach fsdp's gathered weights, the module's does."""
        model.zero_grad(set_to_none=True)

    def shard(self, model: torch.nn.Module) -> None:
        """fsdp: shard ``model`` in place, ``fully_shard`` per decoder layer, then the root. Every rank
        must hold the same whole weights; an optimizer is built over the shards afterwards."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(next(model.parameters()).device.type, (self.world_size,))
        layers = getattr(model.get_decoder(), "layers", None)
        if layers is None:
            raise ValueError(f"update.strategy = 'fsdp' needs a decoder with .layers; {type(model).__name__} has none")
        self.root = ShardedPolicy(model)
        self.units = [*layers, self.root]
        for unit in self.units:
            fully_shard(unit, mesh=mesh, reshard_after_forward=False)
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)
        self.root.set_requires_gradient_sync(False)
        self.root.set_reshard_after_backward(False)
        with torch.no_grad():  # a first forward through the root makes it FSDP's root (lazy init) before any layer
            self.root(torch.zeros((1, 1), dtype=torch.long, device=mesh.device_type))
        for unit in self.units:
            unit.reshard()

    @staticmethod
    def shard_state(state: dict, model: torch.nn.Module) -> dict:
        """A whole optimizer ``state_dict()`` (e.g. a checkpoint's) cut to this rank's shards of the sharded
        ``model``'s parameters, to load into an optimizer over them; each rank slices its part, no collective."""
        params = list(model.parameters())
        return {
            **state,
            "state": {
                i: {
                    k: distribute_tensor(v, params[i].device_mesh, params[i].placements, src_data_rank=None)
                    if k != "step" and isinstance(v, torch.Tensor) and v.dim() > 0
                    else v
                    for k, v in entry.items()
                }
                for i, entry in state["state"].items()
            },
        }

    def full_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
        """(weights, optimizer state) whole and on the CPU, as one process's ``state_dict()`` s. Under fsdp
        every rank must call it (the shards are all-gathered)."""
        for unit in self.units:
            unit.reshard()  # a step abandoned on the KL leaves the gathered weights registered
        weights = {k: whole(v).detach().cpu() for k, v in model.state_dict().items()}
        state = optimizer.state_dict()
        state["state"] = {
            i: {k: whole(v).cpu() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
            for i, s in state["state"].items()
        }
        return weights, state


def whole(t: torch.Tensor) -> torch.Tensor:
    """``t`` whole: a sharded ``DTensor`` all-gathered (every rank must call), any other tensor as is."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: a ``DTensor``'s local shard, any other tensor whole."""
    return t.to_local() if isinstance(t, DTensor) else t


class ShardedPolicy(torch.nn.Module):
    """The root FSDP unit around a policy: it owns what the layer units do not (embeddings, final norm,
    output head, tied or not). The trainer calls the policy's decoder and head directly; this ``forward``
    (the logits at the last position) serves the root's first forward and the sync pass only."""

    def __init__(self, policy: torch.nn.Module) -> None:
        super().__init__()
        self.policy = policy

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.policy.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state  # (b, L, H)
        return self.policy.get_output_embeddings()(hidden[:, -1])  # (b, V)
