"""BLPO's global progress memory: batch effects, storage and the per-role read (ALGORITHMS.md 2.7 (b)-(g), 7.3).

The memory maps (role, abstract action) to a moment record (W, S, Q, R, last_update, children), where
children maps a stable hash of a concrete context id to its support weight. Records decay lazily:
reading or writing at update u first multiplies W, S, Q and the children by f = lambda^(u - last) and
R by f^2, with lambda = 2^(-1/h). A memory is a value: ``with_effects`` returns a new memory and
never changes the one it was called on (records are shared between the two, never mutated).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from methods.stepwise import combine_codes, group_first, group_moments

if TYPE_CHECKING:
    from methods.blpo import BatchKeys

CHILD_PRUNE = 1e-10  # children whose decayed weight is not above this are dropped (2.7 (d))
N_EFF_TOL = 1e-9  # a role is active when n_eff >= 2 - N_EFF_TOL (7.3)
JSON_VERSION = 1


def context_hash(context_id: Any) -> str:
    """Stable 128-bit hex digest of a context id (blake2b; Python's ``hash`` is salted per process)."""
    return hashlib.blake2b(str(context_id).encode("utf-8"), digest_size=16).hexdigest()


@dataclass(frozen=True)
class MomentRecord:
    """Decayed moments of the effects written to one (role, action) key, as of ``last_update``."""

    W: float  # sum of weights
    S: float  # sum of weight * effect
    Q: float  # sum of weight * effect^2
    R: float  # sum of weight^2
    last_update: int
    children: Mapping[str, float] = field(default_factory=dict)  # context hash -> weight (read only)

    def decayed(self, update: int, decay: float) -> MomentRecord:
        """This record at ``update``: W, S, Q, children times f = decay^(update - last), R times f^2."""
        f = decay ** (update - self.last_update)
        if f == 1.0:
            return self
        children = {k: v * f for k, v in self.children.items() if v * f > CHILD_PRUNE}
        return MomentRecord(self.W * f, self.S * f, self.Q * f, self.R * f * f, update, children)


class BLPOMemory:
    """The estimator state: moment records keyed by (role, abstract action) (2.7 (d)).

    Args:
        half_life: h in policy updates; lambda = 2^(-1/h).
        records: initial records (taken as they are; they must not be mutated afterwards).
        update_index: the latest update u this memory was advanced to (-1 for a new memory).
    """

    def __init__(
        self,
        half_life: float = 8.0,
        records: Mapping[tuple[str, str], MomentRecord] | None = None,
        update_index: int = -1,
    ) -> None:
        if not half_life > 0.0:
            raise ValueError(f"half_life must be positive, got {half_life}")
        self.half_life = float(half_life)
        self.decay = 2.0 ** (-1.0 / self.half_life)
        self.update_index = int(update_index)
        self._records: dict[tuple[str, str], MomentRecord] = dict(records or {})
        self._by_role: dict[str, tuple[str, ...]] = {}
        for role, action in sorted(self._records):
            self._by_role[role] = self._by_role.get(role, ()) + (action,)

    def __len__(self) -> int:
        return len(self._records)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BLPOMemory):
            return NotImplemented
        return self.to_json_dict() == other.to_json_dict()

    def get(self, role: str, action: str) -> MomentRecord | None:
        """The stored (not decayed) record of a key, or None."""
        return self._records.get((role, action))

    def role_records(self, role: str, update: int, eps: float) -> dict[str, MomentRecord]:
        """Records of ``role`` decayed to ``update`` with W > eps, by action in sorted order (2.7 (f))."""
        result = {}
        for action in self._by_role.get(role, ()):
            record = self._records[(role, action)].decayed(update, self.decay)
            if record.W > eps:
                result[action] = record
        return result

    def with_effects(
        self,
        update: int,
        keys: Sequence[tuple[str, str]],
        sums: Sequence[Sequence[float]],
        children: Sequence[Sequence[tuple[str, float]]],
    ) -> BLPOMemory:
        """A new memory with one batch of effects written at ``update`` (2.7 (d)).

        Each key's record is decayed to ``update``, then W += sum w, S += sum w e, Q += sum w e^2,
        R += sum w^2 and children[c] += w (the batch sums are formed first, in a fixed order).

        Args:
            update: policy-update counter u; must not be below the latest update written.
            keys: K distinct (role, action) keys.
            sums: four length-K sequences: sum w, sum w e, sum w e^2, sum w^2 per key.
            children: K lists of (context hash, sum w) pairs.

        Raises:
            ValueError: ``update`` is below ``update_index`` (decay would amplify old evidence).
        """
        if update < self.update_index:
            raise ValueError(f"update_index went backwards: memory at {self.update_index}, batch at {update}")
        records = dict(self._records)
        for key, w, s, q, r, adds in zip(keys, *sums, children):
            old = records.get(key)
            base = MomentRecord(0.0, 0.0, 0.0, 0.0, update) if old is None else old.decayed(update, self.decay)
            merged = dict(base.children)
            for child, weight in adds:
                merged[child] = merged.get(child, 0.0) + weight
            records[key] = MomentRecord(base.W + w, base.S + s, base.Q + q, base.R + r, update, merged)
        return BLPOMemory(self.half_life, records, max(self.update_index, update))

    def to_json_dict(self) -> dict[str, Any]:
        """JSON-serialisable snapshot; records sorted by (role, action), children by hash."""
        return {
            "version": JSON_VERSION,
            "half_life": self.half_life,
            "update_index": self.update_index,
            "records": [
                {
                    "role": role,
                    "action": action,
                    "W": r.W,
                    "S": r.S,
                    "Q": r.Q,
                    "R": r.R,
                    "last_update": r.last_update,
                    "children": {k: r.children[k] for k in sorted(r.children)},
                }
                for (role, action), r in sorted(self._records.items())
            ],
        }

    @classmethod
    def from_json_dict(cls, payload: Mapping[str, Any], half_life: float) -> BLPOMemory:
        """Inverse of ``to_json_dict``; ``half_life`` is the configured h, checked against the file.

        Raises:
            ValueError: unknown version, or the stored half-life differs from ``half_life``.
        """
        if int(payload.get("version", -1)) != JSON_VERSION:
            raise ValueError(f"unsupported BLPO memory version {payload.get('version')!r}")
        if abs(float(payload["half_life"]) - float(half_life)) > 1e-12:
            raise ValueError(f"BLPO memory half-life mismatch: stored {payload['half_life']}, configured {half_life}")
        records = {
            (str(d["role"]), str(d["action"])): MomentRecord(
                float(d["W"]), float(d["S"]), float(d["Q"]), float(d["R"]), int(d["last_update"]),
                {str(k): float(v) for k, v in d["children"].items()},
            )
            for d in payload["records"]
        }
        return cls(half_life, records, int(payload.get("update_index", -1)))

    def records(self) -> list[dict[str, Any]]:
        """Flat rows (role, action, W, S, Q, R, last_update, n_children, mean) for inspection (stored values)."""
        return [
            {
                "role": role, "action": action, "W": r.W, "S": r.S, "Q": r.Q, "R": r.R,
                "last_update": r.last_update, "n_children": len(r.children),
                "mean": r.S / r.W if r.W > 0.0 else 0.0,
            }
            for (role, action), r in sorted(self._records.items())
        ]


