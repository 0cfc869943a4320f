"""The PPO update over stored rollouts (docs/algorithms.md §1.6): pi_old from the training model, then epochs of
shuffled minibatches, one AdamW step each, with grad-norm clipping, the trajectory-level KL early stop,
and non-finite steps skipped and counted.

pi_old is the learner's log-prob of every policy token before the update. When the sampler was this very
model (the transformers engine in this process, no LoRA; ``UpdateSettings.pi_old_tol`` set), the stored
sampling log-probs are that quantity already: the engine records them under the temperature and, in
admissible mode, renormalised over the allowed ids with the same ``allowed_log_softmax`` as the learner,
and they differ from a recompute only by float summation order (KV-cache decode vs one full forward;
tests/test_engine.py). Then a random sample of ``PI_OLD_CHECK_ROWS`` rows is recomputed per update and the
stored values are used when they agree within ``pi_old_tol`` (max absolute log-prob difference); else,
and for vLLM or LoRA-served engines, every row is recomputed (removing the sampler/learner mismatch).

The loss is computed per *unit*: a trajectory. In full context a trajectory is one row; in window context
it is several rows (one per turn) whose policy tokens are concatenated before the loss, so LOOP's
"every trajectory weighs the same" and per-turn / per-trajectory ratios mean the same in both layouts.
Log-probs are computed only at policy positions: the decoder's hidden states are gathered there before
the output head, and in admissible mode renormalised over the allowed ids, exactly as sampled; the head
runs over chunks of positions, each recomputed in backward (``head_logprobs``), so no full-vocabulary
float32 tensor of a whole micro-batch exists (a 49,152-id vocabulary made them the update's largest). The loss
also gets each policy token's response position (``response_positions``), so a discount over token
distance (APPO's future KL) counts the observation tokens between two turns.

Rows are run through the decoder in length buckets (sorted by length, each bucket padded by at most
``MAX_PAD`` of its positions): full-context trajectories of one iteration differ in length up to 2.5x,
and one padded batch per micro-batch spent 12-14% of its positions on padding in the main run (7% with
buckets). Each row's values are the same as in one batch up to float summation order. ``update.packing``
``packed`` or ``tree`` runs a micro-batch as one packed sequence instead, with no padding and, for ``tree``,
every shared prefix once (``horizonrl.training.packing``, docs/algorithms.md §1.6).
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

import methods
from horizonrl.config import TrainConfig
from horizonrl.engines.base import allowed_log_softmax
from horizonrl.training.packing import decoder_hidden, pack, unique_tokens
from horizonrl.training.parallel import Ranks, whole
from horizonrl.training.sequences import TrainRow
from methods.losses import LOG_RATIO_CLAMP, trajectory_kl_estimate
from methods.registry import LossParams


@dataclass(frozen=True)
class UpdateSettings:
    loss_name: str
    loss_params: LossParams
    epochs: int
    minibatch_size: int  # trajectories per optimizer step
    fixed_row_divisor: bool  # LOOP: divide by minibatch_size even for a short last minibatch
    grad_clip: float
    high_kl_threshold: float
    temperature: float
    micro_batch_tokens: int
    pad_id: int
    pi_old_tol: float | None = None  # stored sampling log-probs as pi_old within this max |diff| (None: recompute)
    measure_sampler: bool = False  # recomputing every row: also report max |stored - recomputed| (a vLLM sampler)
    decoupled: bool = False  # rows played by an older policy: weight by pi_prox / pi_behav (docs/algorithms.md §1.10)
    packing: str = "off"  # decoder batches: off (padded buckets), packed, tree (update.packing)

    @classmethod
    def from_config(
        cls, cfg: TrainConfig, pad_id: int, sampled_here: bool, decoupled: bool = False, horizon: int | None = None
    ) -> UpdateSettings:
        """The run's update settings: the method's loss and epochs, ``update.*``, the sampling temperature.

        ``sampled_here``: the rows were sampled by the weights about to be trained (the iteration's
        checkpoint, in this call or before a restart; not a copy changed since). Only then, and with the
        transformers engine playing locally without LoRA, can the stored sampling log-probs stand for
        pi_old (module docstring); a sample of rows is still recomputed and compared every update.
        ``decoupled``: the rows were played by an older checkpoint than the one trained (asynchronous
        rollouts, ``rollout.max_staleness``); pi_old is then recomputed and the stored log-probs weight the
        loss (docs/algorithms.md §1.10). ``horizon``: the run's turn horizon, which fixes L of the
        ``seq-mean-token-sum-norm`` aggregation (Dr.GRPO) to the most policy tokens a trajectory can hold,
        horizon x ``rollout.max_action_tokens``, unless the loss params set it (docs/algorithms.md §0.3)."""
        loss_name, loss_params = cfg.loss_spec()
        if loss_params.aggregation == "seq-mean-token-sum-norm" and loss_params.norm_length is None:
            if horizon is None:
                raise ValueError(
                    "the seq-mean-token-sum-norm aggregation needs a fixed length L: pass the run's horizon "
                    "or set loss_params.norm_length"
                )
            loss_params = replace(loss_params, norm_length=horizon * cfg.rollout.max_action_tokens)
        u = cfg.update
        learner_sampled = (
            sampled_here
            and cfg.engine.name == "transformers"
            and cfg.model.lora is None
            and cfg.rollout.runner == "local"
        )
        return cls(
            loss_name,
            loss_params,
            cfg.epochs,
            u.minibatch_size,
            cfg.preset.fixed_row_divisor,
            u.grad_clip,
            u.high_kl_threshold,
            cfg.rollout.temperature,
            u.micro_batch_tokens,
            pad_id,
            u.pi_old_tol if learner_sampled and not decoupled else None,
            sampled_here and cfg.engine.name == "vllm",
            decoupled,
            u.packing,
        )

    def for_rows(self, pad_id: int, stale: bool) -> UpdateSettings:
        """The run's settings (``from_config`` with ``sampled_here``) for one update's rows: padded with
        ``pad_id`` (the policy's tokenizer's); ``stale``, rows played by an older checkpoint than the one
        trained (asynchronous rollouts): what ``from_config`` gives with ``sampled_here`` off and
        ``decoupled`` on."""
        if not stale:
            return replace(self, pad_id=pad_id)
        return replace(self, pad_id=pad_id, pi_old_tol=None, measure_sampler=False, decoupled=True)

    @property
    def needs_reference(self) -> bool:
        """The loss has a KL term to the frozen initial policy."""
        return self.loss_params.kl_coef > 0


def annealed_lr(lr: float, lr_final: float | None, iteration: int, iterations: int) -> float:
    """The learning rate of ``iteration`` (1-based): ``lr`` throughout, or linear from ``lr`` at the first
    iteration to ``lr_final`` at the last. A pure function of the iteration, so a resumed run sets the
    same rate as one never stopped."""
    if lr_final is None:
        return lr
    return lr + (lr_final - lr) * (iteration - 1) / max(iterations - 1, 1)


@dataclass
class UpdateResult:
    stats: dict[str, float] = field(default_factory=dict)
    nonfinite_steps: int = 0


LOGIT_CHUNK = 1 << 23  # logits (positions x vocabulary) computed at once: 32 MB in float32, 170 positions of SmolLM2
MAX_PAD = 0.08  # padding share allowed in one decoder batch (the budget is 10% overall)
PI_OLD_CHECK_ROWS = 4  # rows recomputed per update to check the stored sampling log-probs


def length_buckets(lengths: list[int], max_pad: float = MAX_PAD) -> list[list[int]]:
    """Indices grouped into runs of similar length (ascending), each padded by at most ``max_pad`` of
    its computed positions when right-padded to its longest member."""
    buckets: list[list[int]] = []
    real = 0
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        n = len(buckets[-1]) + 1 if buckets else 0
        if not buckets or n * lengths[i] - (real + lengths[i]) > max_pad * n * lengths[i]:
            buckets.append([])
            real = 0
        buckets[-1].append(i)
        real += lengths[i]
    return buckets


def policy_logprobs(
    model: torch.nn.Module,
    rows: list[TrainRow],
    temperature: float,
    pad_id: int,
    counts: Counter | None = None,
    packing: str = "off",
    logit_chunk: int = LOGIT_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi(a_t | s_t) and the entropy of pi(. | s_t) at every policy token of ``rows``, flat (n,)
    in row order. Each row is cut after its last policy token. ``packing`` (``update.packing``): ``off``,
    padded length buckets; ``packed``, the rows concatenated; ``tree``, concatenated with shared prefixes
    once (``horizonrl.training.packing``). ``counts`` (if given) adds the real, the computed and the unique
    (shared prefixes once) decoder positions. ``logit_chunk``: the most logits held at once
    (``head_logprobs``)."""
    lengths = [r.positions[-1] + 1 if r.positions else len(r.input_ids) for r in rows]
    needs_seqs = packing != "off" or counts is not None  # each row as computed, for packing or the unique count
    seqs = [np.asarray(r.input_ids[:n], dtype=np.int64) for r, n in zip(rows, lengths)] if needs_seqs else []
    if counts is not None and packing != "tree":  # the tree's packed length is the unique count itself
        counts.update(unique_tokens=unique_tokens(seqs))
    if packing == "off":
        states = _padded_states(model, rows, lengths, pad_id, counts)
    else:
        states = _packed_states(model, rows, seqs, packing == "tree", counts)
    targets = torch.tensor([r.input_ids[p] for r in rows for p in r.positions], dtype=torch.long, device=states.device)
    allowed = [a for r in rows for a in r.allowed]
    return head_logprobs(model.get_output_embeddings(), states, targets, allowed, temperature, logit_chunk)


