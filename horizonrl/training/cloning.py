"""Behaviour cloning (the warm start): cross-entropy on a demonstration's action tokens only.

The sequences are the PPO update's (``sequences.train_rows``) and so are the log-probs
(``trainer.policy_logprobs``: gathered at policy positions, renormalised over the allowed ids in admissible
mode), so the observations are masked out and the cloned distribution is the one the policy samples from.
The loss of a minibatch is the mean over its policy tokens of -log pi(a_t | s_t).
"""

from __future__ import annotations

import torch

from horizonrl.training.sequences import TrainRow
from horizonrl.training.trainer import policy_logprobs


def clone_epoch(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    rows: list[TrainRow],
    minibatch_size: int,
    grad_clip: float,
    pad_id: int,
    seed: int,
) -> list[float]:
    """One shuffled pass over ``rows`` (rows without a policy token are skipped), one clipped AdamW step
    per ``minibatch_size`` rows; returns each step's loss."""
    rows = [r for r in rows if r.positions]
    perm = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
    losses = []
    model.train()
    for start in range(0, len(perm), minibatch_size):
        batch = [rows[k] for k in perm[start : start + minibatch_size]]
        logp, _ = policy_logprobs(model, batch, 1.0, pad_id)  # (n,) over the batch's policy tokens
        loss = -logp.mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses
