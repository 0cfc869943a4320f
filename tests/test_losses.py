"""PPO clipped policy loss (methods/losses.py; docs/algorithms.md §0.2, §0.3, §1.5, §1.6, §4.1).

Hand-derived expectations with the arithmetic in comments; tolerance 1e-6 absolute unless stated.
Tensors are float64 so the tolerance measures the formulas, not float32 round-off.
"""

from __future__ import annotations

import math

import pytest
import torch

from methods.aggregation import AGGREGATIONS, masked_mean
from methods.losses import PPOLossParams, ppo_clip, trajectory_kl_estimate
from methods.registry import LOSSES

OWN_LOSSES = ("ppo_clip",)
TOL = 1e-6
F64 = torch.float64


def _row_batch(log_ratio, adv, old=-1.0):
    """One row (1, T), every token a policy token in turn 0: logp = old + log_ratio."""
    log_ratio = torch.tensor([log_ratio], dtype=F64)
    old_logp = torch.full_like(log_ratio, old)
    logp = (old_logp + log_ratio).requires_grad_()
    adv = torch.full_like(log_ratio, adv)
    mask = torch.ones_like(log_ratio, dtype=torch.bool)
    return logp, old_logp, adv, mask, torch.zeros_like(log_ratio, dtype=torch.int64)


def _two_rows():
    """(2, 5) batch with turns and a non-policy (environment) token inside row 1.

    row 0: A = +1, turn 0 log-ratios [0.1, 0.1], turn 1 [−0.05], then 2 padding positions
    row 1: A = −0.5, turn 0 [0.0], one environment token, turn 1 [0.02, 0.03], one padding position
    """
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 1, 1, 0]], dtype=torch.bool)
    turn_id = torch.tensor([[0, 0, 1, -1, -1], [0, -1, 1, 1, -1]])
    log_ratio = torch.tensor([[0.1, 0.1, -0.05, 0, 0], [0.0, 0, 0.02, 0.03, 0]], dtype=F64)
    old_logp = torch.full((2, 5), -2.0, dtype=F64)
    logp = (old_logp + log_ratio).requires_grad_()
    adv = torch.tensor([[1.0] * 5, [-0.5] * 5], dtype=F64)
    return logp, old_logp, adv, mask, turn_id


def _random_batch(seed, rows=4, width=9):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(rows, width, generator=g) < 0.7
    mask[:, 0] = True
    turn_of_position = torch.arange(width).div(3, rounding_mode="floor").expand(rows, -1)  # 3 tokens a turn
    turn_id = torch.where(mask, turn_of_position, -1)
    old_logp = -torch.rand(rows, width, generator=g, dtype=F64) * 3
    logp = (old_logp + 0.3 * torch.randn(rows, width, generator=g, dtype=F64)).requires_grad_()
    adv = torch.randn(rows, 1, generator=g, dtype=F64).expand(rows, width).clone()
    ref_logp = old_logp + 0.2 * torch.randn(rows, width, generator=g, dtype=F64)
    return logp, old_logp, adv, mask, turn_id, ref_logp


def test_loop_token_clip_positive_advantage():
    # LOOP ε = 0.1: clip range [1/1.1, 1.1] = [0.909091, 1.1]; A = +1, ratios [0.8, 1.0, 1.2]
    # ℓ = max(−ρA, −clip(ρ)A): 0.8 → max(−0.8, −0.909091) = −0.8;  1.0 → −1;  1.2 → max(−1.2, −1.1) = −1.1
    # seq-mean-token-mean, one row: (−0.8 − 1 − 1.1)/3 = −0.966667; the 1.2 token is clipped (1/3)
    batch = _row_batch([math.log(0.8), 0.0, math.log(1.2)], adv=1.0)
    out = ppo_clip(*batch, PPOLossParams())
    assert out.loss.item() == pytest.approx(-2.9 / 3, abs=TOL)
    assert out.clip_frac == pytest.approx(1 / 3, abs=TOL)
    assert out.ratio_mean == pytest.approx(1.0, abs=TOL)  # (0.8 + 1 + 1.2)/3
    # approx_kl = mean(old − logp) = −(ln 0.8 + ln 1.2)/3 = −(−0.223144 + 0.182322)/3 = 0.013607
    assert out.approx_kl == pytest.approx(0.0136073315, abs=TOL)


