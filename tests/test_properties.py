"""Property tests: every registered advantage estimator on random batches, degenerate ones included.

Batches are drawn by hypothesis (bounded ``max_examples``, no deadline): one or several task groups,
single-trajectory groups, one-turn and one-token rows, all-equal returns, no progress-active role
(BLPO), all actions invalid, and the empty batch the advantage task hands over when every episode of an
iteration errored. Checked for every name in ``methods.ADVANTAGES``: finite output of the right shapes;
exact zeros where the spec says zero (docs/algorithms.md §0.4, §2.12, §3.11); results that follow the rows when
trajectories are reordered; and the spec's vectors (1.3, 3.5, the BLPO example of issue 15) unchanged by
other task groups in the same batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import methods
from methods.types import AdvantageResult, StepBatch

NAMES = methods.ADVANTAGES.names()
GROUP_LOCAL = ("loo", "grpo", "drgrpo", "rloo", "gigpo", "blpo", "appo")  # one group's values ignore the others
PROPERTY = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass
class Traj:
    """One trajectory of a drawn batch: per-turn columns, and its lineage for APPO."""

    group: int
    rewards: list[float]
    n_tokens: list[int]
    obs: list[str]
    actions: list[str]
    roles: list[str]
    abstract: list[str]
    valid: list[bool]
    kind: int = 0
    parent: int = -1  # index of the parent trajectory in the drawn list (branches only)
    split: int = -1


def to_batch(trajs: list[Traj], order: list[int] | None = None, update_index: int = 0) -> StepBatch:
    """The trajectories (in ``order``) as one StepBatch with every column an estimator may read.

    Trajectory ids are the drawn indices, so a reordered batch names the same trajectories.
    """
    order = list(range(len(trajs))) if order is None else order
    cols: dict[str, list] = {
        k: []
        for k in (
            "group_id",
            "traj_id",
            "turn",
            "reward",
            "ret",
            "n",
            "obs",
            "action",
            "valid",
            "role",
            "abstract",
            "context",
            "kind",
            "parent",
            "split",
        )
    }
    for j in order:
        t = trajs[j]
        for turn, r in enumerate(t.rewards):
            for key, value in (
                ("group_id", t.group),
                ("traj_id", j),
                ("turn", turn),
                ("reward", r),
                ("ret", float(sum(t.rewards))),
                ("n", t.n_tokens[turn]),
                ("obs", t.obs[turn]),
                ("action", t.actions[turn]),
                ("valid", t.valid[turn]),
                ("role", t.roles[turn]),
                ("abstract", t.abstract[turn]),
                ("context", f"family|{t.obs[turn]}"),
                ("kind", t.kind),
                ("parent", t.parent),
                ("split", t.split),
            ):
                cols[key].append(value)
    obj = lambda name: np.asarray(cols[name], dtype=object)  # noqa: E731
    return StepBatch(
        group_id=np.asarray(cols["group_id"], np.int64),
        traj_id=np.asarray(cols["traj_id"], np.int64),
        turn=np.asarray(cols["turn"], np.int64),
        reward=np.asarray(cols["reward"], np.float64),
        episode_return=np.asarray(cols["ret"], np.float64),
        n_tokens=np.asarray(cols["n"], np.int64),
        update_index=update_index,
        anchor_obs=obj("obs"),
        action=obj("action"),
        valid=np.asarray(cols["valid"], bool),
        format_valid=np.asarray(cols["valid"], bool),
        progress_key=obj("role"),
        abstract_action=obj("abstract"),
        context_id=obj("context"),
        shareable=np.ones(len(cols["n"]), bool),
        kind=np.asarray(cols["kind"], np.int8),
        parent_traj=np.asarray(cols["parent"], np.int64),
        branch_token=np.asarray(cols["split"], np.int64),
        extras={"branch_score": np.linspace(0.1, 1.0, len(cols["n"]))},
    )


@st.composite
def trajectories(draw, group_sizes: list[int] | None = None, tied: bool = False, one_token: bool = False) -> list[Traj]:
    """Random task groups of initial rollouts, each group possibly followed by APPO branches.

    Small alphabets (two observations, three actions, two roles, two abstract labels, rewards in
    {0, 0.5, 1}) make shared observations, tied returns and idle roles common. ``tied`` gives every
    trajectory the same single reward (so every return is equal); ``one_token`` makes every row one token.
    """
    sizes = group_sizes or draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    reward = st.sampled_from([0.0, 0.5, 1.0])
    tied_reward = draw(reward) if tied else None
    out: list[Traj] = []
    for g, size in enumerate(sizes):
        first = len(out)
        for _ in range(size):
            n_turns = draw(st.integers(1, 3))
            rewards = [0.0] * n_turns
            rewards[-1] = tied_reward if tied else draw(reward)
            out.append(
                Traj(
                    group=10 * g + 3,  # group ids need not be 0..G-1
                    rewards=rewards,
                    n_tokens=[1] * n_turns
                    if one_token
                    else draw(st.lists(st.integers(1, 3), min_size=n_turns, max_size=n_turns)),
                    obs=[f"o{draw(st.integers(0, 1))}" if t else "start" for t in range(n_turns)],
                    actions=draw(
                        st.lists(st.sampled_from(["go", "take", "Take "]), min_size=n_turns, max_size=n_turns)
                    ),
                    roles=draw(st.lists(st.sampled_from(["r0", "r1"]), min_size=n_turns, max_size=n_turns)),
                    abstract=draw(st.lists(st.sampled_from(["X", "Y"]), min_size=n_turns, max_size=n_turns)),
                    valid=draw(st.lists(st.booleans(), min_size=n_turns, max_size=n_turns)),
                )
            )
        for _ in range(draw(st.integers(0, 2))):  # branches of this group's initial rollouts (APPO lineage)
            parent = draw(st.integers(first, first + size - 1))
            split = draw(st.integers(0, sum(out[parent].n_tokens) - 1))
            out.append(
                Traj(
                    out[parent].group,
                    [tied_reward if tied else draw(reward)],
                    [1 if one_token else 2],
                    ["start"],
                    ["go"],
                    ["r0"],
                    ["X"],
                    [True],
                    kind=1,
                    parent=parent,
                    split=split,
                )
            )
    return out


def run(name: str, batch: StepBatch) -> AdvantageResult:
    entry = methods.ADVANTAGES.get(name)
    return entry.fn(batch, entry.params_cls(), None)


def check_shapes_and_finite(result: AdvantageResult, batch: StepBatch) -> None:
    n = len(batch)
    assert result.adv.shape == (n,) and result.keep.shape == (n,) and result.keep.dtype == bool
    assert np.isfinite(result.adv).all()
    if result.adv_tokens is not None:
        assert result.adv_tokens.shape == (int(batch.n_tokens.sum()),)
        assert np.isfinite(result.adv_tokens).all()
    assert all(math.isfinite(v) for v in result.stats.values())


@pytest.mark.parametrize("name", NAMES)
@PROPERTY
@given(trajs=trajectories(one_token=True), single=st.booleans())
def test_one_token_rows_and_single_trajectory_groups(name, trajs, single):
    if single:  # every group one initial rollout, no branch
        trajs = [t for t in trajs if t.kind == 0]
        trajs = [Traj(**{**t.__dict__, "group": j}) for j, t in enumerate(trajs)]
    batch = to_batch(trajs)
    check_shapes_and_finite(run(name, batch), batch)


@pytest.mark.parametrize("name", NAMES)
def test_empty_batch_when_every_episode_errored(name):
    """The advantage task leaves errored episodes out; when all are, the estimator sees zero rows."""
    batch = to_batch([])
    result = run(name, batch)
    check_shapes_and_finite(result, batch)
    assert result.adv.shape == (0,)


@pytest.mark.parametrize("name", NAMES)
@PROPERTY
@given(trajs=trajectories(tied=True))
def test_all_equal_outcomes_give_zero(name, trajs):
    """Every trajectory the same return: 0 wherever a group has >= 2 members (0.4, 2.12, 3.11).

    Step methods (GiGPO, BLPO) see discounting and invalid-action penalties (2.12), so they are held to
    zero when the common return is 0 and every action is valid; so is everything else."""
    batch = to_batch(trajs)
    result = run(name, batch)
    check_shapes_and_finite(result, batch)
    ret = float(batch.episode_return[0]) if len(batch) else 0.0
    if name in ("gigpo", "blpo"):
        zero_batch = to_batch(
            [Traj(**{**t.__dict__, "rewards": [0.0] * len(t.rewards), "valid": [True] * len(t.rewards)}) for t in trajs]
        )
        assert not run(name, zero_batch).adv.any()
        return
    per_group = {
        g: len({int(j) for j, gg in zip(batch.traj_id, batch.group_id) if gg == g and trajs[j].kind == 0})
        for g in set(batch.group_id.tolist())
    }
    shared = np.array([per_group[int(g)] >= 2 for g in batch.group_id])
    if name == "reinforce_pp_baseline":  # global whitening: zero only if no group keeps its raw return
        shared = np.full(len(batch), all(per_group.values()) and (ret == 0 or min(per_group.values()) >= 2))
    if name == "appo":  # initial and branch groups tie separately; branch rows are 0 anyway
        shared = np.ones(len(batch), bool)
    assert not result.adv[shared].any()
    if result.adv_tokens is not None:
        assert not result.adv_tokens.any()


@pytest.mark.parametrize("name", NAMES)
@PROPERTY
@given(trajs=trajectories(), seed=st.integers(0, 2**16))
def test_reordering_trajectories_moves_their_values(name, trajs, seed):
    """Finite values on random batches; in another trajectory order (rows of each stay contiguous and in
    turn order) each row keeps its value, its keep flag and its token advantages (to 1e-9: group sums
    may round in another order)."""
    order = np.random.default_rng(seed).permutation(len(trajs)).tolist()
    base, moved = to_batch(trajs), to_batch(trajs, order)
    a, b = run(name, base), run(name, moved)
    check_shapes_and_finite(a, base)
    key = lambda batch: list(zip(batch.traj_id.tolist(), batch.turn.tolist()))  # noqa: E731
    where = {k: i for i, k in enumerate(key(moved))}
    perm = np.array([where[k] for k in key(base)], dtype=np.int64)
    np.testing.assert_allclose(b.adv[perm], a.adv, rtol=0, atol=1e-9)
    np.testing.assert_array_equal(b.keep[perm], a.keep)
    if a.adv_tokens is not None:
        starts = np.cumsum(moved.n_tokens) - moved.n_tokens
        tokens = (
            np.concatenate([np.arange(starts[p], starts[p] + moved.n_tokens[p]) for p in perm]) if len(perm) else []
        )
        np.testing.assert_allclose(b.adv_tokens[np.asarray(tokens, np.int64)], a.adv_tokens, rtol=0, atol=1e-9)


def spec_case(name: str) -> tuple[list[Traj], np.ndarray]:
    """The spec's vector for estimator ``name`` as trajectories of one group (id 999), and the expected
    per-row advantages (per token for APPO)."""

    def single(group: int, r: float, **extra) -> Traj:
        return Traj(
            group,
            [r],
            [extra.pop("tokens", 1)],
            ["start"],
            [extra.pop("action", "go")],
            ["r0"],
            [extra.pop("abstract", "X")],
            [True],
            **extra,
        )

    if name == "loo":  # 1.3
        return [single(999, r) for r in (1, 0, 0, 1, 0.5, 0.5)], np.array([0.6, -0.6, -0.6, 0.6, 0, 0])
    if name in ("grpo", "drgrpo", "rloo"):  # 4.1, 4.2 on R = [1, 0]: z = +-0.7071 (unbiased std), +-0.5, +-1
        expected = {"grpo": 0.5 / (math.sqrt(0.5) + 1e-6), "drgrpo": 0.5, "rloo": 1.0}[name]
        return [single(999, 1.0), single(999, 0.0)], np.array([expected, -expected])
    if name == "reinforce_pp_baseline":  # 4.5 alone in its batch: a = +-0.5, whitened: +-0.5 / sqrt(0.5 + 1e-8)
        return [single(999, 1.0), single(999, 0.0)], np.array([0.5, -0.5]) / math.sqrt(0.5 + 1e-8)
    if name in ("gigpo", "blpo"):  # issue 15: one anchor, actions go/take (X/Y), rewards [1, 0], empty memory
        z = 0.5 / (math.sqrt(0.5) + 1e-6)  # episode term and step (Exact) term are the same z-score
        return [single(999, 1.0, action="go", abstract="X"), single(999, 0.0, action="take", abstract="Y")], np.array(
            [2 * z, -2 * z]
        )
    if name == "appo":  # 3.5: four initial rollouts of 8 tokens, four branches of 6
        inits = [single(999, r, tokens=8) for r in (1.0, 0.0, 0.0, 0.0)]
        branches = [
            single(999, r, tokens=6, kind=1, parent=p, split=s)
            for r, p, s in zip((1.0, 1.0, 0.0, 0.0), (1, 1, 2, 2), (5, 2, 4, 4))
        ]
        z_init = [0.75 / (math.sqrt(0.1875) + 1e-6)] + [-0.25 / (math.sqrt(0.1875) + 1e-6)] * 3  # 1.732, -0.577
        z_br = 0.5 / (0.5 + 1e-6)  # +-1
        tokens = np.concatenate(
            [
                [z_init[0]] * 8,
                [z_init[1] + z_br] * 6 + [z_init[1]] * 2,
                [z_init[2] - z_br] * 5 + [z_init[2]] * 3,
                [z_init[3]] * 8,
                np.zeros(24),
            ]
        )
        return inits + branches, tokens
    raise AssertionError(f"no spec vector for registered estimator {name!r}: add one here")


def test_every_registered_estimator_has_a_spec_vector():
    for name in NAMES:
        spec_case(name)  # raises for an estimator registered without a vector


@pytest.mark.parametrize("name", NAMES)
def test_spec_vectors(name):
    trajs, expected = spec_case(name)
    result = run(name, to_batch(trajs))
    got = result.adv_tokens if name == "appo" else result.adv
    np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("name", GROUP_LOCAL)
@PROPERTY
@given(others=trajectories(), first=st.booleans())
def test_spec_vectors_hold_beside_other_groups(name, others, first):
    """The spec group keeps its values whatever other task groups share the batch (before or after it)."""
    trajs, expected = spec_case(name)
    shift = len(others) if not first else 0
    spec = [Traj(**{**t.__dict__, "parent": t.parent + shift if t.kind else -1}) for t in trajs]
    rest = [
        Traj(**{**t.__dict__, "parent": t.parent + (0 if not first else len(spec)) if t.kind else -1}) for t in others
    ]
    batch = to_batch(spec + rest if first else rest + spec)
    result = run(name, batch)
    if name == "appo":
        in_spec = np.repeat(batch.group_id == 999, batch.n_tokens)
        got = result.adv_tokens[in_spec]
    else:
        got = result.adv[batch.group_id == 999]
    if name == "blpo":  # other groups may write the shared (role, action) memory and add a progress term
        got = got - progress_part(batch, result)
    np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-12)


def progress_part(batch: StepBatch, result: AdvantageResult) -> np.ndarray:
    """BLPO's progress contribution on the spec group: the same batch with the role layer off, subtracted."""
    from methods.blpo import BLPOParams, blpo_advantage

    exact_only = blpo_advantage(batch, BLPOParams(layers=("exact",)), None).adv
    return (result.adv - exact_only)[batch.group_id == 999]


