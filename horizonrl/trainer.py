"""The PPO update over stored rollouts (ALGORITHMS.md 1.6): recompute pi_old with the training model,
then epochs of shuffled minibatches, one AdamW step each, with grad-norm clipping, the trajectory-level
KL early stop, and non-finite steps skipped and counted.

Log-probs are computed only at policy positions: the decoder's hidden states are gathered there before
the output head, and in admissible mode renormalised over the allowed ids, exactly as sampled.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

import methods
from horizonrl.sequences import TrainRow


@dataclass(frozen=True)
class UpdateSettings:
    loss_name: str
    loss_params: object
    epochs: int
    minibatch_size: int
    fixed_row_divisor: bool  # LOOP: divide by minibatch_size even for a short last minibatch
    grad_clip: float
    high_kl_threshold: float
    temperature: float
    micro_batch_tokens: int
    pad_id: int


@dataclass
class UpdateResult:
    stats: dict[str, float] = field(default_factory=dict)
    nonfinite_steps: int = 0


def _pad_policy(values: list[list[float]], dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad per-row policy-token lists to (b, P); returns values and the mask."""
    P = max(len(v) for v in values)
    out = torch.zeros((len(values), P), dtype=dtype)
    mask = torch.zeros((len(values), P), dtype=torch.bool)
    for i, v in enumerate(values):
        out[i, : len(v)] = torch.tensor(v, dtype=dtype)
        mask[i, : len(v)] = True
    return out, mask


