"""BLPO: Beyond-Local Policy Optimization (arXiv 2611.03005, ``Tdadada/BLPO``; docs/algorithms.md §2, §7.3).

Per step row n (one scalar; the caller broadcasts it over the row's action tokens):

    A_n = A^E_n + w_step * micro_n,   micro_n = sum over active layers l of p_l / (sum p) * A^l_n

with the episode term A^E (2.5), the action-balanced Exact term A^X (2.6) and the memory-based
Progress (Role) term A^P (2.7, state: ``BLPOMemory``). Defaults are the ALFWorld column of 2.10.

Invalid-action penalty (verl-agent, 2.10): ``invalid_penalty`` p is subtracted from the score and
from the step reward of every row whose action is not ``valid``:
score_n = R_n - p (1 - valid_n), and G is built from r'_n = r_n - p (1 - valid_n).

Not implemented (optional, non-default, 2.9): the raw role estimator, the stage layer and the
first-visit fallbacks (``all_fail_first_visit``, ``progress_first_visit_backoff``).

Choices where the released code differs: reads never rewrite the memory (it decays read records in
place: the same values up to rounding); ``mode="mean_norm"`` gives A^P = c_a whatever
``role_confidence`` says (the code rejects that pair); an all-tied Exact group is inactive with
``exact_action_balance=False`` (7.3); an ``update_index`` below the memory's raises; contexts are
hashed with blake2b-128 of ``str(context_id)``, so memory files are not interchangeable with its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from methods.blpo_memory import BLPOMemory, KeyCodes, ProgressRead, children_by_key, read_progress_keys
from methods.registry import ADVANTAGES
from methods.stepwise import (
    MODES,
    StepKeys,
    center_active,
    combine_codes,
    discounted_returns,
    distinct,
    group_first,
    group_moments,
    group_standardize,
    pair_codes,
    penalized_score_and_reward,
    require_finite,
    step_keys,
    trajectory_starts,
)
from methods.types import AdvantageResult, StepBatch

ROLE_APPLICATIONS = ("parallel", "local_residual")
LAYERS = (("exact",), ("exact", "role"))  # the Exact layer is always on; "stage" (2.9) is not implemented


@dataclass(frozen=True)
class BLPOParams:
    """BLPO settings; defaults are ALFWorld's (docs/algorithms.md §2.10; WebShop sets role_current_batch_center)."""

    gamma: float = 0.95  # discount of the step returns G_n (2.2)
    mode: str = "mean_std_norm"  # or "mean_norm" (no std division anywhere; A^P = c_a)
    layers: tuple[str, ...] = ("exact", "role")  # ("exact",) switches the progress layer and memory off
    exact_prior: float = 1.0  # p_exact (2.8)
    role_prior: float = 0.5  # p_role (2.8)
    half_life: float = 8.0  # h, memory half-life in policy updates (2.7 (d))
    exact_action_balance: bool = True  # A^X per canonical action (2.6); False: GiGPO's per-row step term
    role_residual_center: bool = True  # effects are delta = G - mean_E G (True) or G (2.7 (a))
    role_child_balance: bool = True  # one effect per (role, action, E, context) bucket (2.7 (c))
    role_read_before_write: bool = False  # False: write this batch, then read (2.7 (e))
    role_confidence: bool = True  # reliability-weighted A^P (2.7 (g))
    tau: float = 0.05  # tau, floor inside the A^P denominator
    support_scale: float = 4.0  # c in kappa = n_cmp / (n_cmp + c)
    std_floor: float = 0.0  # A^P = c_a / max(s, std_floor, eps) when role_confidence is off
    role_current_batch_center: bool = False  # centre active A^P within each role (2.7 (h))
    role_application: str = "parallel"  # "parallel" fusion (2.8) or "local_residual"
    beta: float = 0.5  # weight of the role scores in "local_residual"
    step_advantage_w: float = 1.0  # w_step
    eps: float = 1e-6
    invalid_penalty: float = 0.1  # p, subtracted from score and step reward of invalid actions

    def __post_init__(self) -> None:
        rules = (
            (self.mode in MODES, f"mode must be one of {MODES}"),
            (self.role_application in ROLE_APPLICATIONS, f"role_application must be one of {ROLE_APPLICATIONS}"),
            (tuple(self.layers) in LAYERS, f"layers must be one of {LAYERS}"),
            (self.role_application == "parallel" or (self.use_role and not self.role_current_batch_center),
             "local_residual needs the role layer and no current-batch centering"),
            (not (self.role_confidence and self.std_floor > 0), "role_confidence replaces std_floor; set one"),
            (min(self.half_life, self.tau, self.support_scale, self.eps) > 0,
             "half_life, tau, support_scale and eps must be positive"),
            (0 <= self.gamma <= 1 and min(self.std_floor, self.beta, self.exact_prior, self.role_prior) >= 0,
             "gamma must lie in [0, 1]; std_floor, beta and the priors must be >= 0"),
        )  # fmt: skip
        for ok, message in rules:
            if not ok:
                raise ValueError(f"BLPOParams: {message}")

    @property
    def use_role(self) -> bool:
        return "role" in self.layers

    @property
    def progress_read(self) -> ProgressRead:
        """The settings the memory's A^P read takes (``blpo_memory`` keeps no defaults of its own)."""
        return ProgressRead(self.mode, self.role_confidence, self.tau, self.support_scale, self.std_floor, self.eps)


