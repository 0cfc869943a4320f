"""APPO branch planning over collected initial rollouts (ALGORITHMS.md 3.2-3.3, 6.4).

For every initial rollout the branching score is computed over its policy tokens, from the entropies the
engine recorded. Omega compares the current policy with the sampling policy; here the sampler *is* the
current policy (one model, no update in between), so Omega is constant by construction and the
documented fallback (BS = Z(H) where Z(H) > 0, ALGORITHMS.md 6.4) applies; ``omega_fallback_fraction``
reports how often it did. Split points are never the last token of a turn's action, so a branch always
has something left to generate.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from horizonrl.rollout import BranchStart, EpisodeRecord
from methods.appo import BranchingParams, branching_score, select_branch_points


def _policy_tokens(ep: EpisodeRecord, tokenizer) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(flat index, entropy, sampling log-prob, is_candidate) over the rollout's policy tokens."""
    flat, ent, logp, cand, offset = [], [], [], [], 0
    for t in ep.turns:
        g = t.gen
        for j, is_policy in enumerate(g.policy_mask):
            if is_policy:
                flat.append(offset + j)
                ent.append(g.entropy[j])
                logp.append(g.logprobs[j])
                last = j == len(g.token_ids) - 1
                cand.append(not last and bool(tokenizer.decode([g.token_ids[j]]).strip()))
        offset += len(g.token_ids)
    return np.asarray(flat, dtype=np.int64), np.asarray(ent), np.asarray(logp), np.asarray(cand, dtype=bool)


def plan_branches(initial: list[EpisodeRecord], budget: int, params: BranchingParams, tokenizer) -> tuple[list[BranchStart], list[float], dict[str, float]]:
    """Branch starts for every task group (``budget`` per group), their scores, and planning figures."""
    groups: dict[int, list[EpisodeRecord]] = defaultdict(list)
    for ep in initial:
        groups[ep.group_id].append(ep)
    starts, scores = [], []
    counts = {"strict": 0, "fallback": 0, "cyclic": 0, "dropped": 0}
    fallbacks = 0
    for gid in sorted(groups):
        eps = groups[gid]
        tokens = [_policy_tokens(ep, tokenizer) for ep in eps]
        # sampler == scorer here, so logp_cur = logp_roll: Omega is exactly constant (see module docstring)
        bs = [branching_score(ent, logp, logp, params) for _, ent, logp, _ in tokens]
        fallbacks += sum(b.omega_fallback for b in bs)
        selection = select_branch_points(bs, [c for *_, c in tokens], budget)
        for key, n in selection.counts.items():
            counts[key] += n
        for p in selection.points:
            starts.append(BranchStart(eps[p.rollout], int(tokens[p.rollout][0][p.split]), float(p.score)))
            scores.append(p.score)
    n_groups = max(len(groups), 1)
    stats = {f"branch_{k}": v / n_groups for k, v in counts.items()}
    stats.update(branches_per_group=len(starts) / n_groups, omega_fallback_fraction=fallbacks / max(len(initial), 1),
                 mean_branching_score=float(np.mean(scores)) if scores else 0.0)
    return starts, scores, stats
