"""PPO clipped policy losses over padded token tensors, registered in ``LOSSES``.

docs/algorithms.md §0.2 (clipped surrogate and dual clip), §0.3 (aggregation modes), §1.5 (LOOP per-token,
per-turn and per-trajectory ratios; no-clip REINFORCE), §1.6 (trajectory KL early stop) and §4.1 (verl
KL loss to a reference).

Shapes: B rows of a (micro-)batch, T token positions, S segments per row (turns, or 1 per row).
Every input is (B, T). Values at positions where ``mask`` is False never reach the loss, its gradient or
the diagnostics: they are replaced by 0 before any arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from methods.aggregation import AGGREGATIONS, LossTerms, aggregate, kl_penalty, masked_mean
from methods.registry import LOSSES

LOG_RATIO_CLAMP = 20.0  # |log ρ| bound before exp


@dataclass(frozen=True)
class PPOLossParams:
    """Clipped-surrogate settings (docs/algorithms.md §0.2, §1.5, §4.1). Defaults are LOOP's (§1.7)."""

    clip_mode: Literal["loop", "asymmetric"] = "loop"  # [1/(1+eps), 1+eps] or [1−eps_low, 1+eps_high]
    eps: float = 0.1  # LOOP ε (``ppo_epsilon``)
    eps_low: float = 0.2  # verl ε_low (asymmetric mode)
    eps_high: float = 0.2  # verl ε_high (asymmetric mode)
    dual_clip_c: float | None = None  # verl uses 3.0: when A < 0, ℓ = min(ℓ, −c·A); None turns it off
    ratio_level: Literal["token", "turn", "trajectory"] = "token"  # one ratio per token, turn or row
    clip: bool = True  # False: REINFORCE-style ℓ = −A·log π_θ (no ratio)
    aggregation: str = "seq-mean-token-mean"  # one of methods.aggregation.AGGREGATIONS
    # L of "seq-mean-token-sum-norm" (Dr.GRPO): a fixed token count; None: the width of the tensor given.
    # A run fixes it to the most policy tokens a trajectory can hold (docs/algorithms.md §0.3).
    norm_length: int | None = None
    kl_coef: float = 0.0  # weight of the KL-to-reference penalty (needs ``ref_logp``)
    kl_kind: Literal["low_var_kl", "k1", "mse"] = "low_var_kl"  # per-token KL estimator

    def __post_init__(self) -> None:
        checks = {
            "clip_mode": self.clip_mode in ("loop", "asymmetric"),
            "ratio_level": self.ratio_level in ("token", "turn", "trajectory"),
            "aggregation": self.aggregation in AGGREGATIONS,
            "kl_kind": self.kl_kind in ("low_var_kl", "k1", "mse"),
            "dual_clip_c": self.dual_clip_c is None or self.dual_clip_c > 1.0,
            "kl_coef": self.kl_coef >= 0.0,
            "norm_length": self.norm_length is None or self.norm_length >= 1,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"PPOLossParams.{name} is invalid: {getattr(self, name)!r}")


def _clip_range(params: PPOLossParams) -> tuple[float, float]:
    """(lo, hi) of clip(ρ, lo, hi): LOOP's log-symmetric range or verl's asymmetric one (§0.2)."""
    if params.clip_mode == "loop":
        return 1.0 / (1.0 + params.eps), 1.0 + params.eps
    return 1.0 - params.eps_low, 1.0 + params.eps_high


def _segment_index(mask: torch.Tensor, turn_id: torch.Tensor, ratio_level: str) -> tuple[torch.Tensor, int]:
    """Segment of each token, (B, T) in [0, S], where S marks non-policy tokens; and S."""
    if ratio_level == "trajectory":
        return torch.where(mask, 0, 1), 1
    turns = turn_id[mask]
    if turns.numel() and int(turns.min()) < 0:
        raise ValueError("turn_id must be >= 0 on every policy token for ratio_level='turn'")
    n_seg = int(turns.max()) + 1 if turns.numel() else 1
    return torch.where(mask, turn_id, n_seg), n_seg


