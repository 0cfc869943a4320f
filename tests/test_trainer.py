"""The PPO update (horizonrl/training/trainer.py) on the tiny policy, on CPU, one piece at a time.

Rows are built by hand (token ids drawn from the model's vocabulary, policy tokens in several turns with
observation tokens between them), so each test controls lengths, turns and advantages exactly. A
gradient is read by an optimizer that records it (no clipping takes effect: grad_clip 1e9).
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections import Counter

import numpy as np
import pytest
import torch

import methods
from horizonrl import store
from horizonrl.config import load_config
from horizonrl.engines.base import allowed_log_softmax
from horizonrl.models.loading import load_policy
from horizonrl.rollout.loop import SamplingSettings, collect
from horizonrl.training.packing import pack, unique_tokens
from horizonrl.training.sequences import TrainRow, train_rows
from horizonrl.training.trainer import (
    PI_OLD_CHECK_ROWS,
    UpdateSettings,
    _chunks,
    _minibatch_step,
    annealed_lr,
    length_buckets,
    old_logprobs,
    policy_logprobs,
    ppo_update,
    recompute_old_logprobs,
    response_positions,
    trajectory_units,
)

LOOP = methods.LOSSES.get("ppo_clip").params_cls(clip_mode="loop", eps=0.1, aggregation="seq-mean-token-mean")
TOKEN_MEAN = methods.LOSSES.get("ppo_clip").params_cls(clip_mode="asymmetric", aggregation="token-mean")
SUM_NORM = methods.LOSSES.get("ppo_clip").params_cls(
    clip_mode="asymmetric", aggregation="seq-mean-token-sum-norm", norm_length=96
)


def settings(pad_id: int, **overrides) -> UpdateSettings:
    values = dict(
        loss_name="ppo_clip",
        loss_params=LOOP,
        epochs=1,
        minibatch_size=8,
        fixed_row_divisor=False,
        grad_clip=1e9,
        high_kl_threshold=1e9,
        temperature=1.0,
        micro_batch_tokens=1_000_000,
        pad_id=pad_id,
    )
    return UpdateSettings(**{**values, **overrides})


def hand_rows(vocab: int, n: int, seed: int = 0) -> list[TrainRow]:
    """``n`` full-context trajectories of 1-3 turns: a prompt, then per turn 2-5 policy tokens followed by
    3-9 observation tokens; lengths spread from ~10 to ~50 so that length buckets split them."""
    rng = random.Random(seed)
    rows = []
    for rid in range(n):
        ids = [rng.randrange(4, vocab) for _ in range(rng.randint(3, 8))]
        positions, turn_id = [], []
        for turn in range(rng.randint(1, 3)):
            for _ in range(rng.randint(2, 5)):
                positions.append(len(ids))
                turn_id.append(turn)
                ids.append(rng.randrange(4, vocab))
            ids += [rng.randrange(4, vocab) for _ in range(rng.randint(3, 9))]
        adv = [(1.0 if rid % 2 else -0.5) + 0.1 * rid] * len(positions)
        rows.append(
            TrainRow(
                rid,
                -1,
                ids,
                positions,
                [[] for _ in positions],
                [0.0] * len(positions),
                turn_id,
                list(range(len(positions))),
                adv,
            )
        )
    return rows


@pytest.fixture(scope="module")
def setup(tiny_policy_dir):
    torch.manual_seed(0)
    model, tokenizer = load_policy(tiny_policy_dir)
    rows = hand_rows(model.get_output_embeddings().weight.shape[0], 12)
    s = settings(tokenizer.pad_token_id)
    return model, rows, recompute_old_logprobs(model, rows, s), s


class GradientRecorder(torch.optim.Optimizer):
    """An optimizer whose step keeps a copy of every gradient (the clipped one the trainer steps with)
    and leaves the weights alone; ``grads`` stays None when the trainer skips the step."""

    def __init__(self, params) -> None:
        super().__init__(params, {})
        self.grads: list[torch.Tensor] | None = None

    def step(self, closure=None) -> None:
        params = [p for group in self.param_groups for p in group["params"]]
        self.grads = [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in params]


def gradient(model: torch.nn.Module, rows, old, mb, s: UpdateSettings) -> tuple[list[torch.Tensor] | None, dict]:
    """The gradient one ``_minibatch_step`` steps with (None: step skipped), and the step's figures."""
    model.train()
    recorder = GradientRecorder(model.parameters())
    out = _minibatch_step(model, recorder, rows, old, mb, s, None, Counter())
    return recorder.grads, out


def assert_same(a: list[torch.Tensor], b: list[torch.Tensor], scale: float = 1.0) -> None:
    for x, y in zip(a, b):
        torch.testing.assert_close(x * scale, y, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize(
    "loss_params", [LOOP, TOKEN_MEAN, SUM_NORM], ids=["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"]
)
def test_micro_batches_give_the_gradient_of_one_batch(setup, loss_params):
    model, rows, old, s = setup
    mb = trajectory_units(rows)[:8]
    small = settings(s.pad_id, loss_params=loss_params, micro_batch_tokens=60)
    assert len(_chunks(mb, rows, 60)) >= 3 and len(_chunks(mb, rows, s.micro_batch_tokens)) == 1
    whole, out_whole = gradient(model, rows, old, mb, settings(s.pad_id, loss_params=loss_params))
    split, out_split = gradient(model, rows, old, mb, small)
    assert any(float(g.abs().max()) > 1e-4 for g in whole)  # a gradient worth comparing
    assert_same(split, whole)
    assert out_split["loss"] == pytest.approx(out_whole["loss"], rel=1e-5)
    assert out_split["traj_kl"] == pytest.approx(out_whole["traj_kl"], abs=1e-5)


def test_length_buckets_give_the_values_of_one_padded_batch(setup):
    model, rows, _, s = setup
    lengths = [r.positions[-1] + 1 for r in rows]
    assert len(length_buckets(lengths)) >= 3  # the rows really run in several decoder batches
    model.eval()
    with torch.no_grad():
        logp, entropy = policy_logprobs(model, rows, 0.7, s.pad_id)
        width = max(lengths)  # reference: the whole model (head included) over one right-padded batch
        ids = torch.full((len(rows), width), s.pad_id, dtype=torch.long)
        for b, r in enumerate(rows):
            ids[b, : lengths[b]] = torch.tensor(r.input_ids[: lengths[b]])
        logits = model(input_ids=ids).logits.float() / 0.7  # (B, L, V)
        picked = torch.cat([logits[b, [p - 1 for p in r.positions]] for b, r in enumerate(rows)])  # (n, V)
        ref_all = allowed_log_softmax(picked, [a for r in rows for a in r.allowed])
        targets = torch.tensor([r.input_ids[p] for r in rows for p in r.positions])
    torch.testing.assert_close(logp, ref_all.gather(1, targets[:, None]).squeeze(1), rtol=0, atol=2e-5)
    torch.testing.assert_close(entropy, -(ref_all.exp() * ref_all).sum(-1), rtol=0, atol=2e-5)


def test_kl_early_stop_fires_at_its_threshold(setup):
    """pi_old shifted by c on every token: KL = -mean_j sum_t (log pi - log pi_old) = c * tokens / trajectories."""
    model, rows, old, s = setup
    mb = trajectory_units(rows)[:4]
    c = 0.5
    shifted = [[v + c for v in o] for o in old]
    kl = c * sum(len(rows[i].positions) for u in mb for i in u) / len(mb)
    below, out_below = gradient(model, rows, shifted, mb, settings(s.pad_id, high_kl_threshold=kl * 1.001))
    above, out_above = gradient(model, rows, shifted, mb, settings(s.pad_id, high_kl_threshold=kl * 0.999))
    assert out_below["traj_kl"] == pytest.approx(kl, rel=1e-4) and out_above["traj_kl"] == pytest.approx(kl, rel=1e-4)
    assert below is not None and any(g.any() for g in below)  # under the threshold: the step is taken
    assert above is None and out_above["grad_norm"] == 0.0  # over it: skipped

    before = [p.detach().clone() for p in model.parameters()]
    stats = ppo_update(
        model,
        torch.optim.SGD(model.parameters(), lr=1.0),
        rows,
        settings(s.pad_id, high_kl_threshold=-1.0, minibatch_size=4, epochs=2),
        seed=0,
    ).stats
    assert stats["kl_stop"] == 1.0 and stats["steps"] == 0  # |KL| > -1 on the first minibatch: the iteration ends
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))