def test_loop_token_clip_negative_advantage():
    # A = −1: 0.8 → max(0.8, 0.909091) = 0.909091 (clipped);  1.0 → 1;  1.2 → max(1.2, 1.1) = 1.2
    # mean: (0.909091 + 1 + 1.2)/3 = 1.036364
    batch = _row_batch([math.log(0.8), 0.0, math.log(1.2)], adv=-1.0)
    out = ppo_clip(*batch, PPOLossParams())
    assert out.loss.item() == pytest.approx((1 / 1.1 + 1 + 1.2) / 3, abs=TOL)
    assert out.loss.item() == pytest.approx(1.0363636, abs=TOL)
    assert out.clip_frac == pytest.approx(1 / 3, abs=TOL)


def test_asymmetric_dual_clip_caps_negative_advantage_loss():
    # asymmetric [0.8, 1.2], A = −1, ratios [5, 2]:
    # ratio 5: max(5, 1.2) = 5, dual clip min(5, 3·1) = 3;  ratio 2: max(2, 1.2) = 2 < 3, unchanged
    batch = _row_batch([math.log(5.0), math.log(2.0)], adv=-1.0)
    params = PPOLossParams(clip_mode="asymmetric", eps_low=0.2, eps_high=0.2, dual_clip_c=3.0)
    out = ppo_clip(*batch, params)
    assert out.loss.item() == pytest.approx((3 + 2) / 2, abs=TOL)
    assert out.extra["dual_clip_frac"] == pytest.approx(0.5, abs=TOL)
    assert out.clip_frac == 0.0  # −ρA > −clip(ρ)A on both tokens: the unclipped branch is active
    out.loss.backward()
    # capped token has no gradient; the other: d(−ρA)/dlogp / 2 = ρ·1/2 = 1
    torch.testing.assert_close(batch[0].grad, torch.tensor([[0.0, 1.0]], dtype=F64), rtol=0, atol=TOL)
    without = ppo_clip(*_row_batch([math.log(5.0), math.log(2.0)], adv=-1.0), PPOLossParams(clip_mode="asymmetric"))
    assert without.loss.item() == pytest.approx((5 + 2) / 2, abs=TOL)


# Per-turn terms of _two_rows (LOOP clip range [0.909091, 1.1]):
#   row 0 turn 0: ρ = e^0.2 = 1.221403 > 1.1, A = +1 → ℓ = −1.1 (clipped)
#   row 0 turn 1: ρ = e^−0.05 = 0.951229 inside → ℓ = −0.951229
#   row 1 turn 0: ρ = 1, A = −0.5 → ℓ = 0.5
#   row 1 turn 1: ρ = e^0.05 = 1.051271 inside → ℓ = 0.5 · 1.051271 = 0.525636
TURN_TERMS = [[-1.1, -math.exp(-0.05)], [0.5, 0.5 * math.exp(0.05)]]


def test_per_turn_ratio_seq_mean_token_mean():
    # row means: (−1.1 − 0.951229)/2 = −1.025615;  (0.5 + 0.525636)/2 = 0.512818; over 2 rows: −0.256398
    out = ppo_clip(*_two_rows(), PPOLossParams(ratio_level="turn"))
    expected = (sum(TURN_TERMS[0]) / 2 + sum(TURN_TERMS[1]) / 2) / 2
    assert out.loss.item() == pytest.approx(expected, abs=TOL)
    assert out.loss.item() == pytest.approx(-0.2563985, abs=TOL)
    assert out.clip_frac == pytest.approx(1 / 4, abs=TOL)  # one of four turn terms


