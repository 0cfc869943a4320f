"""Behaviour cloning (the warm start): cross-entropy on a demonstration's action tokens only.

The sequences are the PPO update's (``sequences.train_rows``) and so are the log-probs
(``trainer.policy_logprobs``: gathered at policy positions, renormalised over the allowed ids in admissible
mode), so the observations are masked out and the cloned distribution is the one the policy samples from.
The loss of a minibatch is the mean over its policy tokens of -log pi(a_t | s_t). A minibatch's forward and
backward passes go in micro-batches of about ``micro_batch_tokens`` tokens (``update.micro_batch_tokens``), as
in the update: a real model's activations over a minibatch of whole trajectories would not fit in memory.
"""

from __future__ import annotations

import torch

from horizonrl.training.sequences import TrainRow
from horizonrl.training.trainer import _chunks, policy_logprobs


def clone_epoch(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    rows: list[TrainRow],
    minibatch_size: int,
    grad_clip: float,
    pad_id: int,
    seed: int,
    micro_batch_tokens: int = 16_384,
) -> list[float]:
    """One shuffled pass over ``rows`` (rows without a policy token are skipped), one clipped AdamW step
    per ``minibatch_size`` rows, its gradient accumulated over micro-batches of about ``micro_batch_tokens``
    tokens (the same mean up to float summation order); returns each step's loss."""
    rows = [r for r in rows if r.positions]
    perm = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
    losses = []
    model.train()
    for start in range(0, len(perm), minibatch_size):
        batch = [rows[k] for k in perm[start : start + minibatch_size]]
        n_tokens = sum(len(r.positions) for r in batch)
        optimizer.zero_grad(set_to_none=True)
        loss = 0.0
        for micro in _chunks([[i] for i in range(len(batch))], batch, micro_batch_tokens):
            logp, _ = policy_logprobs(model, [batch[u[0]] for u in micro], 1.0, pad_id)  # (n,) policy tokens
            part = -logp.sum() / n_tokens
            part.backward()
            loss += float(part.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        losses.append(loss)
    return losses