def policy_logprobs(model: torch.nn.Module, rows: list[TrainRow], temperature: float, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi(a_t | s_t) and the entropy of pi(. | s_t) at every policy token: two (b, P) tensors."""
    L = max(len(r.input_ids) for r in rows)
    ids = torch.full((len(rows), L), pad_id, dtype=torch.long)
    attn = torch.zeros((len(rows), L), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r.input_ids)] = torch.tensor(r.input_ids)
        attn[i, : len(r.input_ids)] = 1
    hidden = model.get_decoder()(input_ids=ids, attention_mask=attn).last_hidden_state  # (b, L, H)
    b_idx = torch.tensor([i for i, r in enumerate(rows) for _ in r.positions])
    p_idx = torch.tensor([p for r in rows for p in r.positions])
    logits = model.get_output_embeddings()(hidden[b_idx, p_idx - 1]).float() / temperature  # (n, V)
    allowed = [a for r in rows for a in r.allowed]
    if any(allowed):
        bias = torch.zeros_like(logits)
        for j, ids_j in enumerate(allowed):
            if ids_j:
                bias[j].fill_(float("-inf"))
                bias[j, ids_j] = 0.0
        logits = logits + bias
    logp_all = torch.log_softmax(logits, dim=-1)  # (n, V)
    target = ids[b_idx, p_idx]
    logp = logp_all.gather(1, target[:, None]).squeeze(1)  # (n,)
    entropy = -(logp_all.exp() * logp_all.masked_fill(torch.isinf(logp_all), 0.0)).sum(-1)  # (n,)
    P = max(len(r.positions) for r in rows)
    col = torch.tensor([j for r in rows for j in range(len(r.positions))])
    out_lp = torch.zeros((len(rows), P), dtype=logp.dtype).index_put((b_idx, col), logp)
    out_h = torch.zeros((len(rows), P), dtype=entropy.dtype).index_put((b_idx, col), entropy.detach())
    return out_lp, out_h


def micro_batches(rows: list[int], lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Group row indices, sorted by length, into batches of at most ``max_tokens`` padded tokens."""
    order = sorted(rows, key=lambda i: lengths[i])
    batches, cur, cur_max = [], [], 0
    for i in order:
        new_max = max(cur_max, lengths[i])
        if cur and new_max * (len(cur) + 1) > max_tokens:
            batches.append(cur)
            cur, new_max = [], lengths[i]
        cur.append(i)
        cur_max = new_max
    if cur:
        batches.append(cur)
    return batches


@torch.no_grad()
def recompute_old_logprobs(model: torch.nn.Module, rows: list[TrainRow], s: UpdateSettings) -> list[list[float]]:
    """pi_old with the training model, removing sampler/learner mismatch (ALGORITHMS.md 1.6)."""
    model.eval()
    lengths = [len(r.input_ids) for r in rows]
    old: list[list[float]] = [[] for _ in rows]
    for mb in micro_batches(list(range(len(rows))), lengths, s.micro_batch_tokens):
        lp, _ = policy_logprobs(model, [rows[i] for i in mb], s.temperature, s.pad_id)
        for k, i in enumerate(mb):
            old[i] = lp[k, : len(rows[i].positions)].tolist()
    model.train()
    return old


def ppo_update(model: torch.nn.Module, optimizer: torch.optim.Optimizer, rows: list[TrainRow], s: UpdateSettings, seed: int) -> UpdateResult:
    """Epochs of minibatch PPO over ``rows``; pi_old is frozen for the whole call."""
    loss_fn = methods.LOSSES.get(s.loss_name).fn
    old = recompute_old_logprobs(model, rows, s)
    gen = torch.Generator().manual_seed(seed)
    lengths = [len(r.input_ids) for r in rows]
    agg: dict[str, list[float]] = {k: [] for k in ("loss", "clip_frac", "approx_kl", "entropy", "grad_norm", "ratio_mean", "traj_kl")}
    result, tokens, steps, stopped, t0 = UpdateResult(), 0, 0, False, time.perf_counter()
    model.train()
    for _ in range(s.epochs):
        perm = torch.randperm(len(rows), generator=gen).tolist()
        for start in range(0, len(perm), s.minibatch_size):
            mb = perm[start : start + s.minibatch_size]
            n_tok = _loss_terms(s.loss_params, [rows[i] for i in mb])
            row_div = s.minibatch_size if s.fixed_row_divisor else len(mb)
            optimizer.zero_grad(set_to_none=True)
            loss_sum, kl_sum, parts = 0.0, 0.0, []
            for micro in micro_batches(mb, lengths, s.micro_batch_tokens):
                batch = [rows[i] for i in micro]
                logp, ent = policy_logprobs(model, batch, s.temperature, s.pad_id)
                old_lp, mask = _pad_policy([old[i] for i in micro])
                adv, _ = _pad_policy([r.adv for r in batch])
                turn_id, _ = _pad_policy([r.turn_id for r in batch], dtype=torch.long)
                terms = loss_fn(logp, old_lp, adv, mask, turn_id.masked_fill(~mask, -1), s.loss_params, n_rows_div=row_div, n_tokens_div=n_tok)
                terms.loss.backward()
                loss_sum += float(terms.loss)
                kl_sum += float(((logp.detach() - old_lp) * mask).sum())
                tokens += sum(lengths[i] for i in micro)
                parts.append((terms, float(mask.sum()), float((ent * mask).sum())))
            traj_kl = -kl_sum / len(mb)
            if abs(traj_kl) > s.high_kl_threshold:
                stopped = True
                break
            grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip))
            if not (math.isfinite(loss_sum) and math.isfinite(grad_norm)):
                result.nonfinite_steps += 1
                optimizer.zero_grad(set_to_none=True)
                continue
            optimizer.step()
            steps += 1
            _record(agg, parts, loss_sum, grad_norm, traj_kl)
        if stopped:
            break
    elapsed = time.perf_counter() - t0
    result.stats = {k: float(sum(v) / len(v)) if v else 0.0 for k, v in agg.items()}
    result.stats.update(steps=steps, kl_stop=float(stopped), nonfinite_steps=result.nonfinite_steps, rows=len(rows),
                        policy_tokens=sum(len(r.positions) for r in rows), tokens_per_s=tokens / max(elapsed, 1e-9), seconds=elapsed)
    return result


def _loss_terms(params: object, rows: list[TrainRow]) -> int:
    """How many loss terms a minibatch has: tokens, or (row, turn) pairs / rows for per-turn / per-trajectory ratios."""
    level = getattr(params, "ratio_level", "token")
    if level == "turn":
        return sum(len(set(r.turn_id)) for r in rows)
    if level == "trajectory":
        return len(rows)
    return sum(len(r.positions) for r in rows)


def _record(agg: dict[str, list[float]], parts: list, loss: float, grad_norm: float, traj_kl: float) -> None:
    n = sum(p[1] for p in parts) or 1.0
    agg["loss"].append(loss)
    agg["grad_norm"].append(grad_norm)
    agg["traj_kl"].append(traj_kl)
    agg["clip_frac"].append(sum(p[0].clip_frac * p[1] for p in parts) / n)
    agg["approx_kl"].append(sum(p[0].approx_kl * p[1] for p in parts) / n)
    agg["ratio_mean"].append(sum(p[0].ratio_mean * p[1] for p in parts) / n)
    agg["entropy"].append(sum(p[2] for p in parts) / n)