def test_loop_fixed_row_divisor_scales_a_short_minibatch(setup):
    """LOOP divides by the minibatch size B = 8 even when only 3 trajectories are left (docs/algorithms.md §1.5):
    its gradient is 3/8 of the one divided by the 3 rows it has."""
    model, rows, old, s = setup
    mb = trajectory_units(rows)[:3]
    fixed, _ = gradient(model, rows, old, mb, settings(s.pad_id, fixed_row_divisor=True))
    free, _ = gradient(model, rows, old, mb, settings(s.pad_id, fixed_row_divisor=False))
    assert any(float(g.abs().max()) > 1e-4 for g in free)
    assert_same(fixed, free, scale=8 / 3)


def test_appo_loss_discounts_over_response_positions(setup):
    """The trainer hands the loss each policy token's response position (observation tokens between turns
    counted, docs/algorithms.md §3.7). With pi_old = log pi - 0.01 on every token and gamma_f = 0.5:
    FutureKL_t = 0.01 sum_{k>=t} 0.5^(pos_k - pos_t), and APPO's mean_scale = 1 + mean_t exp(FutureKL_t)."""
    model, rows, old, s = setup
    i = next(i for i, r in enumerate(rows) if len(set(r.turn_id)) >= 2)  # a row with observations between turns
    pos = rows[i].positions
    assert response_positions(rows[i]) == pos and pos[-1] - pos[0] + 1 > len(pos)
    shifted = [[v - 0.01 for v in o] for o in old]
    params = methods.LOSSES.get("appo_future_kl").params_cls(decay_rate=1.0, clip_high=1.0)
    _, out = gradient(model, rows, shifted, [[i]], settings(s.pad_id, loss_name="appo_future_kl", loss_params=params))

    def mean_scale(p: list[int]) -> float:
        fkl = [0.01 * sum(0.5 ** (p[k] - p[t]) for k in range(t, len(p))) for t in range(len(p))]
        return 1 + sum(math.exp(x) for x in fkl) / len(fkl)

    assert out["mean_scale"] == pytest.approx(mean_scale(pos), abs=2e-6)
    assert abs(mean_scale(pos) - mean_scale(list(range(len(pos))))) > 1e-3  # policy-token distances differ
    window = TrainRow(7, 1, [5, 6, 7, 8], [2, 3], [[], []], [0.0, 0.0], [1, 1], [4, 5], [1.0, 1.0])
    assert response_positions(window) == [4, 5]  # window context: index among the trajectory's action tokens


@pytest.fixture(scope="module")
def sampled_rows(tiny_policy, household_suite) -> list[TrainRow]:
    """Full-context admissible rollouts of the tiny policy at T = 0.7 (2 tasks x 4, up to 5 turns), with
    fixed random advantages: the rows the flow's update gets, log-probs read back from the turns table."""
    _, _, fmt, engine = tiny_policy
    records = collect(
        household_suite,
        household_suite.tasks("train", "easy", 2),
        4,
        engine,
        fmt,
        SamplingSettings("admissible", "full", 2, 5, 12, 0.7, seed=3),
    )
    rows = [r for r in train_rows(store.turns_table(records), "full") if r.positions]
    rng = random.Random(0)
    for r in rows:
        r.adv = [rng.gauss(0.0, 1.0)] * len(r.positions)
    assert len(rows) == 8 and any(any(a) for r in rows for a in r.allowed)  # renormalised over allowed ids
    return rows


def _update(tiny_policy_dir, rows: list[TrainRow], s: UpdateSettings) -> tuple[list[torch.Tensor], dict[str, float]]:
    """Weights and figures after one ``ppo_update`` (2 epochs of AdamW) from the tiny policy's initial weights."""
    model, _ = load_policy(tiny_policy_dir)
    stats = ppo_update(model, torch.optim.AdamW(model.parameters(), lr=1e-3), rows, s, seed=5).stats
    return [p.detach().clone() for p in model.parameters()], stats


def test_pi_old_shortcut_gives_the_update_of_the_recompute(tiny_policy_dir, tiny_policy, sampled_rows):
    """The sampler was this model: its stored log-probs pass the check (max |diff| <= update.pi_old_tol, in
    fact <= 1e-4 on CPU float32) and the update with them as pi_old gives the recompute's loss and weights
    up to that difference; the recompute path logs no shortcut figures."""
    pad = tiny_policy[1].pad_token_id
    base = dict(temperature=0.7, minibatch_size=4, epochs=2, grad_clip=1.0)
    recomputed, stats_r = _update(tiny_policy_dir, sampled_rows, settings(pad, **base))
    shortcut, stats_s = _update(tiny_policy_dir, sampled_rows, settings(pad, **base, pi_old_tol=1e-3))
    assert "pi_old_shortcut" not in stats_r
    assert stats_s["pi_old_shortcut"] == 1.0 and 0.0 < stats_s["pi_old_max_diff"] <= 1e-4
    assert stats_s["steps"] == stats_r["steps"] == 4
    assert stats_s["loss"] == pytest.approx(stats_r["loss"], abs=1e-5)
    assert stats_s["approx_kl"] == pytest.approx(stats_r["approx_kl"], abs=1e-5)
    initial = [p.detach() for p in load_policy(tiny_policy_dir)[0].parameters()]
    moved = max(float((a - b).abs().max()) for a, b in zip(recomputed, initial))
    assert moved > 1e-3  # the update really moved the weights
    for a, b in zip(shortcut, recomputed):
        torch.testing.assert_close(a, b, rtol=0, atol=moved * 1e-2)