@PROPERTY
@given(trajs=trajectories(), center=st.booleans(), residual=st.booleans())
def test_blpo_settings_without_an_active_role(trajs, center, residual):
    """WebShop's current-batch centering and the local-residual application run on any batch, including
    early ones where no row is progress-active (issue 15: ``group_moments`` got an empty array)."""
    from methods.blpo import BLPOParams, blpo_advantage

    if center and residual:
        residual = False  # local_residual excludes current-batch centering (BLPOParams)
    params = BLPOParams(role_current_batch_center=center, role_application="local_residual" if residual else "parallel")
    batch = to_batch(trajs)
    result = blpo_advantage(batch, params, None)
    check_shapes_and_finite(result, batch)


@pytest.mark.parametrize(
    ("application", "center"), [("parallel", False), ("parallel", True), ("local_residual", False)]
)
def test_blpo_issue_15_example(application, center):
    """Two rows of one group, one anchor, actions a/b (labels A/B), one role, rewards [1, 0], empty memory:
    no role is active, so A = A^E + A^X = 2 * 0.5 / (sqrt(0.5) + 1e-6) = +-1.41421 (issue 15)."""
    from methods.blpo import BLPOParams, blpo_advantage

    trajs = [
        Traj(0, [1.0], [1], ["o"], ["a"], ["R"], ["A"], [True]),
        Traj(0, [0.0], [1], ["o"], ["b"], ["R"], ["B"], [True]),
    ]
    result = blpo_advantage(
        to_batch(trajs), BLPOParams(role_current_batch_center=center, role_application=application), None
    )
    z = 0.5 / (math.sqrt(0.5) + 1e-6)
    np.testing.assert_allclose(result.adv, [2 * z, -2 * z], rtol=1e-12)
    np.testing.assert_allclose(result.adv, [1.4142, -1.4142], atol=1e-4)
    assert result.stats["progress_active_fraction"] == 0.0