def head_logprobs(
    head: torch.nn.Module,
    states: torch.Tensor,
    targets: torch.Tensor,
    allowed: list[list[int]],
    temperature: float,
    logit_chunk: int = LOGIT_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi of ``targets`` (n,) and the (detached) entropy, (n,) each, from the decoder states (n, H)
    before them: the output head, the temperature and, where ``allowed[i]`` is non-empty, the
    renormalisation over those ids.

    The positions run in chunks of at most ``logit_chunk`` logits (positions x vocabulary), and with
    gradients each chunk is checkpointed: its backward recomputes the chunk's logits instead of keeping
    (n, V) float32 tensors alive from forward to backward (4 x 512 policy tokens of a 49,152-id
    vocabulary held 8 GB). Where one chunk covers every position, it runs as a plain forward."""
    rows = max(1, logit_chunk // head.weight.shape[0])
    n = states.shape[0]
    if n <= rows:
        return _chunk_logprobs(head, states, targets, allowed, temperature)
    parts = []
    for start in range(0, n, rows):
        args = (head, states[start : start + rows], targets[start : start + rows], allowed[start : start + rows])
        if torch.is_grad_enabled():
            parts.append(checkpoint(_chunk_logprobs, *args, temperature, use_reentrant=False))
        else:
            parts.append(_chunk_logprobs(*args, temperature))
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def _chunk_logprobs(
    head: torch.nn.Module, states: torch.Tensor, targets: torch.Tensor, allowed: list[list[int]], temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``head_logprobs`` of one chunk of positions: (c, H) states -> (c,) log-probs and (c,) entropies."""
    logits = head(states).float() / temperature  # (c, V)
    logp_all = allowed_log_softmax(logits, allowed)  # (c, V)
    logp = logp_all.gather(1, targets[:, None]).squeeze(1)  # (c,)
    with torch.no_grad():  # a figure, never differentiated: no (c, V) tensor kept for it
        entropy = -(logp_all.exp() * logp_all.masked_fill(torch.isinf(logp_all), 0.0)).sum(-1)  # (c,)
    return logp, entropy


def _padded_states(
    model: torch.nn.Module, rows: list[TrainRow], lengths: list[int], pad_id: int, counts: Counter | None
) -> torch.Tensor:
    """The decoder's states before every policy token, (n, H) in row order, from padded length buckets."""
    device = next(model.parameters()).device  # index tensors are built on the CPU and moved once
    picked, start = [], [0] * len(rows)  # per bucket (n_b, H) states before each policy token; row offsets
    n = 0
    for bucket in length_buckets(lengths):
        width = max(lengths[i] for i in bucket)
        ids = torch.full((len(bucket), width), pad_id, dtype=torch.long)
        for b, i in enumerate(bucket):
            ids[b, : lengths[i]] = torch.tensor(rows[i].input_ids[: lengths[i]])
            start[i], n = n, n + len(rows[i].positions)
        # Right padding under a causal mask: no real position attends to a pad, so no padding mask is
        # passed and attention takes the causal kernel (the explicit-mask path was 2x slower).
        hidden = model.get_decoder()(input_ids=ids.to(device), use_cache=False).last_hidden_state  # (b, L, H)
        b_idx = torch.tensor(
            [b for b, i in enumerate(bucket) for _ in rows[i].positions], dtype=torch.long, device=device
        )
        p_idx = torch.tensor([p - 1 for i in bucket for p in rows[i].positions], dtype=torch.long, device=device)
        picked.append(hidden[b_idx, p_idx])  # one gather per bucket: one scatter in backward
        if counts is not None:
            counts.update(real_tokens=sum(lengths[i] for i in bucket), computed_tokens=ids.numel())
    order = torch.tensor(
        [start[i] + j for i, r in enumerate(rows) for j in range(len(r.positions))], dtype=torch.long, device=device
    )
    return torch.cat(picked)[order]


def _packed_states(
    model: torch.nn.Module, rows: list[TrainRow], seqs: list[np.ndarray], share_prefixes: bool, counts: Counter | None
) -> torch.Tensor:
    """The decoder's states before every policy token, (n, H) in row order, from one packed sequence of
    ``seqs`` (each row's ids up to its last policy token)."""
    device = next(model.parameters()).device
    p = pack(seqs, share_prefixes, device)
    hidden = decoder_hidden(model.get_decoder(), p)  # (N, H)
    where = np.concatenate([p.index[i][np.asarray(r.positions, dtype=np.int64) - 1] for i, r in enumerate(rows)])
    if counts is not None:
        n = p.ids.shape[1]
        counts.update(real_tokens=n, computed_tokens=n)
        if share_prefixes:
            counts.update(unique_tokens=n)
    return hidden[torch.from_numpy(where).to(device)]


def trajectory_units(rows: list[TrainRow]) -> list[list[int]]:
    """Row indices grouped by trajectory (rows of one rollout are one unit), in first-seen order."""
    units: dict[int, list[int]] = {}
    for i, r in enumerate(rows):
        units.setdefault(r.rollout_id, []).append(i)
    return list(units.values())


def response_positions(row: TrainRow) -> list[int]:
    """Response position of each policy token of ``row``, (P,): what APPO's future-KL discount counts
    (docs/algorithms.md §3.7: every response position, observation tokens between turns included).

    Full context (``turn == -1``): the token's index in the trajectory's one sequence. Window context:
    a trajectory has no single sequence and each turn's observation is part of its own prompt (layout S),
    so the index among the trajectory's action tokens."""
    return row.positions if row.turn < 0 else row.flat_index


def _chunks(
    units: list[list[int]], rows: list[TrainRow], max_tokens: int, by_content: bool = False
) -> list[list[list[int]]]:
    """Split a minibatch's units into micro-batches of about ``max_tokens`` tokens (units stay whole), in
    order of size, or with ``by_content`` of their first row's ids (rows sharing a prefix side by side, for
    the tree layout to place it once)."""
    out, cur, size = [], [], 0
    key = (lambda u: rows[u[0]].input_ids) if by_content else (lambda u: sum(len(rows[i].input_ids) for i in u))
    for u in sorted(units, key=key):
        n = sum(len(rows[i].input_ids) for i in u)
        if cur and size + n > max_tokens:
            out.append(cur)
            cur, size = [], 0
        cur.append(u)
        size += n
    return out + ([cur] if cur else [])


def _unit_tensors(
    units: list[list[int]], rows: list[TrainRow], flat: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Regroup per-row flat values (n,) into (U, P) per unit, with the (U, P) mask of real entries."""
    offsets, k = {}, 0
    for u in units:
        for i in u:
            offsets[i] = k
            k += len(rows[i].positions)
    index = [[offsets[i] + j for i in u for j in range(len(rows[i].positions))] for u in units]
    P = max(len(ix) for ix in index)
    idx = torch.tensor([ix + [0] * (P - len(ix)) for ix in index], device=flat.device)
    mask = torch.tensor([[True] * len(ix) + [False] * (P - len(ix)) for ix in index], device=flat.device)
    return flat[idx], mask


def _unit_lists(
    units: list[list[int]], values: Callable[[int], list], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Per-row lists ``values(i)`` concatenated per unit and right-padded with 0 to (U, P)."""
    seqs = [[v for i in u for v in values(i)] for u in units]
    P = max(len(s) for s in seqs)
    return torch.tensor([s + [0] * (P - len(s)) for s in seqs], dtype=dtype, device=device)


@torch.no_grad()
def recompute_old_logprobs(
    model: torch.nn.Module, rows: list[TrainRow], s: UpdateSettings, counts: Counter | None = None
) -> list[list[float]]:
    """pi_old with the training model, removing sampler/learner mismatch (docs/algorithms.md §1.6)."""
    model.eval()
    old: list[list[float]] = []
    for start in range(0, len(rows), 256):
        batch = rows[start : start + 256]
        logp, _ = policy_logprobs(model, batch, s.temperature, s.pad_id, counts, s.packing)
        for part in torch.split(logp, [len(r.positions) for r in batch]):
            old.append(part.tolist())
    model.train()
    return old


def old_logprobs(
    model: torch.nn.Module, rows: list[TrainRow], s: UpdateSettings, seed: int, counts: Counter | None = None
) -> tuple[list[list[float]], dict[str, float]]:
    """pi_old per row, and how it was obtained: ``pi_old_shortcut`` (1: the stored sampling log-probs,
    0: the check failed and every row was recomputed) and ``pi_old_max_diff`` (max |stored - recomputed|
    over the checked rows); no figures when ``s.pi_old_tol`` is None (every row recomputed)."""
    if s.pi_old_tol is None:
        recomputed = recompute_old_logprobs(model, rows, s, counts)
        if not s.measure_sampler:
            return recomputed, {}
        got = torch.tensor([v for c in recomputed for v in c], dtype=torch.float64)
        stored = torch.tensor([v for r in rows for v in r.sample_logp], dtype=torch.float64)
        return recomputed, {"pi_old_max_diff": float((got - stored).abs().max()) if stored.numel() else 0.0}
    picked = random.Random(seed).sample(range(len(rows)), min(PI_OLD_CHECK_ROWS, len(rows)))
    checked = recompute_old_logprobs(model, [rows[i] for i in picked], s, counts)
    stored = torch.tensor([v for i in picked for v in rows[i].sample_logp], dtype=torch.float64)
    diff = (
        float((torch.tensor([v for c in checked for v in c], dtype=torch.float64) - stored).abs().max())
        if stored.numel()
        else 0.0
    )
    if diff <= s.pi_old_tol:  # False for NaN: a non-finite stored value falls back
        return [list(r.sample_logp) for r in rows], {"pi_old_shortcut": 1.0, "pi_old_max_diff": diff}
    return recompute_old_logprobs(model, rows, s, counts), {"pi_old_shortcut": 0.0, "pi_old_max_diff": diff}


def shared_old_logprobs(
    model: torch.nn.Module, rows: list[TrainRow], s: UpdateSettings, seed: int, counts: Counter, ranks: Ranks
) -> tuple[list[list[float]], dict[str, float]]:
    """``old_logprobs`` across ranks: each rank checks (and if need be recomputes) a fixed share of the rows,
    balanced by token count, and the shares are gathered, so every rank holds pi_old of every row. The
    shortcut is taken only when every rank's check passed (one decision for all); ``pi_old_max_diff`` is
    the largest over ranks."""
    share = balanced_shares_of_rows(rows, ranks)
    mine = [rows[i] for i in share]
    ranks.gather_weights()
    if s.pi_old_tol is None:
        values, stats = recompute_old_logprobs(model, mine, s, counts) if mine else [], {}
    else:
        diff = 0.0
        if mine:  # this rank's check: a sample of its own rows (seeded per rank)
            picked = random.Random(seed * 1_000 + ranks.rank).sample(
                range(len(mine)), min(PI_OLD_CHECK_ROWS, len(mine))
            )
            checked = recompute_old_logprobs(model, [mine[i] for i in picked], s, counts)
            got = torch.tensor([v for c in checked for v in c], dtype=torch.float64)
            stored = torch.tensor([v for i in picked for v in mine[i].sample_logp], dtype=torch.float64)
            diff = float((got - stored).abs().max()) if stored.numel() else 0.0
        failed, worst = ranks.any_above(diff, s.pi_old_tol)
        if failed:
            values = recompute_old_logprobs(model, mine, s, counts) if mine else []
        else:
            values = [list(r.sample_logp) for r in mine]
        stats = {"pi_old_shortcut": 0.0 if failed else 1.0, "pi_old_max_diff": worst}
    old: list[list[float]] = [[] for _ in rows]
    for part, vals in ranks.gather((share, values)):
        for i, v in zip(part, vals):
            old[i] = v
    return old, stats


def behaviour_weighted(rows: list[TrainRow], prox: list[list[float]]) -> tuple[list[TrainRow], dict[str, float]]:
    """The decoupled PPO objective's behaviour weight (docs/algorithms.md §1.10) folded into the advantages:
    each policy token's A becomes w A with w = pi_prox / pi_behav = exp(log pi_prox - log pi_behav), pi_prox
    the learner's policy before the update (``prox``, the recomputed pi_old) and pi_behav the stored
    sampling log-probs of the version that played the row. w is a constant > 0, so
    w * max(-rA, -clip(r)A) = max(-r(wA), -clip(r)(wA)): the loss function's clip stays on pi_theta / pi_prox.
    The log-weight is clamped like a log-ratio (``LOG_RATIO_CLAMP``)."""
    out, weights = [], []
    for row, p in zip(rows, prox):
        w = [math.exp(max(-LOG_RATIO_CLAMP, min(LOG_RATIO_CLAMP, a - b))) for a, b in zip(p, row.sample_logp)]
        weights += w
        out.append(replace(row, adv=[a * x for a, x in zip(row.adv, w)]))
    stats = {"behav_weight_mean": sum(weights) / len(weights), "behav_weight_max": max(weights)} if weights else {}
    return out, stats


def balanced_shares_of_rows(rows: list[TrainRow], ranks: Ranks) -> list[int]:
    """This rank's fixed share of ``rows`` (indices), balanced by token count."""
    return [u[0] for u in ranks.share([[i] for i in range(len(rows))], [len(r.input_ids) for r in rows])]


def ppo_update(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    rows: list[TrainRow],
    s: UpdateSettings,
    seed: int,
    ref_model: torch.nn.Module | None = None,
    ranks: Ranks | None = None,
) -> UpdateResult:
    """Epochs of minibatch PPO over the trajectories of ``rows``; pi_old is frozen for the whole call.

    ``ref_model`` (frozen initial policy) is needed only by losses with a KL-to-reference term. ``ranks``:
    this process is one rank of a data-parallel update (``horizonrl.training.parallel``): every rank calls
    this with the same rows and seed, computes its share of each minibatch and the gradients are summed;
    the returned figures are the whole update's, the same on every rank."""
    counts: Counter = Counter()  # decoder positions, real and computed (padding = the difference)
    began = time.perf_counter()  # the whole call, pi_old included: the window ``comm_share``'s collectives fall in
    if ranks is None:
        old, pi_old_stats = old_logprobs(model, rows, s, seed, counts)
    else:
        old, pi_old_stats = shared_old_logprobs(model, rows, s, seed, counts, ranks)
    if s.decoupled:
        rows, behav_stats = behaviour_weighted(rows, old)
        pi_old_stats = {**pi_old_stats, **behav_stats}
    units = trajectory_units(rows)
    gen = torch.Generator().manual_seed(seed)
    agg: dict[str, list[float]] = defaultdict(list)
    result, tokens, steps, stopped, t0 = UpdateResult(), 0, 0, False, time.perf_counter()
    model.train()
    for _ in range(s.epochs):
        perm = torch.randperm(len(units), generator=gen).tolist()
        for start in range(0, len(perm), s.minibatch_size):
            mb = [units[k] for k in perm[start : start + s.minibatch_size]]
            step = _minibatch_step(model, optimizer, rows, old, mb, s, ref_model, counts, ranks)
            tokens += step["tokens"]
            if abs(step["traj_kl"]) > s.high_kl_threshold:
                stopped = True
                break
            if not step["finite"]:
                result.nonfinite_steps += 1
                continue
            steps += 1
            for k, v in step.items():
                if k not in ("tokens", "finite"):
                    agg[k].append(v)
        if stopped:
            break
    elapsed = time.perf_counter() - t0
    result.stats = {k: float(sum(v) / len(v)) if v else 0.0 for k, v in agg.items()}
    result.stats.update(
        steps=steps,
        kl_stop=float(stopped),
        nonfinite_steps=result.nonfinite_steps,
        rows=len(rows),
        trajectories=len(units),
        policy_tokens=sum(len(r.positions) for r in rows),
        tokens_per_s=tokens / max(elapsed, 1e-9),
        seconds=elapsed,
        pad_fraction=1.0 - counts["real_tokens"] / max(counts["computed_tokens"], 1),
        tokens_computed_per_unique=counts["computed_tokens"] / max(counts["unique_tokens"], 1),
        **pi_old_stats,
    )
    if ranks is not None:
        result.stats.update(_rank_figures(ranks, counts, time.perf_counter() - began))
    return result


def _rank_figures(ranks: Ranks, counts: Counter, elapsed: float) -> dict[str, float]:
    """The whole group's padding share, each rank's mean seconds per minibatch step (``step_s_rank<r>``:
    its update time over its steps) and the share of the update spent in collectives (``comm_share``:
    gradient all-reduce, figure and pi_old gathers; mean over ranks). ``elapsed``: the whole update's time,
    pi_old included, since its gathers count too (timed from the minibatch loop alone, a slow pi_old gather
    on a loaded machine made the share 1.02)."""
    parts = ranks.gather(
        (counts["real_tokens"], counts["computed_tokens"], elapsed, ranks.comm_s, counts["unique_tokens"])
    )
    out = {
        "pad_fraction": 1.0 - sum(p[0] for p in parts) / max(sum(p[1] for p in parts), 1),
        "tokens_computed_per_unique": sum(p[1] for p in parts) / max(sum(p[4] for p in parts), 1),
        "comm_share": sum(p[3] / max(p[2], 1e-9) for p in parts) / len(parts),
        "world_size": float(ranks.world_size),
    }
    out.update({f"step_s_rank{r}": p[2] / max(ranks.steps, 1) for r, p in enumerate(parts)})
    return out


def _minibatch_step(
    model,
    optimizer,
    rows: list[TrainRow],
    old: list[list[float]],
    mb: list[list[int]],
    s: UpdateSettings,
    ref_model,
    counts: Counter,
    ranks: Ranks | None = None,
) -> dict[str, float]:
    """Forward/backward over micro-batches of whole trajectories, then one clipped AdamW step.

    The step is skipped (not taken) when the pre-step trajectory KL exceeds the threshold or any loss
    or gradient is non-finite. With ``ranks``, this rank runs its share of ``mb`` with the divisors of
    the whole ``mb``; figures and gradients are summed over ranks before any decision."""
    loss_fn = methods.LOSSES.get(s.loss_name).fn
    n_terms = _loss_terms(s.loss_params, rows, mb)
    row_div = s.minibatch_size if s.fixed_row_divisor else len(mb)
    optimizer.zero_grad(set_to_none=True)
    if ranks is not None:
        ranks.gather_weights()
    out = {
        "loss": 0.0,
        "traj_kl": 0.0,
        "tokens": 0,
        "clip_frac": 0.0,
        "approx_kl": 0.0,
        "ratio_mean": 0.0,
        "kl_ref": 0.0,
        "entropy": 0.0,
    }
    n_tok = sum(len(rows[i].positions) for u in mb for i in u)
    kl_parts: list[
        tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    ] = []  # (U, P) log pi, log pi_old, mask per micro-batch
    mine = mb if ranks is None else ranks.share(mb, [sum(len(rows[i].input_ids) for i in u) for u in mb])
    for micro in _chunks(mine, rows, s.micro_batch_tokens, by_content=s.packing == "tree"):
        flat_rows = [i for u in micro for i in u]
        logp_flat, ent_flat = policy_logprobs(
            model, [rows[i] for i in flat_rows], s.temperature, s.pad_id, counts, s.packing
        )
        where = {i: k for k, i in enumerate(flat_rows)}
        local = [[where[i] for i in u] for u in micro]
        sub = [rows[i] for i in flat_rows]
        logp, mask = _unit_tensors(local, sub, logp_flat)  # (U, P)
        ent, _ = _unit_tensors(local, sub, ent_flat)
        old_lp = _unit_lists(micro, lambda i: old[i], torch.float32, logp.device)
        adv = _unit_lists(micro, lambda i: rows[i].adv, torch.float32, logp.device)
        turn_id = _unit_lists(micro, lambda i: rows[i].turn_id, torch.long, logp.device).masked_fill(~mask, -1)
        positions = _unit_lists(micro, lambda i: response_positions(rows[i]), torch.long, logp.device)
        ref_lp = None
        if ref_model is not None:
            with torch.no_grad():
                ref_lp, _ = _unit_tensors(
                    local, sub, policy_logprobs(ref_model, sub, s.temperature, s.pad_id, packing=s.packing)[0]
                )
        terms = loss_fn(
            logp,
            old_lp,
            adv,
            mask,
            turn_id,
            s.loss_params,
            ref_logp=ref_lp,
            n_rows_div=row_div,
            n_tokens_div=n_terms,
            positions=positions,
        )
        terms.loss.backward()
        w = float(mask.sum()) / max(n_tok, 1)
        out["loss"] += float(terms.loss.detach())
        out["kl_ref"] += terms.kl_ref  # a micro-batch's share under the minibatch's divisors, like the loss
        kl_parts.append((logp.detach(), old_lp, mask))
        out["tokens"] += sum(rows[i].positions[-1] + 1 for i in flat_rows)
        out["clip_frac"] += terms.clip_frac * w
        out["approx_kl"] += terms.approx_kl * w
        out["ratio_mean"] += terms.ratio_mean * w
        out["entropy"] += float((ent * mask).sum()) / max(n_tok, 1)
        for k, v in (terms.extra or {}).items():  # method-specific figures, e.g. APPO's mean_scale
            out[k] = out.get(k, 0.0) + float(v) * w
    if ranks is None:
        out["traj_kl"] = trajectory_kl_estimate(*(_stack_rows(part) for part in zip(*kl_parts)))
    else:
        out = _sum_over_ranks(out, kl_parts, ranks)
    if abs(out["traj_kl"]) > s.high_kl_threshold:
        optimizer.zero_grad(set_to_none=True)
        if ranks is not None:
            ranks.discard_grads(model)
        return {**out, "finite": True, "grad_norm": 0.0}
    if ranks is not None:
        ranks.reduce_grads(model)
    grad_norm = float(whole(torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)))
    finite = math.isfinite(out["loss"]) and math.isfinite(grad_norm)
    if finite:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {**out, "finite": finite, "grad_norm": grad_norm}


def _sum_over_ranks(
    out: dict[str, float], kl_parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], ranks: Ranks
) -> dict[str, float]:
    """The step's figures summed over ranks, and the trajectory KL of the whole minibatch: the estimate's
    numerator (sum of the units' log-ratio sums) and its count (units with a policy token) are summed over
    ranks before the division, as ``trajectory_kl_estimate`` does over one stack."""
    log_ratio, units = 0.0, 0
    for logp, old_lp, mask in kl_parts:  # (U, P) each
        m = mask.bool()
        log_ratio += float(torch.where(m, (logp - old_lp).to(torch.float64), 0.0).sum())
        units += int(m.any(dim=1).sum())
    ranks.steps += 1
    merged = ranks.sum_stats({**out, "traj_kl": 0.0, "_log_ratio": log_ratio, "_units": float(units)})
    merged["traj_kl"] = -merged.pop("_log_ratio") / max(merged.pop("_units"), 1.0)
    return merged


def _stack_rows(parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """(U_k, P_k) tensors of the micro-batches as one (sum U_k, max P_k), right-padded with zeros (False)."""
    width = max(p.shape[1] for p in parts)
    return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts])


def _loss_terms(params: LossParams, rows: list[TrainRow], mb: list[list[int]]) -> int:
    """Loss terms in a minibatch (token-mean divisor): tokens, or (trajectory, turn) pairs, or trajectories."""
    level = params.ratio_level
    if level == "turn":
        return sum(len({t for i in u for t in rows[i].turn_id}) for u in mb)
    if level == "trajectory":
        return len(mb)
    return sum(len(rows[i].positions) for u in mb for i in u)