def test_pi_old_falls_back_to_the_recompute_when_stored_logprobs_differ(tiny_policy_dir, tiny_policy, sampled_rows):
    """Stored log-probs shifted by 0.01 (another sampler): the checked rows differ by more than the tolerance,
    every row is recomputed and the update is exactly the recompute's."""
    pad = tiny_policy[1].pad_token_id
    base = dict(temperature=0.7, minibatch_size=4, epochs=2, grad_clip=1.0)
    perturbed = [
        TrainRow(
            r.rollout_id,
            r.turn,
            r.input_ids,
            r.positions,
            r.allowed,
            [v + 0.01 for v in r.sample_logp],
            r.turn_id,
            r.flat_index,
            r.adv,
        )
        for r in sampled_rows
    ]
    recomputed, stats_r = _update(tiny_policy_dir, sampled_rows, settings(pad, **base))
    fallback, stats_f = _update(tiny_policy_dir, perturbed, settings(pad, **base, pi_old_tol=1e-3))
    assert stats_f["pi_old_shortcut"] == 0.0 and stats_f["pi_old_max_diff"] == pytest.approx(0.01, abs=2e-4)
    assert stats_f["loss"] == stats_r["loss"]
    assert all(torch.equal(a, b) for a, b in zip(fallback, recomputed))
    old, figures = old_logprobs(
        load_policy(tiny_policy_dir)[0], perturbed, settings(pad, temperature=0.7, pi_old_tol=0.02), seed=5
    )
    assert figures["pi_old_shortcut"] == 1.0 and old == [
        r.sample_logp for r in perturbed
    ]  # within a looser tolerance: used
    assert PI_OLD_CHECK_ROWS < len(sampled_rows)  # only a sample is recomputed for the check


@pytest.mark.parametrize(
    "overrides, sampled_here, eligible",
    [
        ([], True, True),
        ([], False, False),  # rollouts reused from the store (a resumed run): recomputed
        (["update.pi_old_tol=null"], True, False),
        (["engine.name=vllm"], True, False),
        (["model.lora.rank=4"], True, False),
        (["rollout.runner=ray"], True, False),
    ],
)
def test_pi_old_shortcut_only_where_the_sampler_is_the_learner(overrides, sampled_here, eligible):
    cfg = load_config("configs/loop_household_easy.yaml", overrides)
    s = UpdateSettings.from_config(cfg, 0, sampled_here=sampled_here)
    assert s.pi_old_tol == (cfg.update.pi_old_tol if eligible else None)


def test_a_vllm_sampler_recomputes_every_row_and_reports_the_largest_difference(
    tiny_policy_dir, tiny_policy, sampled_rows
):
    """Another sampler (a vLLM server): pi_old is the learner's recompute of every row, and
    ``pi_old_max_diff`` is the largest |stored - recomputed| over all of them (one row moved by 0.05 shows)."""
    pad = tiny_policy[1].pad_token_id
    s = settings(pad, temperature=0.7, measure_sampler=True)
    model = load_policy(tiny_policy_dir)[0]
    old, figures = old_logprobs(model, sampled_rows, s, seed=5)
    assert old == old_logprobs(model, sampled_rows, settings(pad, temperature=0.7), seed=5)[0]
    assert set(figures) == {"pi_old_max_diff"} and figures["pi_old_max_diff"] <= 1e-4
    last = sampled_rows[-1]
    moved = [*sampled_rows[:-1], dataclasses.replace(last, sample_logp=[v - 0.05 for v in last.sample_logp])]
    assert old_logprobs(model, moved, s, seed=5)[1]["pi_old_max_diff"] == pytest.approx(0.05, abs=2e-4)
    cfg = load_config("configs/loop_household_easy.yaml", ["engine.name=vllm"])
    assert UpdateSettings.from_config(cfg, 0, sampled_here=True).measure_sampler