def exact_advantage(returns: np.ndarray, k: StepKeys, params: BLPOParams) -> tuple[np.ndarray, np.ndarray]:
    """A^X inside each Exact group E, and its activity (2.6, 7.3).

    Balanced (default): A^X_n = (score_a - mu_E) / (sigma_E + eps) with score_a the mean G of the
    rows taking canonical action a; E is active iff |E| >= 2, sigma_E^2 > eps^2 and some
    |score_a - mu_E| > eps. Unbalanced: (G_n - mu_E) / (sigma_E + eps), active iff sigma_E^2 > eps^2.
    """
    count, mean, var = k.exact_moments(returns)
    active = (count >= 2) & (var > params.eps**2)  # (n_exact,)
    if params.exact_action_balance:
        pair, n_pair = pair_codes(k.exact, k.action, k.n_action)
        _, score, _ = group_moments(returns, pair, n_pair)
        pair_exact = k.exact[group_first(pair, n_pair)]
        dev_pair = score - mean[pair_exact]  # (n_pair,) score_a - mu_E
        active &= np.bincount(pair_exact, weights=np.abs(dev_pair) > params.eps, minlength=k.n_exact) > 0
        dev = dev_pair[pair]
    else:
        dev = returns - mean[k.exact]
    adv = dev if params.mode == "mean_norm" else dev / (np.sqrt(var)[k.exact] + params.eps)
    row_active = active[k.exact]
    return np.where(row_active, adv, 0.0), row_active


def batch_effects(delta: np.ndarray, k: StepKeys, child_balance: bool) -> tuple[KeyCodes, list, tuple]:
    """This batch's effects on the memory summed per key: ``with_effects`` arguments (2.7 (b)-(d)).

    An Exact group writes iff it has >= 2 shareable rows with >= 2 distinct abstract actions. With
    child balance each (role, action, E, context) bucket is one effect e = mean delta, weight 1;
    otherwise each shareable row of an eligible group is an effect of weight 1. Effects are the
    context-relative returns ``delta`` (N,).

    Returns:
        ``(keys, sums, children)``: K (role, action) keys (``KeyCodes``), [sum w, sum w e, sum w e^2,
        sum w^2] as (K,) arrays, and per key (context digests, weights, bounds) (``children_by_key``).
    """
    sh = np.flatnonzero(k.shareable)
    pair, n_pair = pair_codes(k.exact[sh], k.key_abstract[k.key[sh]], len(k.abstract_values))
    n_distinct = np.bincount(k.exact[sh][group_first(pair, n_pair)], minlength=k.n_exact)
    eligible = (np.bincount(k.exact[sh], minlength=k.n_exact) >= 2) & (n_distinct >= 2)
    rows = sh[eligible[k.exact[sh]]]
    effect, first = delta[rows], rows
    if child_balance:  # buckets sorted by (key, uid, observation, context): the order S and Q are summed in
        n_context = max(len(k.context_values), 1)
        key_exact = k.key[rows] * max(k.n_exact, 1) + exact_ranks(k)[k.exact[rows]]  # (key, uid, obs) order
        if len(rows) and int(key_exact.max()) >= np.iinfo(np.int64).max // n_context:  # too wide for one pack
            exact = k.uid[rows] * max(k.n_obs, 1) + k.obs[rows]
            key_exact, _ = combine_codes(k.key[rows], exact, max(k.n_uid * k.n_obs, 1))
        bucket, n_bucket = combine_codes(key_exact, k.context[rows], n_context)  # one sort of the rows
        effect, first = group_moments(delta[rows], bucket, n_bucket)[1], rows[group_first(bucket, n_bucket)]
    # first: (E,) one row per effect, whose key and context the effect takes
    written, key_index = np.unique(k.key[first], return_inverse=True)
    n_written = len(written)
    weight = np.bincount(key_index, minlength=n_written).astype(np.float64)  # sum w = sum w^2 (w = 1)
    moments = (np.bincount(key_index, weights=v, minlength=n_written) for v in (effect, effect**2))
    sums = [weight, *moments, weight]
    return key_codes(k, written), sums, children_by_key(key_index, k.context[first], n_written, k.context_values)