def batch_effects(delta: np.ndarray, k: BatchKeys, child_balance: bool) -> tuple[list, list, list]:
    """This batch's effects on the memory, summed per key: the arguments of ``with_effects`` (2.7 (b)-(d)).

    An Exact group writes iff it has >= 2 shareable rows with >= 2 distinct abstract actions. With
    child balance each (role, action, E, context) bucket is one effect e = mean delta, weight 1;
    otherwise each shareable row of an eligible group is an effect of weight 1. Effects are the
    context-relative returns ``delta`` (N,).

    Returns:
        ``(keys, sums, children)``: K (role, action) keys, [sum w, sum w e, sum w e^2, sum w^2] as
        length-K lists, and K lists of (context hash, weight).
    """
    sh = np.flatnonzero(k.shareable)
    pair, n_pair = combine_codes(k.exact[sh], k.key_abstract[k.key[sh]], len(k.abstract_values))
    distinct = np.bincount(k.exact[sh][group_first(pair, n_pair)], minlength=k.n_exact)
    eligible = (np.bincount(k.exact[sh], minlength=k.n_exact) >= 2) & (distinct >= 2)
    rows = sh[eligible[k.exact[sh]]]
    effect, first = delta[rows], rows
    if child_balance:
        key_exact, _ = combine_codes(k.key[rows], k.exact[rows], k.n_exact)
        bucket, n_bucket = combine_codes(key_exact, k.context[rows], len(k.context_values))
        effect, first = group_moments(delta[rows], bucket, n_bucket)[1], rows[group_first(bucket, n_bucket)]
    written, key_index = np.unique(k.key[first], return_inverse=True)
    n_written = len(written)
    weight = np.bincount(key_index, minlength=n_written).astype(np.float64)  # sum w (= sum w^2: w = 1)
    sums = [weight, *(np.bincount(key_index, weights=v, minlength=n_written) for v in (effect, effect**2)), weight]
    child, n_child = combine_codes(key_index, k.context[first], len(k.context_values))
    child_first = group_first(child, n_child)  # sorted by (key, context): child_key is nondecreasing
    child_key, child_context = key_index[child_first], k.context[first][child_first]
    hashes = {c: context_hash(k.context_values[c]) for c in np.unique(child_context).tolist()}
    pairs = list(zip((hashes[c] for c in child_context.tolist()), np.bincount(child, minlength=n_child).tolist()))
    bounds = np.concatenate(([0], np.cumsum(np.bincount(child_key, minlength=n_written)))).tolist()
    children = [pairs[bounds[i] : bounds[i + 1]] for i in range(n_written)]
    keys = [(k.role_values[k.key_role[c]], k.abstract_values[k.key_abstract[c]]) for c in written.tolist()]
    return keys, [s.tolist() for s in sums], children