def test_annealed_lr_is_linear_from_lr_to_lr_final_over_the_iterations():
    assert [annealed_lr(2e-3, None, i, 70) for i in (1, 35, 70)] == [2e-3] * 3
    rates = [annealed_lr(2e-3, 0.0, i, 70) for i in range(1, 71)]
    assert rates[0] == 2e-3 and rates[-1] == 0.0 and rates[23] == pytest.approx(2e-3 * (1 - 23 / 69))
    assert all(a > b for a, b in zip(rates, rates[1:]))
    assert annealed_lr(1e-3, 5e-4, 1, 1) == 1e-3, "a one-iteration run trains at lr"


def shared_prefix_rows(vocab: int) -> list[TrainRow]:
    """``hand_rows`` in groups of 3 behind a common prompt of their group (a task's group), plus a branch
    (a row's first tokens, then its own) and a row that is wholly a prefix of another: the prefixes the
    tree layout places once."""
    rng = random.Random(1)
    rows, prompts = [], [[rng.randrange(4, vocab) for _ in range(8)] for _ in range(3)]
    for r in hand_rows(vocab, 9, seed=2):
        prompt = prompts[r.rollout_id // 3]
        k = len(prompt)
        rows.append(dataclasses.replace(r, input_ids=prompt + r.input_ids, positions=[p + k for p in r.positions]))
    parent = rows[4]
    cut = parent.positions[1] + 1
    tail = [rng.randrange(4, vocab) for _ in range(6)]
    rows.append(
        dataclasses.replace(
            parent, rollout_id=9, input_ids=parent.input_ids[:cut] + tail, positions=[*parent.positions[:2], cut + 1]
        )
    )
    short = dataclasses.replace(parent, rollout_id=10, positions=parent.positions[:1])  # cut after its first token
    rows.append(dataclasses.replace(short, turn_id=short.turn_id[:1], flat_index=[0], adv=short.adv[:1]))
    for r in rows[-2:]:
        n = len(r.positions)
        r.allowed, r.sample_logp, r.turn_id, r.flat_index, r.adv = (
            [[]] * n,
            [0.0] * n,
            [0] * n,
            list(range(n)),
            [0.7] * n,
        )
    return rows


def test_pack_places_every_row_and_each_shared_prefix_once():
    rows = shared_prefix_rows(60)
    seqs = [np.asarray(r.input_ids[: r.positions[-1] + 1]) for r in rows]
    for share in (False, True):
        p = pack(seqs, share, torch.device("cpu"))
        for seq, index in zip(seqs, p.index):
            assert p.ids[0, index].tolist() == seq.tolist()
            assert p.position_ids[0, index].tolist() == list(range(len(seq)))
        assert p.ids.shape[1] == (unique_tokens(seqs) if share else sum(map(len, seqs)))
    assert unique_tokens(seqs) < sum(map(len, seqs)) - 3 * 16  # the groups' prompts and the branch's prefix


@pytest.mark.parametrize("packing", ["packed", "tree"])
@pytest.mark.parametrize("micro_batch_tokens", [1_000_000, 120], ids=["one-micro-batch", "micro-batches"])
def test_packed_layouts_give_the_padded_gradient(tiny_policy_dir, packing, micro_batch_tokens):
    """update.packing (docs/algorithms.md §1.6): the same minibatch step through packed rows (no padding) or
    the tree (shared prefixes once) gives the padded buckets' loss within 1e-6 and gradient within 1e-5."""
    model, tokenizer = load_policy(tiny_policy_dir)
    rows = shared_prefix_rows(model.get_output_embeddings().weight.shape[0])
    units = trajectory_units(rows)
    s = settings(tokenizer.pad_token_id, minibatch_size=len(units), micro_batch_tokens=micro_batch_tokens)
    old = [[lp - 0.05 * (j % 3) for j, lp in enumerate(c)] for c in recompute_old_logprobs(model, rows, s)]
    results = {}
    for mode in ("off", packing):
        model.train()
        recorder, counts = GradientRecorder(model.parameters()), Counter()
        out = _minibatch_step(model, recorder, rows, old, units, dataclasses.replace(s, packing=mode), None, counts)
        results[mode] = recorder.grads, out, counts
    (padded, out_p, c_p), (packed, out_k, c_k) = results["off"], results[packing]
    assert c_p["computed_tokens"] > c_p["real_tokens"] and max(float(g.abs().max()) for g in padded) > 1e-3
    assert c_k["computed_tokens"] == (c_k["unique_tokens"] if packing == "tree" else c_p["real_tokens"])
    assert packing == "packed" or c_k["computed_tokens"] < c_p["real_tokens"] - 30  # prefixes really shared
    assert abs(out_k["loss"] - out_p["loss"]) <= 1e-6 and out_k["clip_frac"] > 0
    assert max(float((a - b).abs().max()) for a, b in zip(packed, padded)) <= 1e-5


def allowed_rows(vocab: int) -> list[TrainRow]:
    """``shared_prefix_rows`` with every other policy token sampled from an allowed set (its own id and 3
    others): admissible mode's renormalisation beside full-vocabulary tokens."""
    rng = random.Random(3)
    rows = shared_prefix_rows(vocab)
    for r in rows:
        r.allowed = [
            sorted({r.input_ids[p], *rng.sample(range(4, vocab), 3)}) if j % 2 else []
            for j, p in enumerate(r.positions)
        ]
    return rows


@pytest.mark.parametrize("packing", ["off", "packed", "tree"])
def test_chunked_logprobs_give_the_values_and_gradients_of_one_chunk(tiny_policy_dir, packing):
    """The output head in chunks of 3 positions (checkpointed: recomputed in backward) gives the log-probs,
        entropies and gradients of one chunk over every position, within 1e-6 (absolute and relative: the
    matmul's float rounding depends on how many rows it gets), under a temperature and with
        allowed-set renormalisation, in each decoder layout."""
    model, tokenizer = load_policy(tiny_policy_dir)
    vocab = model.get_output_embeddings().weight.shape[0]
    rows = allowed_rows(vocab)
    n = sum(len(r.positions) for r in rows)
    weights = torch.linspace(-1.0, 1.0, n)
    results = {}
    for chunk in (n * vocab, 3 * vocab):
        model.zero_grad(set_to_none=True)
        logp, ent = policy_logprobs(model, rows, 0.7, tokenizer.pad_token_id, packing=packing, logit_chunk=chunk)
        (logp * weights).sum().backward()
        results[chunk] = logp.detach(), ent, [p.grad.clone() for p in model.parameters()]
    (whole_lp, whole_ent, whole_g), (lp, ent, g) = results.values()
    assert lp.shape == (n,) and torch.isfinite(lp).all() and (lp < 0).all()
    assert not ent.requires_grad and float(ent.min()) > 0
    torch.testing.assert_close(lp, whole_lp, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ent, whole_ent, rtol=1e-6, atol=1e-6)
    scale = max(float(x.abs().max()) for x in whole_g)
    drift = max(float((a - b).abs().max()) for a, b in zip(g, whole_g))
    assert scale > 1e-3 and drift <= 1e-6 * scale
    allowed_at = torch.tensor([bool(a) for r in rows for a in r.allowed])
    free, _ = policy_logprobs(model, [dataclasses.replace(r, allowed=[[]] * len(r.allowed)) for r in rows], 0.7, 0)
    assert (lp[allowed_at] > free.detach()[allowed_at] + 1e-3).all()  # renormalised over 4 ids, not V


def test_chunked_logprobs_keep_no_full_logits_for_backward(tiny_policy_dir):
    """What autograd keeps from forward to backward outside the checkpointed chunks holds no (m, V) tensor
    of more positions than a chunk; one chunk over every position keeps the (n, V) log-softmax."""
    model, tokenizer = load_policy(tiny_policy_dir)
    head = model.get_output_embeddings().weight
    vocab = head.shape[0]
    rows = allowed_rows(vocab)
    n = sum(len(r.positions) for r in rows)
    widest = {}
    for chunk in (n * vocab, 3 * vocab):
        saved: list[tuple[int, ...]] = []

        def keep(t: torch.Tensor, saved=saved) -> torch.Tensor:
            if t.data_ptr() != head.data_ptr():  # the head's (V, H) weight is kept by any path
                saved.append(tuple(t.shape))
            return t

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            policy_logprobs(model, rows, 1.0, tokenizer.pad_token_id, logit_chunk=chunk)
        widest[chunk] = max((s[0] for s in saved if len(s) == 2 and s[1] == vocab), default=0)
    assert widest[n * vocab] == n and widest[3 * vocab] == 0