def test_per_turn_ratio_token_mean_is_mean_over_turn_terms():
    # (−1.1 − 0.951229 + 0.5 + 0.525636)/4 = −0.256398 (4 terms, not 6 tokens)
    out = ppo_clip(*_two_rows(), PPOLossParams(ratio_level="turn", aggregation="token-mean"))
    assert out.loss.item() == pytest.approx(sum(TURN_TERMS[0] + TURN_TERMS[1]) / 4, abs=TOL)


@pytest.mark.parametrize("aggregation", ["seq-mean-token-mean", "token-mean"])
def test_per_trajectory_ratio(aggregation):
    # row 0: ρ = e^(0.1+0.1−0.05) = e^0.15 = 1.161834 > 1.1, A = +1 → −1.1
    # row 1: ρ = e^0.05 = 1.051271 inside, A = −0.5 → 0.525636; one term per row: (−1.1 + 0.525636)/2
    out = ppo_clip(*_two_rows(), PPOLossParams(ratio_level="trajectory", aggregation=aggregation))
    assert out.loss.item() == pytest.approx((-1.1 + 0.5 * math.exp(0.05)) / 2, abs=TOL)
    assert out.loss.item() == pytest.approx(-0.2871822, abs=TOL)


def test_dr_grpo_sum_norm_divides_by_a_fixed_length_not_the_padded_width():
    """seq-mean-token-sum-norm (Dr.GRPO, docs/algorithms.md §0.3): sum of the token terms / (B · L) with
    the given L, however wide the padded tensor is; without L the width stands in (a direct call)."""
    logp, old_logp, adv, mask, turn_id = _two_rows()
    tokens = ppo_clip(logp, old_logp, adv, mask, turn_id, PPOLossParams(aggregation="seq-mean-token-sum"))
    fixed = PPOLossParams(aggregation="seq-mean-token-sum-norm", norm_length=10)
    out = ppo_clip(logp, old_logp, adv, mask, turn_id, fixed)
    assert out.loss.item() == pytest.approx(tokens.loss.item() / 10, abs=TOL)  # (sum / B) / L
    pad = torch.zeros(logp.shape[0], 5)
    wider = [torch.cat([x, pad.to(x.dtype)], dim=1) for x in (logp, old_logp, adv)]
    wide_mask, wide_turn = torch.cat([mask, pad.bool()], dim=1), torch.cat([turn_id, pad.long() - 1], dim=1)
    assert ppo_clip(*wider, wide_mask, wide_turn, fixed).loss.item() == pytest.approx(out.loss.item(), abs=1e-12)
    width = ppo_clip(logp, old_logp, adv, mask, turn_id, PPOLossParams(aggregation="seq-mean-token-sum-norm"))
    assert width.loss.item() == pytest.approx(tokens.loss.item() / logp.shape[1], abs=TOL)
    with pytest.raises(ValueError, match="norm_length"):
        PPOLossParams(aggregation="seq-mean-token-sum-norm", norm_length=0)


def test_turn_level_with_one_turn_per_row_equals_trajectory_level():
    logp, old_logp, adv, mask, _ = _two_rows()
    one_turn = torch.where(mask, 0, -1)
    turn = ppo_clip(logp, old_logp, adv, mask, one_turn, PPOLossParams(ratio_level="turn"))
    traj = ppo_clip(logp, old_logp, adv, mask, one_turn, PPOLossParams(ratio_level="trajectory"))
    assert turn.loss.item() == pytest.approx(traj.loss.item(), abs=1e-12)


@pytest.mark.parametrize("ratio_level", ["token", "turn", "trajectory"])
def test_fixed_row_divisor_scales_seq_mean_token_mean(ratio_level):
    # LOOP divides by the fixed minibatch size 32 (§1.5): with 2 rows, loss_32 = loss_default · 2/32
    params = PPOLossParams(ratio_level=ratio_level)
    default = ppo_clip(*_two_rows(), params).loss.item()
    fixed = ppo_clip(*_two_rows(), params, n_rows_div=32).loss.item()
    assert fixed == pytest.approx(default * 2 / 32, abs=1e-12)