def _segment_sum(x: torch.Tensor, seg: torch.Tensor, n_seg: int) -> torch.Tensor:
    """Σ_t x over each (row, segment): x (B, T), seg (B, T) in [0, S] -> (B, S). No loop over rows."""
    n_rows = x.shape[0]
    row_base = torch.arange(n_rows, device=x.device).unsqueeze(1) * (n_seg + 1)  # (B, 1)
    flat = (row_base + seg).reshape(-1)  # (B*T,)
    sums = x.new_zeros(n_rows * (n_seg + 1)).index_add(0, flat, x.reshape(-1))
    return sums.view(n_rows, n_seg + 1)[:, :n_seg]


def _loss_terms(
    tok: dict[str, torch.Tensor], mask: torch.Tensor, turn_id: torch.Tensor, ratio_level: str
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Map per-token inputs (B, T) to one entry per loss term and the terms' mask.

    Token level: terms are the policy tokens. Turn / trajectory level (§1.5): one term per (row, turn) or
    per row, holding the SUM of the log-ratios and the MEAN of the other inputs over its tokens.
    """
    if ratio_level == "token":
        return tok, mask
    seg, n_seg = _segment_index(mask, turn_id, ratio_level)
    count = _segment_sum(mask.to(tok["log_ratio"].dtype), seg, n_seg)  # (B, S) tokens per term
    terms = {"log_ratio": _segment_sum(tok["log_ratio"], seg, n_seg)}
    for name in ("adv", "logp", "kl"):
        if name in tok:
            terms[name] = _segment_sum(tok[name], seg, n_seg) / count.clamp_min(1.0)
    return terms, count > 0


def _surrogate(terms: dict[str, torch.Tensor], params: PPOLossParams) -> dict[str, torch.Tensor]:
    """ℓ = −min(ρA, clip(ρ, lo, hi)A), optional dual clip ℓ = min(ℓ, −cA) for A < 0 (§0.2)."""
    adv = terms["adv"]
    ratio = torch.exp(terms["log_ratio"].clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    no_flag = torch.zeros_like(adv, dtype=torch.bool)
    if not params.clip:  # REINFORCE-style, §1.5: ℓ = −A · log π_θ (mean over the term's tokens)
        return {"loss": -adv * terms["logp"], "ratio": ratio, "clipped": no_flag, "dual": no_flag}
    lo, hi = _clip_range(params)
    pg_loss1 = -adv * ratio
    pg_loss2 = -adv * ratio.clamp(lo, hi)
    loss = torch.maximum(pg_loss1, pg_loss2)
    clipped = pg_loss2 > pg_loss1  # the clipped branch is active (verl's pg_clipfrac)
    dual = no_flag
    if params.dual_clip_c is not None:
        pg_loss3 = -adv * params.dual_clip_c
        dual = (adv < 0) & (pg_loss3 < loss)
        loss = torch.where(dual, pg_loss3, loss)
    return {"loss": loss, "ratio": ratio, "clipped": clipped, "dual": dual}


@LOSSES.register("ppo_clip", PPOLossParams)
def ppo_clip(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    turn_id: torch.Tensor,
    params: PPOLossParams,
    *,
    ref_logp: torch.Tensor | None = None,
    n_rows_div: float | None = None,
    n_tokens_div: float | None = None,
    positions: torch.Tensor | None = None,
) -> LossTerms:
    """Clipped PPO surrogate ℓ = −min(ρA, clip(ρ, lo, hi)A) + kl_coef·KL, aggregated (§0.2, §0.3, §1.5).

    ``ratio_level`` picks what one loss term is. "token": ρ_t = exp(log π_θ − log π_old) per policy token.
    "turn" (LOOP's per-turn variant, an assumption of §1.5): ρ = exp(Σ_{t∈turn}(log π_θ − log π_old)),
    one term per (row, turn) with A the mean of ``adv`` over the turn's tokens. "trajectory": one term per
    row, ρ = exp(Σ over all its policy tokens). A log-ratio is clamped to [−20, 20] before exp.

    Aggregation (``methods.aggregation.aggregate``) runs over the terms: "seq-mean-token-mean" is the mean
    of a row's terms, summed over rows and divided by ``n_rows_div`` (default: rows with a term);
    "token-mean" is the sum of all terms over ``n_tokens_div`` (default: the number of terms). So at
    turn / trajectory level ``n_tokens_div`` counts turns / rows of the minibatch, not tokens. The
    "seq-mean-token-sum(-norm)" modes likewise sum terms (the norm uses the term grid's width, T or S). With
    ``clip=False`` a term is −A·mean_{t∈term} log π_θ. The KL penalty enters each term as the mean
    per-token KL over its tokens, so it shares the aggregation and divisors.

    Args:
        logp: (B, T) float, log π_θ of each token, with grad.
        old_logp: (B, T) float, log π_old.
        adv: (B, T) float, advantage already broadcast to tokens.
        mask: (B, T) bool, policy tokens.
        turn_id: (B, T) int64, turn index of each token, −1 where ``mask`` is False.
        params: see ``PPOLossParams``.
        ref_logp: (B, T) float, log π_ref; required when ``params.kl_coef > 0``.
        n_rows_div: fixed row divisor (LOOP's minibatch size 32, §1.5).
        n_tokens_div: fixed term divisor for "token-mean" across micro-batches.
        positions: (B, T) response positions of the tokens; unused here (the common loss signature).

    Returns:
        ``LossTerms``: loss () with grad; clip_frac, ratio_mean and extra["dual_clip_frac"] over the
        terms; approx_kl = mean over policy tokens of (log π_old − log π_θ); ``kl_ref`` the
        aggregated KL to the reference (0.0 without ``ref_logp``).
    """
    _check_inputs(logp, old_logp, adv, mask, turn_id, ref_logp, params)
    mask = mask.bool()
    dtype = torch.promote_types(logp.dtype, torch.float32)
    logp_m = torch.where(mask, logp.to(dtype), 0.0)
    tok = {
        "log_ratio": logp_m - torch.where(mask, old_logp.to(dtype), 0.0),
        "adv": torch.where(mask, adv.to(dtype), 0.0),
        "logp": logp_m,
    }
    if ref_logp is not None:
        ref_m = torch.where(mask, ref_logp.to(dtype), 0.0)
        tok["kl"] = torch.where(mask, kl_penalty(logp_m, ref_m, params.kl_kind), 0.0)
    terms, term_mask = _loss_terms(tok, mask, turn_id, params.ratio_level)
    out = _surrogate(terms, params)
    term_loss = out["loss"] + params.kl_coef * terms["kl"] if "kl" in terms else out["loss"]
    divisors = (params.aggregation, n_rows_div, n_tokens_div, params.norm_length)
    loss = aggregate(torch.where(term_mask, term_loss, 0.0), term_mask, *divisors)
    kl_ref = float(aggregate(terms["kl"].detach(), term_mask, *divisors)) if "kl" in terms else 0.0
    return LossTerms(
        loss=loss,
        clip_frac=masked_mean(out["clipped"].to(dtype), term_mask),
        approx_kl=masked_mean(-tok["log_ratio"], mask),
        ratio_mean=masked_mean(out["ratio"], term_mask),
        kl_ref=kl_ref,
        extra={"dual_clip_frac": masked_mean(out["dual"].to(dtype), term_mask)},
    )


def _check_inputs(logp, old_logp, adv, mask, turn_id, ref_logp, params: PPOLossParams) -> None:
    """Raise ``ValueError`` on shape mismatch, a non-bool mask, or a KL penalty without reference."""
    tensors = {"old_logp": old_logp, "adv": adv, "mask": mask, "turn_id": turn_id}
    if ref_logp is not None:
        tensors["ref_logp"] = ref_logp
    if logp.dim() != 2:
        raise ValueError(f"logp must be (B, T), got shape {tuple(logp.shape)}")
    for name, x in tensors.items():
        if x.shape != logp.shape:
            raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {tuple(logp.shape)} like logp")
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be bool, got {mask.dtype}")
    if params.kl_coef > 0 and ref_logp is None:
        raise ValueError("PPOLossParams.kl_coef > 0 needs ref_logp")


def trajectory_kl_estimate(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> float:
    """KL ≈ −mean_j Σ_{t∈O_j}(log π_θ − log π_old), LOOP's early-stop statistic (docs/algorithms.md §1.6).

    Args:
        logp: (B, T) float, log π_θ.
        old_logp: (B, T) float, log π_old.
        mask: (B, T) bool, policy tokens.

    Returns:
        The estimate as a float; the mean runs over rows with at least one policy token (0.0 if none).
    """
    with torch.no_grad():
        mask = mask.bool()
        log_ratio = torch.where(mask, (logp - old_logp).to(torch.float64), 0.0)  # (B, T)
        has_tokens = mask.any(dim=1)  # (B,)
        return float(-log_ratio.sum(dim=1).sum() / has_tokens.sum().clamp_min(1))
