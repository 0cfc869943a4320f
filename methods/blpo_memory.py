"""BLPO's global progress memory and its per-role read (docs/algorithms.md §2.7 (d)-(g), 7.3).

The memory maps (role, abstract action) to a moment record (W, S, Q, R, last_update, children), where
children maps a stable hash of a concrete context id to its support weight. Records decay lazily:
reading or writing at update u first multiplies W, S, Q and the children by f = lambda^(u - last) and
R by f^2, with lambda = 2^(-1/h). A memory is a value: ``with_effects`` returns a new memory and
never changes the one it was called on (records are shared between the two, never mutated).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from operator import mul
from typing import Any

import numpy as np

from methods.stepwise import combine_codes, distinct, group_first

CHILD_PRUNE = 1e-10  # children whose decayed weight is not above this are dropped (2.7 (d))
N_EFF_TOL = 1e-9  # a role is active when n_eff >= 2 - N_EFF_TOL (7.3)
JSON_VERSION = 1


def context_hashes(context_ids: Sequence[Any]) -> list[str]:
    """Stable 128-bit hex digests of context ids (blake2b; Python's ``hash`` is salted per process)."""
    blake2b = hashlib.blake2b
    return [blake2b(str(c).encode("utf-8"), digest_size=16).hexdigest() for c in context_ids]


def children_by_key(key_index: np.ndarray, context: np.ndarray, n_keys: int, context_values: list) -> tuple:
    """Per written key, its contexts' stable hashes in sorted order and the weight each gets (2.7 (d)).

    Args:
        key_index: (E,) key of each effect, 0..n_keys-1; context: (E,) context code of each effect.

    Returns:
        ``(hashes, weights, bounds)``: flat lists, key i owning entries bounds[i]:bounds[i+1]; the
        weight of a context is its number of effects (w = 1).
    """
    used = distinct(context)
    digests = np.array(context_hashes([context_values[c] for c in used.tolist()]), dtype=object)
    order = np.argsort(digests.astype("U32"), kind="stable")
    rank = np.zeros(len(context_values), dtype=np.int64)
    rank[used[order]] = np.arange(len(used))  # context code -> position of its hash in sorted order
    child, n_child = combine_codes(key_index, rank[context], len(used))  # sorted by (key, hash)
    child_first = group_first(child, n_child)
    hashes = digests[order][rank[context][child_first]].tolist()
    weights = np.bincount(child, minlength=n_child).astype(np.float64).tolist()
    bounds = np.concatenate(([0], np.cumsum(np.bincount(key_index[child_first], minlength=n_keys)))).tolist()
    return hashes, weights, bounds


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
        update_index: the latest update u this memory was advanced to (at least every record's
            ``last_update``; -1 for a new memory).
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
        self._records: dict[tuple[str, str], MomentRecord] = dict(records or {})
        self.update_index = max([int(update_index)] + [r.last_update for r in self._records.values()])
        self._by_role: dict[str, list[str]] = {}  # role -> its actions, sorted
        for role, action in sorted(self._records):
            self._by_role.setdefault(role, []).append(action)

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
        children: tuple[Sequence[str], Sequence[float], Sequence[int]],
    ) -> BLPOMemory:
        """A new memory with one batch of effects written at ``update`` (2.7 (d)).

        Each key's record is decayed to ``update``, then W += sum w, S += sum w e, Q += sum w e^2,
        R += sum w^2 and children[c] += w (the batch sums are formed first, in a fixed order).
        Children stay sorted by hash, so every later sum over them runs in an order that depends
        only on the memory's content (a reloaded memory gives the same bits).

        Args:
            update: policy-update counter u; must not be below the latest update written.
            keys: K distinct (role, action) keys.
            sums: four length-K sequences: sum w, sum w e, sum w e^2, sum w^2 per key.
            children: ``(hashes, weights, bounds)`` as ``children_by_key`` returns them: key i adds
                weights[j] to context hashes[j] for bounds[i] <= j < bounds[i+1] (distinct, sorted).

        Raises:
            ValueError: ``update`` is below ``update_index`` (decay would amplify old evidence).
        """
        if update < self.update_index:
            raise ValueError(f"update_index went backwards: memory at {self.update_index}, batch at {update}")
        records = dict(self._records)
        hashes, weights, bounds = children
        for key, w, s, q, r, lo, hi in zip(keys, *sums, bounds[:-1], bounds[1:]):
            added = dict(zip(hashes[lo:hi], weights[lo:hi]))
            old = records.get(key)
            if old is None:
                records[key] = MomentRecord(w, s, q, r, update, added)
                continue
            base = old.decayed(update, self.decay)
            for child in base.children.keys() & added.keys():
                added[child] += base.children[child]
            merged = {**base.children, **added}
            if len(merged) > len(base.children):  # new contexts: keep children sorted by hash
                merged = {c: merged[c] for c in sorted(merged)}
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
                    "children": {c: r.children[c] for c in sorted(r.children)},
                }
                for (role, action), r in sorted(self._records.items())
            ],  # fmt: skip
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
            stored = payload["half_life"]
            raise ValueError(f"BLPO memory half-life mismatch: stored {stored}, configured {half_life}")
        records = {
            (str(d["role"]), str(d["action"])): MomentRecord(
                float(d["W"]),
                float(d["S"]),
                float(d["Q"]),
                float(d["R"]),
                int(d["last_update"]),
                {str(k): float(v) for k, v in sorted(d["children"].items())},
            )
            for d in payload["records"]
        }
        return cls(half_life, records, int(payload.get("update_index", -1)))

    def records(self) -> list[dict[str, Any]]:
        """Flat rows (role, action, W, S, Q, R, last_update, n_children, mean) of the stored records."""
        return [
            {"role": role, "action": action, "W": r.W, "S": r.S, "Q": r.Q, "R": r.R, "last_update": r.last_update,
             "n_children": len(r.children), "mean": r.S / r.W if r.W > 0.0 else 0.0}
            for (role, action), r in sorted(self._records.items())
        ]  # fmt: skip