def exact_ranks(k: StepKeys) -> np.ndarray:
    """(n_exact,) rank of each Exact group in (uid, observation) code order: a sort of the groups,
    so that the rows' (key, uid, observation, context) buckets are ordered by one sort of one int64."""
    first = k.exact_first
    rank = np.empty(k.n_exact, dtype=np.int64)
    rank[np.argsort(k.uid[first] * max(k.n_obs, 1) + k.obs[first])] = np.arange(k.n_exact)
    return rank


def key_codes(k: StepKeys, codes: np.ndarray) -> KeyCodes:
    """The (role, abstract action) keys of key codes, as the memory takes them."""
    return KeyCodes(k.role_values, k.key_role[codes], k.abstract_values, k.key_abstract[codes])


def read_progress(memory: BLPOMemory, update: int, k: StepKeys, params: BLPOParams) -> tuple:
    """A^P, its activity and the role score m_a per row, read from ``memory`` at ``update`` (2.7 (f), (g)).

    Only shareable rows read: ``read_progress_keys`` once over the distinct keys they carry (every
    role of them in one numpy pass); a row is active iff its role is active and its (role, action)
    has a record with W > eps.

    Returns:
        ``(adv, active, score, n_active_roles)``: three (N,) arrays and an int.
    """
    n_key = len(k.key_role)
    adv, score, active = np.zeros(n_key + 1), np.zeros(n_key + 1), np.zeros(n_key + 1, dtype=bool)
    read = distinct(k.key[k.shareable])
    adv[read], active[read], score[read], n_active_roles = read_progress_keys(
        memory, key_codes(k, read), update, params.progress_read
    )
    row = np.where(k.shareable, k.key, n_key)  # non-shareable rows read the zero slot n_key
    return adv[row], active[row], score[row], n_active_roles


def fuse_parallel(adv_x, active_x, adv_p, active_p, params: BLPOParams) -> np.ndarray:
    """micro = sum over active layers of p_l / (sum of active p) * A^l; 0 when none is active (2.8)."""
    p_x, p_p = params.exact_prior * active_x, params.role_prior * active_p
    denom = p_x + p_p
    safe = np.where(denom > 0, denom, 1.0)
    return np.where(denom > 0, (p_x / safe) * adv_x + (p_p / safe) * adv_p, 0.0)


def local_residual(returns, k: StepKeys, score, reliable, params: BLPOParams) -> tuple[np.ndarray, ...]:
    """Non-default ``local_residual`` application inside each Exact group (2.8).

    combined = (G - mu_E) + beta * (m_a - mean of m over the group's reliable rows) on reliable rows of
    usable groups (>= 2 reliable rows, >= 2 abstract actions, population var of m > eps^2); combined is
    re-centred and divided by its std (ddof 1) if that is > eps (0 otherwise, and for |E| = 1).

    Returns:
        ``(micro, correction, applied)``: micro (N,), beta * projected role score (N,), its rows (N,).
    """
    rel = np.flatnonzero(reliable)
    pair, n_pair = pair_codes(k.exact[rel], k.key_abstract[k.key[rel]], len(k.abstract_values))
    n_distinct = np.bincount(k.exact[rel][group_first(pair, n_pair)], minlength=k.n_exact)
    n_rel, mean_rel, var_rel = group_moments(score[rel], k.exact[rel], k.n_exact)
    var_pop = var_rel * np.maximum(n_rel - 1, 0) / np.maximum(n_rel, 1)
    usable = (n_rel >= 2) & (n_distinct >= 2) & (var_pop > params.eps**2)
    applied = np.zeros(len(returns), dtype=bool)
    applied[rel] = usable[k.exact[rel]]
    projected = np.where(applied, score - mean_rel[k.exact], 0.0)
    mean = k.exact_moments(returns)[1]
    combined = (returns - mean[k.exact]) + params.beta * projected
    count, mean_c, var_c = group_moments(combined, k.exact, k.n_exact)
    combined = combined - mean_c[k.exact]
    std = np.sqrt(var_c)[k.exact]
    if params.mode == "mean_norm":
        micro = combined
    else:
        micro = np.where(std > params.eps, combined / (std + params.eps), 0.0)
    return np.where(count[k.exact] >= 2, micro, 0.0), params.beta * projected, applied


