"""BLPO's global progress memory and its per-role read (docs/algorithms.md §2.7 (d)-(g), 7.3).

The memory maps (role, abstract action) to a moment record (W, S, Q, R, last_update, children), where
children maps a stable hash of a concrete context id (blake2b-128, 32 lower-case hex digits) to its
support weight. Records decay lazily: reading or writing at update u first multiplies W, S, Q and the
children by f = lambda^(u - last) and R by f^2, with lambda = 2^(-1/h). A memory is a value:
``with_effects`` returns a new memory and never changes the one it was called on.

The records are held as columns sorted by (role, action), the children of a record as a run of
(digest, weight) entries sorted by digest, so a write and a read are numpy passes over all keys at
once (``with_effects``, ``read_progress_keys``; keys as codes, ``KeyCodes``). ``MomentRecord``,
``role_support`` and ``role_progress_advantage`` are the same read for one role in plain Python: the
reference the vectorised read is tested against, bit for bit (every float operation in the same
order; powers through ``np.float_power``, which is libm's ``pow`` as Python's ``**`` is).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from operator import mul
from typing import Any

import numpy as np

from methods.stepwise import distinct

CHILD_PRUNE = 1e-10  # children whose decayed weight is not above this are dropped (2.7 (d))
N_EFF_TOL = 1e-9  # a role is active when n_eff >= 2 - N_EFF_TOL (7.3)
JSON_VERSION = 1
HEX_DIGITS = 32  # a context hash: blake2b with a 16-byte digest, as hex


def context_hashes(context_ids: Sequence[Any]) -> list[str]:
    """Stable 128-bit hex digests of context ids (blake2b; Python's ``hash`` is salted per process)."""
    blake2b = hashlib.blake2b
    return [blake2b(str(c).encode("utf-8"), digest_size=16).hexdigest() for c in context_ids]


def context_digests(context_ids: Sequence[Any]) -> np.ndarray:
    """The same digests as ``context_hashes``, as (n, 2) uint64 (big-endian halves: their order is the
    hex strings' order). Each hash is a copy of one empty blake2b state (a quarter cheaper than
    constructing one per id, whose keyword parsing dominates for short ids)."""
    empty = hashlib.blake2b(digest_size=16)
    digests = []
    for c in context_ids:
        h = empty.copy()
        h.update(str(c).encode("utf-8"))
        digests.append(h.digest())
    return np.frombuffer(b"".join(digests), dtype=">u8").astype(np.uint64).reshape(-1, 2)


def digests_from_hex(hashes: Sequence[str]) -> np.ndarray:
    """(n, 2) uint64 digests of 32-digit lower-case hex context hashes.

    Raises:
        ValueError: a hash that is not 32 lower-case hex digits.
    """
    hashes = list(hashes)
    joined = "".join(hashes)
    if hashes and (set(map(len, hashes)) != {HEX_DIGITS} or joined.lower() != joined):
        raise ValueError("context hashes must be 32 lower-case hex digits (context_hashes)")
    try:
        raw = bytes.fromhex(joined)
    except ValueError as err:
        raise ValueError("context hashes must be 32 lower-case hex digits (context_hashes)") from err
    return np.frombuffer(raw, dtype=">u8").astype(np.uint64).reshape(-1, 2)


def hex_from_digests(digest: np.ndarray) -> list[str]:
    """Inverse of ``digests_from_hex``."""
    raw = np.ascontiguousarray(digest, dtype=">u8").tobytes()
    return [raw[i : i + 16].hex() for i in range(0, len(raw), 16)]


def order_by_group_and_digest(group: np.ndarray, n_groups: int, digest: np.ndarray) -> np.ndarray:
    """Positions of the entries sorted by (group, digest); equal entries in any order.

    One ``argsort`` of uint64 (group in the top bits, the digest's leading bits below); entries whose
    packed values tie but whose digests differ (about 2^-40 per pair) are sorted exactly instead.
    """
    bits = max(int(n_groups - 1).bit_length(), 1)
    if bits > 48:
        return np.lexsort((digest[:, 1], digest[:, 0], group))
    packed = (np.asarray(group, dtype=np.uint64) << np.uint64(64 - bits)) | (digest[:, 0] >> np.uint64(bits))
    order = np.argsort(packed)
    tie = np.flatnonzero(packed[order[1:]] == packed[order[:-1]])
    if np.any(digest[order[tie + 1]] != digest[order[tie]]):
        return np.lexsort((digest[:, 1], digest[:, 0], group))
    return order


def run_starts(group: np.ndarray, digest: np.ndarray) -> np.ndarray:
    """(n,) bool: entry i (sorted by group and digest) starts a new (group, digest) run."""
    start = np.ones(len(group), dtype=bool)
    start[1:] = (group[1:] != group[:-1]) | np.any(digest[1:] != digest[:-1], axis=1)
    return start


def segments(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The positions of the ranges [starts[i], ends[i]) one after the other, and the range of each."""
    lengths = ends - starts
    owner = np.repeat(np.arange(len(starts)), lengths)
    offsets = np.cumsum(lengths) - lengths
    return np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(offsets - starts, lengths), owner


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


@dataclass(frozen=True)
class KeyCodes:
    """(role, action) keys as codes: key i is (roles[role[i]], actions[action[i]]); the name lists may
    hold names no key uses."""

    roles: Sequence[str]
    role: np.ndarray  # (K,) int64
    actions: Sequence[str]
    action: np.ndarray  # (K,) int64

    @classmethod
    def of(cls, keys: Sequence[tuple[str, str]]) -> KeyCodes:
        """Codes of a list of (role, action) pairs."""
        roles: dict[str, int] = {}
        actions: dict[str, int] = {}
        role = [roles.setdefault(str(r), len(roles)) for r, _ in keys]
        action = [actions.setdefault(str(a), len(actions)) for _, a in keys]
        return cls(list(roles), np.array(role, dtype=np.int64), list(actions), np.array(action, dtype=np.int64))

    def __len__(self) -> int:
        return len(self.role)


class BLPOMemory:
    """The estimator state: moment records keyed by (role, abstract action) (2.7 (d)).

    Rows are sorted by (role, action): ``roles`` and ``actions`` are the sorted distinct names, and
    row i is (roles[role[i]], actions[action[i]]), so the packed code role * len(actions) + action
    increases with the row and a key is found by ``np.searchsorted``.

    Args:
        half_life: h in policy updates; lambda = 2^(-1/h).
        records: initial records, their children keyed by ``context_hashes`` digests.
        update_index: the latest update u this memory was advanced to (at least every record's
            ``last_update``; -1 for a new memory).
    """

    def __init__(
        self,
        half_life: float,
        records: Mapping[tuple[str, str], MomentRecord] | None = None,
        update_index: int = -1,
    ) -> None:
        if not half_life > 0.0:
            raise ValueError(f"half_life must be positive, got {half_life}")
        items = sorted(((str(r), str(a)), m) for (r, a), m in (records or {}).items())
        roles, actions = sorted({r for (r, _), _ in items}), sorted({a for (_, a), _ in items})
        role_no, action_no = dict(zip(roles, range(len(roles)))), dict(zip(actions, range(len(actions))))
        W, S, Q, R = (np.array([getattr(m, f) for _, m in items], dtype=np.float64) for f in "WSQR")
        last = np.array([m.last_update for _, m in items], dtype=np.int64)
        children = [sorted(m.children.items()) for _, m in items]
        self._set(
            float(half_life), roles, np.array([role_no[r] for (r, _), _ in items], dtype=np.int64),
            actions, np.array([action_no[a] for (_, a), _ in items], dtype=np.int64), W, S, Q, R, last,
            np.concatenate(([0], np.cumsum([len(c) for c in children], dtype=np.int64))).astype(np.int64),
            digests_from_hex([h for c in children for h, _ in c]),
            np.array([w for c in children for _, w in c], dtype=np.float64),
            max([int(update_index)] + last.tolist()),
        )  # fmt: skip

    def _set(self, half_life, roles, role, actions, action, W, S, Q, R, last, bounds, digest, weight, update_index):
        self.half_life, self.decay = half_life, 2.0 ** (-1.0 / half_life)
        self.roles, self.role, self.actions, self.action = roles, role, actions, action
        self.W, self.S, self.Q, self.R, self.last = W, S, Q, R, last
        self.bounds, self.digest, self.weight = bounds, digest, weight  # children: row i owns bounds[i]:bounds[i+1]
        self.update_index = update_index
        self.code = role * max(len(actions), 1) + action  # (K,) increasing
        self.role_bounds = np.searchsorted(role, np.arange(len(roles) + 1)).astype(np.int64)
        self._role_no: dict[str, int] | None = None
        self._action_no: dict[str, int] | None = None
        self._numbered: dict[int, tuple[Sequence[str], np.ndarray]] = {}  # id(names) -> (names, numbers)

    @classmethod
    def _of_columns(cls, *columns) -> BLPOMemory:
        """A memory over these columns as they are (sorted, never mutated afterwards)."""
        memory = cls.__new__(cls)
        memory._set(*columns)
        return memory

    def __len__(self) -> int:
        return len(self.role)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BLPOMemory):
            return NotImplemented
        return self.to_json_dict() == other.to_json_dict()

    def role_numbers(self, names: Sequence[str]) -> np.ndarray:
        """The number of each role name in ``roles``, -1 for a role without records."""
        if self._role_no is None:
            self._role_no = dict(zip(self.roles, range(len(self.roles))))
        return self._numbers(names, self._role_no)

    def action_numbers(self, names: Sequence[str]) -> np.ndarray:
        """The number of each action name in ``actions``, -1 for an action without records."""
        if self._action_no is None:
            self._action_no = dict(zip(self.actions, range(len(self.actions))))
        return self._numbers(names, self._action_no)

    def _numbers(self, names: Sequence[str], number: dict[str, int]) -> np.ndarray:
        """Names looked up once per list (a batch's name list serves its write and its read)."""
        seen = self._numbered.get(id(names))
        if seen is None or seen[0] is not names:
            seen = names, np.array([number.get(n, -1) for n in names], dtype=np.int64).reshape(-1)
            if len(self._numbered) >= 4:  # a batch's two lists (roles, actions): keep the latest only
                self._numbered.clear()
            self._numbered[id(names)] = seen
        return seen[1]

    def find(self, keys: KeyCodes) -> np.ndarray:
        """(K,) row of each key, -1 where it has no record."""
        role = self.role_numbers(keys.roles)[keys.role]
        action = self.action_numbers(keys.actions)[keys.action]
        code = role * max(len(self.actions), 1) + action
        at = np.minimum(np.searchsorted(self.code, code), max(len(self) - 1, 0))
        hit = (role >= 0) & (action >= 0) & (self.code[at] == code) if len(self) else np.zeros(len(code), bool)
        return np.where(hit, at, -1)

    def keys(self) -> list[tuple[str, str]]:
        """Every (role, action) key, in row order."""
        roles, actions = self.roles, self.actions
        return [(roles[r], actions[a]) for r, a in zip(self.role.tolist(), self.action.tolist())]

    def _record(self, i: int) -> MomentRecord:
        lo, hi = int(self.bounds[i]), int(self.bounds[i + 1])
        children = dict(zip(hex_from_digests(self.digest[lo:hi]), self.weight[lo:hi].tolist()))
        return MomentRecord(float(self.W[i]), float(self.S[i]), float(self.Q[i]), float(self.R[i]),
                            int(self.last[i]), children)  # fmt: skip

    def get(self, role: str, action: str) -> MomentRecord | None:
        """The stored (not decayed) record of a key, or None."""
        i = int(self.find(KeyCodes.of([(role, action)]))[0])
        return None if i < 0 else self._record(i)

    def items(self) -> list[tuple[tuple[str, str], MomentRecord]]:
        """Every stored record, sorted by (role, action)."""
        return [(key, self._record(i)) for i, key in enumerate(self.keys())]

    def role_records(self, role: str, update: int, eps: float) -> dict[str, MomentRecord]:
        """Records of ``role`` decayed to ``update`` with W > eps, by action in sorted order (2.7 (f))."""
        number = int(self.role_numbers([role])[0])
        result = {}
        for i in range(int(self.role_bounds[max(number, 0)]), int(self.role_bounds[number + 1]) if number >= 0 else 0):
            record = self._record(i).decayed(update, self.decay)
            if record.W > eps:
                result[self.actions[self.action[i]]] = record
        return result

    def with_effects(
        self,
        update: int,
        keys: Sequence[tuple[str, str]],
        sums: Sequence[Sequence[float]],
        children: tuple[Sequence[str] | np.ndarray, Sequence[float], Sequence[int]],
    ) -> BLPOMemory:
        """A new memory with one batch of effects written at ``update`` (2.7 (d)).

        Each key's record is decayed to ``update``, then W += sum w, S += sum w e, Q += sum w e^2,
        R += sum w^2 and children[c] += w (the batch sums are formed first, in a fixed order).
        Children stay sorted by hash, so every later sum over them runs in an order that depends
        only on the memory's content (a reloaded memory gives the same bits). One numpy pass over
        all keys: the records are gathered, decayed and added as columns, and the children of the
        old and new records are merged by one sort of (record, digest).

        Args:
            update: policy-update counter u; must not be below the latest update written.
            keys: K distinct (role, action) keys.
            sums: four length-K sequences: sum w, sum w e, sum w e^2, sum w^2 per key.
            children: ``(hashes, weights, bounds)`` as ``children_by_key`` returns them: key i adds
                weights[j] to context hashes[j] for bounds[i] <= j < bounds[i+1] (distinct); hashes
                as hex strings or as (n, 2) uint64 digests.

        Raises:
            ValueError: ``update`` is below ``update_index`` (decay would amplify old evidence).
        """
        if update < self.update_index:
            raise ValueError(f"update_index went backwards: memory at {self.update_index}, batch at {update}")
        hashes, weights, bounds = children
        add_digest = hashes if isinstance(hashes, np.ndarray) else digests_from_hex(hashes)
        add_weight, add_bounds = np.asarray(weights, dtype=np.float64), np.asarray(bounds, dtype=np.int64)
        w, s, q, r = (np.asarray(x, dtype=np.float64) for x in sums)
        keys = keys if isinstance(keys, KeyCodes) else KeyCodes.of(keys)
        pos = self.find(keys)
        old = pos >= 0
        n_old = len(self)
        roles, role, actions, action = self.roles, self.role, self.actions, self.action
        old_to_new, target = np.arange(n_old), pos
        if not old.all():  # new keys: the name lists and the rows are merged in sorted order
            fresh = np.flatnonzero(~old)
            used_roles = [keys.roles[c] for c in np.unique(keys.role[fresh]).tolist()]
            used_actions = [keys.actions[c] for c in np.unique(keys.action[fresh]).tolist()]
            roles = sorted(set(self.roles).union(used_roles))
            actions = sorted(set(self.actions).union(used_actions))
            role_no, action_no = dict(zip(roles, range(len(roles)))), dict(zip(actions, range(len(actions))))
            role_map = np.array([role_no[n] for n in self.roles], dtype=np.int64)
            action_map = np.array([action_no[n] for n in self.actions], dtype=np.int64)
            new_role = np.array([role_no[keys.roles[c]] for c in keys.role[fresh].tolist()], dtype=np.int64)
            new_action = np.array([action_no[keys.actions[c]] for c in keys.action[fresh].tolist()], dtype=np.int64)
            role = np.concatenate((role_map[self.role], new_role))
            action = np.concatenate((action_map[self.action], new_action))
            order = np.argsort(role * len(actions) + action)
            rank = np.empty(len(order), dtype=np.int64)
            rank[order] = np.arange(len(order))
            role, action = role[order], action[order]
            old_to_new, target = rank[:n_old], np.empty(len(keys), dtype=np.int64)
            target[old], target[fresh] = rank[pos[old]], rank[n_old:]
        n = len(role)
        columns = []
        f = np.float_power(self.decay, (update - self.last[pos[old]]).astype(np.float64))  # (touched,)
        for mine, add, power in ((self.W, w, 1), (self.S, s, 1), (self.Q, q, 1), (self.R, r, 2)):
            col = np.zeros(n)
            col[old_to_new] = mine
            base = mine[pos[old]] * f
            col[target[old]] = (base * f if power == 2 else base) + add[old]
            col[target[~old]] = add[~old]
            columns.append(col)
        last = np.full(n, update, dtype=np.int64)
        last[old_to_new] = self.last
        last[target] = update
        # children: the old ones (decayed and pruned where their record is touched at another update)
        # and the added ones, merged per record in digest order
        per_record = np.ones(n_old)
        per_record[pos[old]] = f
        owner_old = np.repeat(np.arange(n_old), np.diff(self.bounds))
        f_entry = per_record[owner_old]
        decayed = self.weight * f_entry
        alive = (f_entry == 1.0) | (decayed > CHILD_PRUNE)
        owner = np.concatenate((old_to_new[owner_old[alive]], np.repeat(target, np.diff(add_bounds))))
        digest = np.concatenate((self.digest[alive], add_digest))
        weight = np.concatenate((np.where(f_entry == 1.0, self.weight, decayed)[alive], add_weight))
        order = order_by_group_and_digest(owner, n, digest)
        owner, digest, weight = owner[order], digest[order], weight[order]
        start = run_starts(owner, digest)
        first = np.flatnonzero(start)
        weight = np.add.reduceat(weight, first) if len(first) else weight  # a repeated context: added + old
        owner, digest = owner[first], digest[first]
        child_bounds = np.concatenate(([0], np.cumsum(np.bincount(owner, minlength=n)))).astype(np.int64)
        memory = BLPOMemory._of_columns(self.half_life, roles, role, actions, action, *columns, last, child_bounds,
                                        digest, weight, max(self.update_index, update))  # fmt: skip
        if roles is self.roles and actions is self.actions:  # the same names: their lookups carry over
            memory._role_no, memory._action_no, memory._numbered = self._role_no, self._action_no, self._numbered
        return memory

    def to_json_dict(self) -> dict[str, Any]:
        """JSON-serialisable snapshot; records sorted by (role, action), children by hash."""
        hashes, weights = hex_from_digests(self.digest), self.weight.tolist()
        bounds = self.bounds.tolist()
        W, S, Q, R, last = (c.tolist() for c in (self.W, self.S, self.Q, self.R, self.last))
        return {
            "version": JSON_VERSION,
            "half_life": self.half_life,
            "update_index": self.update_index,
            "records": [
                {"role": role, "action": action, "W": W[i], "S": S[i], "Q": Q[i], "R": R[i], "last_update": last[i],
                 "children": dict(zip(hashes[bounds[i] : bounds[i + 1]], weights[bounds[i] : bounds[i + 1]]))}
                for i, (role, action) in enumerate(self.keys())
            ],
        }  # fmt: skip

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
                {str(k): float(v) for k, v in d["children"].items()},
            )
            for d in payload["records"]
        }
        return cls(half_life, records, int(payload.get("update_index", -1)))

    def records(self) -> list[dict[str, Any]]:
        """Flat rows (role, action, W, S, Q, R, last_update, n_children, mean) of the stored records."""
        W, S, Q, R, last = (c.tolist() for c in (self.W, self.S, self.Q, self.R, self.last))
        n_children = np.diff(self.bounds).tolist()
        return [
            {"role": role, "action": action, "W": W[i], "S": S[i], "Q": Q[i], "R": R[i], "last_update": last[i],
             "n_children": n_children[i], "mean": S[i] / W[i] if W[i] > 0.0 else 0.0}
            for i, (role, action) in enumerate(self.keys())
        ]  # fmt: skip


@dataclass(frozen=True)
class ProgressRead:
    """How A^P is read from the memory (2.7 (f)-(g)). Built by ``BLPOParams.progress_read``, where the
    defaults live: none here, so a read cannot quietly use settings other than the run's."""

    mode: str  # "mean_std_norm" | "mean_norm"
    confidence: bool  # reliability-weighted A^P (BLPOParams.role_confidence)
    tau: float
    support_scale: float
    std_floor: float
    eps: float


def read_progress_keys(
    memory: BLPOMemory,
    keys: KeyCodes,
    update: int,
    read: ProgressRead,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """A^P, its activity and m_a of each (role, action) key, read at ``update`` (2.7 (f)-(g)).

    ``role_progress_advantage`` over ``memory.role_records(role, update, eps)`` for every role of
    ``keys``, as one numpy pass over the roles' records and children (grouped by role; per-role sums
    in the records' and children's order, so the bits are those of the plain read). A key without a
    record of W > eps gets (0, False, 0).

    Returns:
        ``(adv, active, score, n_active_roles)``: three (len(keys),) arrays and the number of active
        roles among the keys' distinct roles.
    """
    role_bounds = memory.role_bounds
    key_role = memory.role_numbers(keys.roles)[keys.role]
    roles = np.unique(key_role[key_role >= 0])  # (G,) memory role numbers read
    rows, seg = segments(role_bounds[roles], role_bounds[roles + 1])  # records of those roles, by role
    f = np.float_power(memory.decay, (update - memory.last[rows]).astype(np.float64))
    W, S, Q, R = memory.W[rows] * f, memory.S[rows] * f, memory.Q[rows] * f, memory.R[rows] * f * f
    kept = W > read.eps  # role_records: W > eps after decay
    rows, seg, f, W, S, Q, R = (x[kept] for x in (rows, seg, f, W, S, Q, R))
    n_roles = len(roles)
    # children of the kept records, decayed and pruned (``MomentRecord.decayed``)
    entry, owner = segments(memory.bounds[rows], memory.bounds[rows + 1])  # owner: kept record 0..n-1
    f_entry = f[owner]
    child_w = memory.weight[entry] * f_entry
    alive = (f_entry == 1.0) | (child_w > CHILD_PRUNE)
    entry, owner, child_w = entry[alive], owner[alive], np.where(f_entry == 1.0, memory.weight[entry], child_w)[alive]
    # per role: m_a, M, s^2 (sums in action order)
    k = np.bincount(seg, minlength=n_roles)
    score = S / W
    mean = np.bincount(seg, weights=score, minlength=n_roles) / np.maximum(k, 1)
    dev2 = np.float_power(score - mean[seg], 2.0)
    var = np.where(k >= 2, np.bincount(seg, weights=dev2, minlength=n_roles) / np.maximum(k - 1, 1), 0.0)
    # role_support: each context at its max weight over the role's actions, summed in first-seen order
    child_seg = seg[owner]
    order = order_by_group_and_digest(child_seg, n_roles, memory.digest[entry])
    start = run_starts(child_seg[order], memory.digest[entry][order])
    first = np.flatnonzero(start)
    if len(first):
        support = np.maximum.reduceat(child_w[order], first)
        seen = np.minimum.reduceat(order, first)  # first appearance: records in action order, digests sorted
        by_seen = np.argsort(seen)
        support, support_seg = support[by_seen], child_seg[order][first][by_seen]
    else:
        support, support_seg = child_w[:0], child_seg[:0]
    total = np.bincount(support_seg, weights=support, minlength=n_roles)
    square = np.bincount(support_seg, weights=support * support, minlength=n_roles)
    n_eff = np.where(square > 0.0, total * total / np.where(square > 0.0, square, 1.0), 0.0)
    role_active = (var > read.eps * read.eps) & (n_eff >= 2.0 - N_EFF_TOL)
    centered = score - mean[seg]
    s = np.sqrt(var)[seg]
    if read.mode == "mean_norm":
        adv = centered
    elif not read.confidence:
        adv = centered / np.maximum(np.maximum(s, read.std_floor), read.eps)
    else:
        n_kept = len(rows)
        total = np.bincount(owner, weights=child_w, minlength=n_kept)
        square = np.bincount(owner, weights=child_w * child_w, minlength=n_kept)
        n = np.where(square > 0.0, total * total / np.where(square > 0.0, square, 1.0), 0.0)  # kish per action
        denom = W - R / W
        v = np.where(denom > read.eps, np.maximum(Q - S * S / W, 0.0) / np.where(denom > read.eps, denom, 1.0), 0.0)
        se2 = v / np.maximum(n, 1.0)
        has_inverse = n > read.eps
        inverse = np.where(has_inverse, 1.0 / np.where(has_inverse, n, 1.0), 0.0)
        inverse_total = np.bincount(seg, weights=inverse, minlength=n_roles)[seg]
        se2_total = np.bincount(seg, weights=se2, minlength=n_roles)[seg]
        others = np.bincount(seg, weights=has_inverse, minlength=n_roles)[seg] - has_inverse
        rest = inverse_total - inverse
        n_others = np.where(others > 0, others / np.where(others > 0, rest, 1.0), 0.0)  # HM({n_b : b != a})
        a_in, b_in = n > read.eps, n_others > read.eps
        harmonic = np.where(a_in, inverse, 0.0) + np.where(b_in, 1.0 / np.where(b_in, n_others, 1.0), 0.0)
        count = a_in.astype(np.float64) + b_in
        n_cmp = np.where(count > 0, count / np.where(count > 0, harmonic, 1.0), 0.0)
        kappa = n_cmp / (n_cmp + read.support_scale)
        kk = k[seg]
        se2_diff = np.float_power((kk - 1) / kk, 2.0) * se2 + (se2_total - se2) / (kk * kk)
        adv = kappa * centered / np.maximum(np.sqrt(var[seg] + se2_diff + read.tau * read.tau), read.eps)
    active = role_active[seg]
    adv = np.where(active, adv, 0.0)
    # the keys' records
    slot = np.full(len(memory) + 1, -1, dtype=np.int64)  # last: keys without a record
    slot[rows] = np.arange(len(rows))
    at = slot[memory.find(keys)]
    found = at >= 0
    pick = np.where(found, at, 0)
    out = [np.where(found, x[pick], z) if len(rows) else np.full(len(keys), z) for x, z in
           ((adv, 0.0), (active, False), (score, 0.0))]  # fmt: skip
    return out[0], out[1], out[2], int(role_active.sum())


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
    read: ProgressRead,
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
    if var <= read.eps * read.eps:
        return RoleRead(False, {}, score, 0.0)
    n_eff = role_support(records)
    if n_eff < 2.0 - N_EFF_TOL:
        return RoleRead(False, {}, score, n_eff)
    s = math.sqrt(var)
    centered = {a: score[a] - mean for a in actions}
    if read.mode == "mean_norm":
        return RoleRead(True, centered, score, n_eff)
    if not read.confidence:
        return RoleRead(True, {a: c / max(s, read.std_floor, read.eps) for a, c in centered.items()}, score, n_eff)
    n = {a: kish_n_eff(list(records[a].children.values())) for a in actions}
    se2 = {a: effect_variance(records[a], read.eps) / max(n[a], 1.0) for a in actions}
    inverse = {a: 1.0 / n[a] for a in actions if n[a] > read.eps}  # HM terms; sums over b != a use totals
    inverse_total, se2_total = sum(inverse.values()), sum(se2.values())
    adv = {}
    for a in actions:
        others = len(inverse) - (a in inverse)
        n_others = others / (inverse_total - inverse.get(a, 0.0)) if others else 0.0  # HM({n_b : b != a})
        n_cmp = harmonic_mean([n[a], n_others], read.eps)
        kappa = n_cmp / (n_cmp + read.support_scale)
        se2_diff = ((k - 1) / k) ** 2 * se2[a] + (se2_total - se2[a]) / (k * k)
        adv[a] = kappa * centered[a] / max(math.sqrt(var + se2_diff + read.tau * read.tau), read.eps)
    return RoleRead(True, adv, score, n_eff)


def children_by_key(key_index: np.ndarray, context: np.ndarray, n_keys: int, context_values: list) -> tuple:
    """Per written key, its contexts' digests in sorted order and the weight each gets (2.7 (d)).

    Args:
        key_index: (E,) key of each effect, 0..n_keys-1; context: (E,) context code of each effect.

    Returns:
        ``(digests, weights, bounds)``: (C, 2) uint64 ``context_digests``, (C,) float64 and
        (n_keys + 1,) int64, key i owning entries bounds[i]:bounds[i+1]; the weight of a context is its
        number of effects (w = 1). Each distinct context is hashed once.
    """
    used = distinct(context)
    digest_of = np.zeros((len(context_values), 2), dtype=np.uint64)
    digest_of[used] = context_digests([context_values[c] for c in used.tolist()])
    digest = digest_of[context]
    order = order_by_group_and_digest(key_index, n_keys, digest)
    owner, digest = key_index[order], digest[order]
    first = np.flatnonzero(run_starts(owner, digest))
    weights = np.diff(np.append(first, len(order))).astype(np.float64)
    bounds = np.concatenate(([0], np.cumsum(np.bincount(owner[first], minlength=n_keys)))).astype(np.int64)
    return digest[first], weights, bounds