def test_gradient_at_ratio_one_is_minus_adv_over_tokens_over_rows():
    # ρ ≡ 1 (first minibatch, §1.6): dℓ_t/dlogp_t = −A inside the clip range, so
    # d loss/d logp_{j,t} = −A_j / |O_j| / B; here B = 2 rows with |O_0| = 3, |O_1| = 3
    logp, old_logp, adv, mask, turn_id = _two_rows()
    logp = old_logp.clone().requires_grad_()
    ppo_clip(logp, old_logp, adv, mask, turn_id, PPOLossParams()).loss.backward()
    expected = torch.where(mask, -adv / 3 / 2, 0.0)  # row 0: −1/6; row 1: +0.5/6; 0 off the mask
    torch.testing.assert_close(logp.grad, expected, rtol=0, atol=TOL)
    logp32 = old_logp.clone().requires_grad_()
    ppo_clip(logp32, old_logp, adv, mask, turn_id, PPOLossParams(), n_rows_div=32).loss.backward()
    torch.testing.assert_close(logp32.grad, torch.where(mask, -adv / 3 / 32, 0.0), rtol=0, atol=TOL)


def test_no_clip_is_reinforce():
    # ℓ = −A · log π_θ, token mean: A = 2, logp = [ln 0.5, ln 0.25]
    # −2 · (−0.693147 − 1.386294)/2 = 2.079442; gradient −A/|O| = −1 per token
    logp = torch.tensor([[math.log(0.5), math.log(0.25)]], dtype=F64, requires_grad=True)
    old_logp = torch.zeros_like(logp)  # ratio 4 and 8, ignored without clipping
    adv = torch.full_like(logp, 2.0)
    mask = torch.ones_like(logp, dtype=torch.bool)
    out = ppo_clip(logp, old_logp, adv, mask, torch.zeros_like(mask, dtype=torch.int64), PPOLossParams(clip=False))
    assert out.loss.item() == pytest.approx(2.0794415, abs=TOL)
    assert out.clip_frac == 0.0
    out.loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.0, -1.0]], dtype=F64), rtol=0, atol=TOL)


@pytest.mark.parametrize(
    ("kl_kind", "expected"),
    [
        ("low_var_kl", 0.5 + math.log(2) - 1),  # ref − logp = −ln 2: e^(−ln 2) − (−ln 2) − 1 = 0.193147
        ("k1", math.log(2)),  # logp − ref = ln 2 = 0.693147
        ("mse", 0.5 * math.log(2) ** 2),  # ½ (ln 2)² = 0.240227
    ],
)
def test_kl_to_reference_penalty(kl_kind, expected):
    # A = 0 so the surrogate is 0; loss = kl_coef · KL = 0.1 · expected on every token
    logp, old_logp, _, mask, turn_id = _row_batch([0.0, 0.0], adv=0.0)
    ref_logp = logp.detach() - math.log(2)
    params = PPOLossParams(kl_coef=0.1, kl_kind=kl_kind)
    out = ppo_clip(logp, old_logp, torch.zeros_like(old_logp), mask, turn_id, params, ref_logp=ref_logp)
    assert out.loss.item() == pytest.approx(0.1 * expected, abs=TOL)
    assert out.kl_ref == pytest.approx(expected, abs=TOL)


def test_kl_penalty_without_reference_raises():
    with pytest.raises(ValueError, match="ref_logp"):
        ppo_clip(*_row_batch([0.0], adv=1.0), PPOLossParams(kl_coef=0.1))