def kish_n_eff(weights: Sequence[float]) -> float:
    """Kish's effective count n_eff = (sum w)^2 / sum w^2, 0 when there is no weight (2.7 (f))."""
    total, square = sum(weights), sum(map(mul, weights, weights))
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


def role_support(records: Mapping[str, MomentRecord]) -> float:
    """Kish n_eff of a role's contexts, each at its max child weight over the role's actions (2.7 (f))."""
    support: dict[str, float] = {}
    for a in sorted(records):
        children = records[a].children
        larger = {c: support[c] for c in support.keys() & children.keys() if support[c] > children[c]}
        support.update(children)
        support.update(larger)
    return kish_n_eff(list(support.values()))


@dataclass(frozen=True)
class RoleRead:
    """What one role gives its rows: activity, A^P and the score m_a per action."""

    active: bool
    adv: dict[str, float]  # action -> A^P (empty when inactive)
    score: dict[str, float]  # action -> m_a = S_a / W_a (every record with W > eps)
    n_eff: float  # Kish support of the role (``role_support``); 0 when the spread s^2 <= eps^2


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
    n_eff = role_support(records)
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
    inverse = {a: 1.0 / n[a] for a in actions if n[a] > eps}  # HM terms; sums over b != a use totals
    inverse_total, se2_total = sum(inverse.values()), sum(se2.values())
    adv = {}
    for a in actions:
        others = len(inverse) - (a in inverse)
        n_others = others / (inverse_total - inverse.get(a, 0.0)) if others else 0.0  # HM({n_b : b != a})
        n_cmp = harmonic_mean([n[a], n_others], eps)
        kappa = n_cmp / (n_cmp + support_scale)
        se2_diff = ((k - 1) / k) ** 2 * se2[a] + (se2_total - se2[a]) / (k * k)
        adv[a] = kappa * centered[a] / max(math.sqrt(var + se2_diff + tau * tau), eps)
    return RoleRead(True, adv, score, n_eff)
