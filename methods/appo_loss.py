"""APPO procedure-level advantage scaling in the loss: the "future_kl" (FIPO) policy loss (docs/algorithms.md §3.7).

Tensors are padded (B, T): B rows of a minibatch, T token positions; ``mask`` is the policy (loss) mask.
Every advantage is reweighted by a factor built from the discounted KL of the *future* tokens of its row:

    Δ_t = clamp(log π_θ − log π_old, −20, 20),  ρ_t = e^{Δ_t},  p_t = 1[Δ_t ≤ log c]
    FutureKL_t = Σ_{k≥t} γ_f^{k−t} p_k m_k Δ_k,  γ_f = 2^{−1/decay_rate}
    f_t = clip(exp(FutureKL_t), lower, 1 + clip_high)   (detached; safety clamp for A<0, ρ>thresh)
    Ã_t = A_t (1 + b f_t),  then asymmetric clip + dual clip with Ã; rows with >1 dual-clipped
    negative token leave the mask.

Distances k − t count response positions, observation (tool) tokens between turns included, as in the
released code, where the sum runs over the whole response: the caller passes each token's position
(``positions``), since its (B, T) tensors hold policy tokens only. Masked entries add nothing to the sum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from methods.aggregation import AGGREGATIONS, LossTerms, aggregate, kl_penalty, masked_mean
from methods.registry import LOSSES

KL_KINDS = ("low_var_kl", "k1", "mse")  # the names methods/losses.py uses


@dataclass(frozen=True)
class FutureKLParams:
    """Defaults of the APPO scripts (§3.7, §3.8)."""

    decay_rate: float = 64.0  # half-life in tokens: γ_f = 2^(−1/decay_rate) (scripts 64, yaml 128)
    weight_b: float = 1.0  # b in Ã = A (1 + b f)
    clip_high: float = 0.2  # f ≤ 1 + clip_high; clip_high ≤ 0 means f = min(exp(FutureKL), 10) (code)
    clip_high_only: bool = True  # lower bound of f: 1.0 if True, else 1 − clip_high
    safety_thresh: float = 6.0  # A < 0 and ρ > safety_thresh: f clamped to [0.8, 1.0]
    clip_ratio_c: float = 3.0  # dual-clip constant c (> 1); also the participation threshold log c
    eps_low: float = 0.2  # ρ clipped to [1 − eps_low, 1 + eps_high]
    eps_high: float = 0.28
    aggregation: str = "token-mean"  # one of methods.aggregation.AGGREGATIONS
    norm_length: int | None = None  # L of "seq-mean-token-sum-norm", as PPOLossParams.norm_length
    kl_coef: float = 0.0  # KL-loss coefficient to a reference policy (APPO scripts: 0.001)
    kl_kind: str = "low_var_kl"  # one of KL_KINDS
    chunk: int = 128  # block length of the blocked suffix scan

    def __post_init__(self) -> None:
        if self.clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c must be > 1 for dual clip, got {self.clip_ratio_c}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"unknown aggregation {self.aggregation!r}; known: {', '.join(AGGREGATIONS)}")
        if self.kl_kind not in KL_KINDS:
            raise ValueError(f"unknown kl_kind {self.kl_kind!r}; known: {', '.join(KL_KINDS)}")
        if self.decay_rate <= 0 or self.chunk < 1 or self.weight_b < 0 or self.kl_coef < 0:
            raise ValueError("decay_rate must be > 0, chunk >= 1, weight_b >= 0 and kl_coef >= 0")
        if self.norm_length is not None and self.norm_length < 1:
            raise ValueError(f"norm_length must be >= 1 (or None), got {self.norm_length}")

    @property
    def ratio_level(self) -> str:
        """One importance ratio per token (§3.7): the loss has no per-turn or per-trajectory variant."""
        return "token"

    @property
    def gamma_f(self) -> float:
        """γ_f = 2^(−1/decay_rate) (≈ 0.98923 for 64)."""
        return 2.0 ** (-1.0 / self.decay_rate)


def discounted_suffix_sum(
    x: torch.Tensor, gamma: float, chunk: int = 128, positions: torch.Tensor | None = None
) -> torch.Tensor:
    """S_t = Σ_{k≥t} γ^{pos_k − pos_t} x_k along the last axis of ``x`` (B, T) → (B, T).

    ``positions`` (B, T), non-decreasing along each row, places entry t at position pos_t of a longer
    sequence (a policy token among all response positions); None means pos_t = t. Distances are clamped
    at 0, so padding after a row's last entry may carry any position as long as its x is 0.

    Blocked scan: inside a block of C entries one (C, C) matmul with D[i, j] = γ^{pos_j − pos_i} (j ≥ i);
    then a loop over the T/C blocks, last to first, adds γ^{pos_next − pos_i} · (S at the next block's
    first entry) to entry i of each block. Every power has a non-negative exponent, so nothing overflows.
    """
    batch, length = x.shape
    if length == 0:
        return x.clone()
    size = min(chunk, length)
    n_blocks = -(-length // size)
    padded = torch.nn.functional.pad(x, (0, n_blocks * size - length))  # (B, nC*C)
    blocks_x = padded.reshape(batch, n_blocks, size)
    if positions is None:  # one (C, C) matrix serves every block
        pos = torch.arange(size, device=x.device, dtype=x.dtype)
        distance = pos.unsqueeze(0) - pos.unsqueeze(1)  # (C, C): j − i
        decay = gamma ** distance.clamp(min=0) * (distance >= 0).to(x.dtype)  # D[i, j]
        local = blocks_x @ decay.t()  # (B, nC, C): sums inside each block
        carry_weights = [gamma ** (size - pos)] * n_blocks  # γ^{C−i}, (C,)
    else:
        last = positions[:, -1:].expand(batch, n_blocks * size - length)
        pos = torch.cat([positions, last], dim=1).to(x.dtype).reshape(batch, n_blocks, size)  # (B, nC, C)
        distance = pos.unsqueeze(-2) - pos.unsqueeze(-1)  # (B, nC, C, C): [i, j] = pos_j − pos_i
        upper = torch.ones(size, size, dtype=torch.bool, device=x.device).triu()
        decay = torch.where(upper, gamma ** distance.clamp(min=0), torch.zeros_like(distance))
        local = (decay @ blocks_x.unsqueeze(-1)).squeeze(-1)  # (B, nC, C)
        carry_weights = [gamma ** (pos[:, b + 1, :1] - pos[:, b]).clamp(min=0) for b in range(n_blocks - 1)] + [None]
    blocks = [local[:, -1]]
    for block in range(n_blocks - 2, -1, -1):  # a loop over T/C blocks, not over T
        blocks.append(local[:, block] + carry_weights[block] * blocks[-1][:, :1])
    return torch.stack(blocks[::-1], dim=1).reshape(batch, n_blocks * size)[:, :length]


def future_kl(
    delta: torch.Tensor, mask: torch.Tensor, params: FutureKLParams, positions: torch.Tensor | None = None
) -> torch.Tensor:
    """FutureKL_t = Σ_{k≥t} γ_f^{pos_k − pos_t} p_k m_k Δ_k with p_k = 1[Δ_k ≤ log c] (§3.7 steps 2–3).

    Args:
        delta: (B, T) clamped log-ratio Δ (0 where the mask is 0).
        mask: (B, T) bool policy mask m.
        params: loss parameters (γ_f, c, block length).
        positions: (B, T) response position of each entry, non-decreasing along a row; None: pos_t = t
            (every response position is an entry).

    Returns:
        (B, T) FutureKL, detached, in at least float32.
    """
    participation = delta <= math.log(params.clip_ratio_c)  # p_t: ratios above c do not accumulate
    kl_tok = torch.where(participation & mask, delta, torch.zeros_like(delta)).detach()  # f is detached
    work = kl_tok.to(torch.promote_types(kl_tok.dtype, torch.float32))  # bf16 powers of γ_f are too coarse
    return discounted_suffix_sum(work, params.gamma_f, params.chunk, positions)


def influence_factor(fkl: torch.Tensor, adv: torch.Tensor, ratio: torch.Tensor, params: FutureKLParams) -> torch.Tensor:
    """f_t = clip(exp(FutureKL_t), lower, 1 + clip_high), detached, with the safety clamp (§3.7 steps 4–5).

    Where A_t < 0 and ρ_t > safety_thresh, f_t is clamped to [0.8, 1.0] (so f = 1 with high-only clipping).
    All arguments and the result are (B, T).
    """
    raw = torch.exp(fkl.detach())
    if params.clip_high > 0:
        lower = 1.0 if params.clip_high_only else 1.0 - params.clip_high
        f = raw.clamp(min=lower, max=1.0 + params.clip_high)
    else:
        f = raw.clamp(max=10.0)  # the released code's branch for future_kl_clip_ratio = 0
    unsafe = (adv < 0) & (ratio.detach() > params.safety_thresh)
    return torch.where(unsafe, f.clamp(min=0.8, max=1.0), f)


def dual_clip_surrogate(
    adv_tilde: torch.Tensor, ratio: torch.Tensor, params: FutureKLParams
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric clip plus dual clip with Ã (§0.2, §3.7 step 7); all (B, T).

    ℓ1 = −Ã ρ, ℓ2 = −Ã clip(ρ, 1 − ε_low, 1 + ε_high), ℓ = max(ℓ1, ℓ2); where Ã < 0, ℓ = min(ℓ, −c Ã).

    Returns:
        loss_tok ℓ, clipped (ℓ2 > ℓ1: the clip binds) and dual_clipped (Ã < 0 and max(ℓ1, ℓ2) > −c Ã).
        With b ≥ 0, sign(Ã) = sign(A), so these match the code's tests on A.
    """
    pg_loss1 = -adv_tilde * ratio
    pg_loss2 = -adv_tilde * ratio.clamp(1.0 - params.eps_low, 1.0 + params.eps_high)
    clip_loss1 = torch.maximum(pg_loss1, pg_loss2)
    pg_loss3 = -adv_tilde * params.clip_ratio_c
    negative = adv_tilde < 0
    loss_tok = torch.where(negative, torch.minimum(pg_loss3, clip_loss1), clip_loss1)
    return loss_tok, pg_loss2 > pg_loss1, negative & (clip_loss1 > pg_loss3)