def test_trajectory_kl_estimate():
    # rows: Σ log-ratio 0.1 + 0.2 = 0.3 and −0.4; a third row without policy tokens is not counted
    # KL ≈ −(0.3 − 0.4)/2 = 0.05
    old_logp = torch.zeros(3, 2, dtype=F64)
    logp = torch.tensor([[0.1, 0.2], [-0.4, 9.0], [5.0, 5.0]], dtype=F64)
    mask = torch.tensor([[1, 1], [1, 0], [0, 0]], dtype=torch.bool)
    assert trajectory_kl_estimate(logp, old_logp, mask) == pytest.approx(0.05, abs=1e-12)


def _garbage(batch):
    """The same batch with huge finite values at every non-policy position."""
    logp, old_logp, adv, mask, turn_id, ref_logp = batch
    big = torch.tensor(1e4, dtype=F64)
    return (
        torch.where(mask, logp.detach(), big).requires_grad_(),
        torch.where(mask, old_logp, -big),
        torch.where(mask, adv, 1e6),
        mask,
        torch.where(mask, turn_id, 99),
        torch.where(mask, ref_logp, -big),
    )


@pytest.mark.parametrize("clip", [True, False])
@pytest.mark.parametrize("ratio_level", ["token", "turn", "trajectory"])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_masked_positions_do_not_change_loss_or_gradient(aggregation, ratio_level, clip):
    params = PPOLossParams(aggregation=aggregation, ratio_level=ratio_level, clip=clip, kl_coef=0.05, dual_clip_c=3.0)
    clean = _random_batch(0)
    dirty = _garbage(clean)
    out_clean = ppo_clip(*clean[:5], params, ref_logp=clean[5])
    out_dirty = ppo_clip(*dirty[:5], params, ref_logp=dirty[5])
    out_clean.loss.backward()
    out_dirty.loss.backward()
    assert torch.isfinite(out_dirty.loss)
    assert out_dirty.loss.item() == pytest.approx(out_clean.loss.item(), abs=1e-12)
    torch.testing.assert_close(dirty[0].grad, clean[0].grad, rtol=0, atol=1e-12)
    assert torch.all(dirty[0].grad[~dirty[3]] == 0)
    for name in ("clip_frac", "approx_kl", "ratio_mean"):
        assert getattr(out_dirty, name) == pytest.approx(getattr(out_clean, name), abs=1e-12)


@pytest.mark.parametrize("name", OWN_LOSSES)
def test_every_registered_loss_runs_on_a_random_batch(name):
    entry = LOSSES.get(name)
    logp, old_logp, adv, mask, turn_id, _ = _random_batch(1)
    out = entry.fn(logp, old_logp, adv, mask, turn_id, entry.params_cls())
    assert out.loss.shape == () and torch.isfinite(out.loss)
    out.loss.backward()
    assert logp.grad.shape == logp.shape and torch.all(torch.isfinite(logp.grad))
    assert 0.0 <= out.clip_frac <= 1.0 and set(out.extra) == {"dual_clip_frac"}
    with pytest.raises(ValueError):
        entry.fn(logp, old_logp[:, :-1], adv, mask, turn_id, entry.params_cls())


@pytest.mark.parametrize(
    "bad",
    [
        {"clip_mode": "sym"},
        {"ratio_level": "step"},
        {"aggregation": "mean"},
        {"kl_kind": "k9"},
        {"dual_clip_c": 1.0},
        {"kl_coef": -1.0},
    ],
)
def test_params_are_validated(bad):
    with pytest.raises(ValueError):
        PPOLossParams(**bad)


def test_masked_mean_drops_off_mask_values_and_is_zero_when_empty():
    """Both losses' diagnostics go through this one mean: a NaN or inf off the mask must not reach it."""
    x = torch.tensor([[1.0, float("nan"), 2.0], [float("inf"), 4.0, 0.5]])
    mask = torch.tensor([[True, False, True], [False, True, False]])
    assert masked_mean(x, mask) == pytest.approx((1.0 + 2.0 + 4.0) / 3, abs=TOL)
    assert masked_mean(x, torch.zeros_like(mask)) == 0.0