def progress_layer(returns, k: StepKeys, memory: BLPOMemory, update: int, params: BLPOParams):
    """Write this batch's effects and read A^P, in the order ``role_read_before_write`` sets (2.7 (a)-(h)).

    Returns:
        ``(memory, adv, active, score, n_active_roles)``: the new memory and (N,) row arrays.
    """
    delta = returns
    if params.role_residual_center:
        delta = returns - k.exact_moments(returns)[1][k.exact]  # delta = G - mean_E G
    effects = batch_effects(delta, k, params.role_child_balance)
    if params.role_read_before_write:
        adv, active, score, n_active_roles = read_progress(memory, update, k, params)
        memory = memory.with_effects(update, *effects)
    else:
        memory = memory.with_effects(update, *effects)
        adv, active, score, n_active_roles = read_progress(memory, update, k, params)
    if params.role_current_batch_center:
        adv, active = center_active(adv, active, k.key_role[k.key], len(k.role_values), params.eps)
    if np.any(active & ~k.shareable):
        raise RuntimeError("BLPO activated the progress term on a non-shareable row")
    return memory, adv, active, score, n_active_roles


def load_memory(payload: dict, params: BLPOParams) -> BLPOMemory:
    """The registry's state loader: a saved memory, checked against the configured half-life."""
    return BLPOMemory.from_json_dict(payload, params.half_life)


@ADVANTAGES.register("blpo", BLPOParams, load_state=load_memory)
def blpo_advantage(batch: StepBatch, params: BLPOParams, state: BLPOMemory | None = None) -> AdvantageResult:
    """A_n = A^E_n + w_step * micro_n (2.8); ``state`` is the memory before this batch (None: empty).

    A^E_n = (score_n - mu_uid) / (sigma_uid + eps) over all step rows of the uid, 0 for a group of
    one (2.5). The input memory is not changed; the updated one is ``AdvantageResult.state``.

    Raises:
        ValueError: a needed column is missing, NaN/Inf in rewards, a bad row layout, a memory with
            another half-life, or ``update_index`` below the memory's.
    """
    batch.require("anchor_obs", "action", "valid", "format_valid", "progress_key", "abstract_action",
                  "context_id", "shareable")  # fmt: skip
    require_finite(batch, "reward", "episode_return")
    memory, update = checked_memory(state, params, int(batch.update_index))
    score, reward = penalized_score_and_reward(batch, params.invalid_penalty)
    returns = discounted_returns(reward, trajectory_starts(batch), params.gamma)  # (N,) G_n
    k = step_keys(batch)
    adv_episode = group_standardize(score, k.uid, k.n_uid, params.mode, params.eps, "zero")
    adv_exact, active_exact = exact_advantage(returns, k, params)
    adv_progress, active_progress, role_score = np.zeros(len(batch)), np.zeros(len(batch), dtype=bool), None
    n_active_roles = 0
    if params.use_role:
        memory, adv_progress, active_progress, role_score, n_active_roles = progress_layer(
            returns, k, memory, update, params
        )
    if params.role_application == "parallel":
        micro = fuse_parallel(adv_exact, active_exact, adv_progress, active_progress, params)
    else:
        micro, adv_progress, active_progress = local_residual(returns, k, role_score, active_progress, params)
    adv = adv_episode + params.step_advantage_w * micro
    if not np.isfinite(adv).all():
        raise RuntimeError("BLPO advantage contains NaN or Inf")
    stats = {"memory_keys": float(len(memory)), "active_roles": float(n_active_roles)}
    stats.update(
        means(progress_active_fraction=active_progress, exact_active_fraction=active_exact,
              mean_abs_adv_progress=np.abs(adv_progress), mean_abs_adv_exact=np.abs(adv_exact),
              mean_abs_adv_episode=np.abs(adv_episode))
    )  # fmt: skip
    return AdvantageResult(adv=adv, keep=np.ones(len(batch), dtype=bool), state=memory, stats=stats)


def checked_memory(state: object, params: BLPOParams, update: int) -> tuple[BLPOMemory, int]:
    """The memory to start from (empty for None), checked against the half-life and the update counter."""
    memory = BLPOMemory(params.half_life) if state is None else state
    if not isinstance(memory, BLPOMemory) or memory.half_life != float(params.half_life):
        raise ValueError(f"BLPO state must be a BLPOMemory with half_life {params.half_life}")
    if update < memory.update_index:
        raise ValueError(f"update_index {update} is below the memory's latest update {memory.update_index}")
    return memory, update


def means(**columns: np.ndarray) -> dict[str, float]:
    """Plain mean of each (N,) column, 0 for an empty batch."""
    return {name: float(values.mean()) if len(values) else 0.0 for name, values in columns.items()}