@LOSSES.register("appo_future_kl", FutureKLParams)
def appo_future_kl_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    turn_id: torch.Tensor | None,
    params: FutureKLParams,
    *,
    ref_logp: torch.Tensor | None = None,
    n_rows_div: float | None = None,
    n_tokens_div: float | None = None,
    positions: torch.Tensor | None = None,
) -> LossTerms:
    """APPO future-KL policy loss (docs/algorithms.md §3.7; ``core_algos.py::compute_policy_loss_future_kl``).

    Args:
        logp: (B, T) log π_θ of the sampled tokens (with grad).
        old_logp: (B, T) log π_old.
        adv: (B, T) token advantages A (already zero off the mask).
        mask: (B, T) policy mask; its False positions may hold any finite or NaN log-prob.
        turn_id: (B, T) unused (kept for the common loss signature).
        params: FutureKLParams.
        ref_logp: (B, T) reference log-probs, required when ``params.kl_coef > 0``.
        n_rows_div, n_tokens_div: minibatch divisors passed to ``aggregate``.
        positions: (B, T) response position of each token (observation tokens between turns counted),
            non-decreasing along a row; None when every response position is a column of the tensors.

    Returns:
        LossTerms; ``extra`` holds mean_scale (mean of 1 + b f over policy tokens), dual_clip_frac and
        rows_dropped (rows with more than one dual-clipped negative token, removed from the mask).
    """
    mask = mask.bool()
    # Off-mask values (NaN log-probs, padding) are zeroed before any arithmetic, so neither the loss nor
    # its gradient (0 · NaN) can see them.
    logp, old_logp, adv = (torch.where(mask, x, 0.0) for x in (logp, old_logp, adv))
    delta = (logp - old_logp).clamp(min=-20.0, max=20.0)  # Δ, (B, T); 0 off the mask
    ratio = torch.exp(delta)  # ρ
    f = influence_factor(future_kl(delta, mask, params, positions), adv, ratio, params)
    scale = 1.0 + params.weight_b * f
    loss_tok, clipped, dual_clipped = dual_clip_surrogate(adv * scale, ratio, params)  # with Ã = A (1 + b f)
    dual_clipped = dual_clipped & mask
    row_ok = dual_clipped.sum(dim=1) <= 1  # (B,): >1 dual-clipped token removes the row
    divisors = (params.aggregation, n_rows_div, n_tokens_div, params.norm_length)
    loss = aggregate(loss_tok, mask & row_ok.unsqueeze(1), *divisors)
    kl_value = 0.0
    if params.kl_coef > 0:
        if ref_logp is None:
            raise ValueError("appo_future_kl: kl_coef > 0 needs ref_logp")
        kl_tok = kl_penalty(logp, torch.where(mask, ref_logp, 0.0), params.kl_kind)
        kl_loss = aggregate(kl_tok, mask, *divisors)
        loss = loss + params.kl_coef * kl_loss
        kl_value = float(kl_loss.detach())
    with torch.no_grad():
        extra = {
            "mean_scale": masked_mean(scale, mask),
            "dual_clip_frac": masked_mean(dual_clipped.to(logp.dtype), mask),
            "rows_dropped": float(((~row_ok) & mask.any(dim=1)).sum()),
        }
        return LossTerms(
            loss=loss,
            clip_frac=masked_mean(clipped.to(logp.dtype), mask),
            approx_kl=masked_mean(-delta, mask),
            ratio_mean=masked_mean(ratio, mask),
            kl_ref=kl_value,
            extra=extra,
        )
