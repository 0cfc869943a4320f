"""Loss aggregation modes (docs/algorithms.md §0.3) and the record every policy loss returns.

Tensors are padded (B, T): B rows of a minibatch (or micro-batch), T token positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


@dataclass
class LossTerms:
    """A policy loss and its detached diagnostics (plain values; the task names the metrics)."""

    loss: torch.Tensor  # () with grad
    clip_frac: float  # share of policy tokens whose ratio was clipped
    approx_kl: float  # mean over policy tokens of (log pi_old - log pi_theta) (k1 estimator)
    ratio_mean: float  # mean ratio over policy tokens
    kl_ref: float = 0.0  # the KL term to the reference policy, aggregated as the loss is (0 for a loss without one)
    extra: dict[str, float] | None = None  # method-specific figures (e.g. APPO scaling factor)


def aggregate(
    loss_tok: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    n_rows_div: float | None = None,
    n_tokens_div: float | None = None,
    max_len_norm: int | None = None,
) -> torch.Tensor:
    """Reduce per-token losses ``loss_tok`` (B, T) over ``mask`` (B, T) to a scalar.

    * ``token-mean``: sum(m*l) / n_tokens_div, where n_tokens_div defaults to sum(m) of this call;
      pass the minibatch's token count when the minibatch is split into micro-batches.
    * ``seq-mean-token-mean``: sum_i (sum_t m*l / sum_t m) / n_rows_div. LOOP passes its fixed
      minibatch size (32) as n_rows_div, so a short last minibatch is down-weighted (docs/algorithms.md §1.5).
      Rows with no policy token contribute 0 and are not counted in the default divisor.
    * ``seq-mean-token-sum``: sum_i sum_t m*l / n_rows_div.
    * ``seq-mean-token-sum-norm`` (Dr.GRPO): sum(m*l) / (n_rows_div * max_len_norm).
    """
    m = mask.to(loss_tok.dtype)
    masked = torch.where(mask, loss_tok, torch.zeros_like(loss_tok))  # inf/NaN at masked positions never leak
    if mode == "token-mean":
        denom = float(n_tokens_div) if n_tokens_div is not None else m.sum().clamp_min(1.0)
        return masked.sum() / denom
    row_tokens = m.sum(dim=1)  # (B,)
    has_tokens = row_tokens > 0
    rows = float(n_rows_div) if n_rows_div is not None else float(has_tokens.sum().clamp_min(1).item())
    if mode == "seq-mean-token-mean":
        per_row = masked.sum(dim=1) / row_tokens.clamp_min(1.0)
        return per_row.sum() / rows
    if mode == "seq-mean-token-sum":
        return masked.sum() / rows
    if mode == "seq-mean-token-sum-norm":
        norm = float(max_len_norm) if max_len_norm is not None else float(loss_tok.shape[1])
        return masked.sum() / (rows * norm)
    raise ValueError(f"unknown loss aggregation {mode!r}; known: {', '.join(AGGREGATIONS)}")


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    """Float mean of ``x`` over the bool ``mask`` (0.0 for an empty mask), for the losses' diagnostics.
    Values off the mask (NaN log-probs, padding) are dropped before the sum, not multiplied by 0, so they
    never turn a diagnostic into NaN; the sum runs in float64 so the figure does not depend on the batch's
    dtype."""
    x = torch.where(mask, x.detach().to(torch.float64), 0.0)
    return float(x.sum() / mask.sum().clamp_min(1))


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate to the reference policy, (B, T) → (B, T) (verl ``kl_penalty``).

    ``low_var_kl`` (k3): r = ref − logp, clamp(e^r − r − 1, −10, 10); ``k1``: logp − ref;
    ``mse`` (k2): ½ (logp − ref)².
    """
    if kind == "k1":
        return logp - ref_logp
    if kind == "mse":
        return 0.5 * (logp - ref_logp).square()
    log_ratio = (ref_logp - logp).clamp(min=-20.0, max=20.0)
    return (torch.exp(log_ratio) - log_ratio - 1.0).clamp(min=-10.0, max=10.0)