def kish_n_eff(weights: Sequence[float] | Any) -> float:
    """Kish's effective count n_eff = (sum w)^2 / sum w^2, 0 when there is no weight (2.7 (f))."""
    total = sum(weights)
    square = sum(w * w for w in weights)
    return total * total / square if square > 0.0 else 0.0


def harmonic_mean(values: Sequence[float], eps: float) -> float:
    """Harmonic mean over the values above eps; 0 when none is (7.3)."""
    kept = [v for v in values if v > eps]
    return len(kept) / sum(1.0 / v for v in kept) if kept else 0.0


def effect_variance(r: MomentRecord, eps: float) -> float:
    """Unbiased weighted effect variance v = max(Q - S^2/W, 0) / (W - R/W), 0 if W - R/W <= eps (2.7 (g))."""
    if r.W <= eps:
        return 0.0
    denom = r.W - r.R / r.W
    return max(r.Q - r.S * r.S / r.W, 0.0) / denom if denom > eps else 0.0


@dataclass(frozen=True)
class RoleRead:
    """What one role gives its rows: activity, A^P and the score m_a per action."""

    active: bool
    adv: dict[str, float]  # action -> A^P (empty when inactive)
    score: dict[str, float]  # action -> m_a = S_a / W_a (every record with W > eps)
    n_eff: float  # Kish support of the role (max weight per context over its actions)


def role_progress_advantage(
    records: Mapping[str, MomentRecord],
    *,
    mode: str = "mean_std_norm",
    confidence: bool = True,
    tau: float = 0.05,
    support_scale: float = 4.0,
    std_floor: float = 0.0,
    eps: float = 1e-6,
) -> RoleRead:
    """Per-role statistics and the reliability-weighted A^P of each action (2.7 (f)-(g)).

    m_a = S_a/W_a, M = mean_a m_a, s = std_ddof1(m_a) (0 for fewer than 2 actions); the role is active
    iff n_eff >= 2 - 1e-9 (Kish over contexts, each at its max weight over actions) and s^2 > eps^2.
    With confidence: A^P_a = kappa * c_a / max(sqrt(s^2 + SE_D^2 + tau^2), eps), c_a = m_a - M,
    kappa = n_cmp / (n_cmp + support_scale), n_cmp = HM(n_a, HM({n_b : b != a})),
    SE_D^2 = ((K-1)/K)^2 SE_a^2 + sum_{b != a} SE_b^2 / K^2, SE_b^2 = v_b / max(n_b, 1).
    ``mean_norm``: A^P = c_a (confidence is ignored). Confidence off: c_a / max(s, std_floor, eps).

    Args:
        records: the role's records decayed to the current update, W > eps, by action.
    """
    actions = sorted(records)
    score = {a: records[a].S / records[a].W for a in actions}
    k = len(actions)
    mean = sum(score.values()) / k if k else 0.0
    var = sum((score[a] - mean) ** 2 for a in actions) / (k - 1) if k >= 2 else 0.0
    if var <= eps * eps:
        return RoleRead(False, {}, score, 0.0)
    support: dict[str, float] = {}
    for a in actions:
        for child, w in records[a].children.items():
            if w > support.get(child, 0.0):
                support[child] = w
    n_eff = kish_n_eff(list(support.values()))
    if n_eff < 2.0 - N_EFF_TOL:
        return RoleRead(False, {}, score, n_eff)
    s = math.sqrt(var)
    centered = {a: score[a] - mean for a in actions}
    if mode == "mean_norm":
        return RoleRead(True, centered, score, n_eff)
    if not confidence:
        return RoleRead(True, {a: c / max(s, std_floor, eps) for a, c in centered.items()}, score, n_eff)
    n = {a: kish_n_eff(list(records[a].children.values())) for a in actions}
    se2 = {a: effect_variance(records[a], eps) / max(n[a], 1.0) for a in actions}
    adv = {}
    for a in actions:
        others = [b for b in actions if b != a]
        n_cmp = harmonic_mean([n[a], harmonic_mean([n[b] for b in others], eps)], eps)
        kappa = n_cmp / (n_cmp + support_scale)
        se2_diff = ((k - 1) / k) ** 2 * se2[a] + sum(se2[b] for b in others) / (k * k)
        adv[a] = kappa * centered[a] / max(math.sqrt(var + se2_diff + tau * tau), eps)
    return RoleRead(True, adv, score, n_eff)
