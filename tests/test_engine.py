"""TransformersEngine: trie-constrained decoding, forced tokens, seeding, greedy, and agreement of the
sampler's log-probs with the learner's ``policy_logprobs`` on the rebuilt sequences.

Tolerances: the engine (left-padded batch, KV cache) and the learner (right-padded full forward) run
different float32 kernels on the same weights; they agree to 1e-4 in log-prob and entropy. Log-probs
read back from a table are float32.
"""

from __future__ import annotations

import math

import pytest
import torch

from horizonrl import store
from horizonrl.engines.base import SampleRequest, TokenTrie
from horizonrl.engines.hf import Session
from horizonrl.rollout.loop import SamplingSettings, collect
from horizonrl.training.sequences import train_rows
from horizonrl.training.trainer import policy_logprobs

TOL = 1e-4


def _collect(
    tiny_policy,
    suite,
    *,
    action_mode="admissible",
    context="window",
    max_turns=4,
    temperature=1.0,
    max_action_tokens=12,
    seed=0,
):
    _, _, fmt, engine = tiny_policy
    return collect(
        suite,
        suite.tasks("train", "easy", 2),
        2,
        engine,
        fmt,
        SamplingSettings(action_mode, context, 2, max_turns, max_action_tokens, temperature, seed),
    )


def _prompts(tiny_policy, suite, n: int = 3) -> tuple[list[list[int]], list[list[str]]]:
    """Prompts and admissible commands of the first state of ``n`` easy tasks; prompt i carries i earlier
    turns ('inventory' answered by 'nothing happens .') so the lengths differ."""
    fmt = tiny_policy[2]
    prompts, commands = [], []
    for i, task in enumerate(suite.tasks("train", "easy", n)):
        env = suite.make()
        obs, info = env.reset(task)
        history = (fmt.user("nothing happens .") + fmt.command("inventory")) * i
        prompts.append(fmt.system(env.goal()) + history + fmt.user(obs))
        commands.append(info["admissible_commands"])
    assert len({len(p) for p in prompts}) > 1  # left padding is exercised
    return prompts, commands


def _next_logits(model, ids: list[int]) -> torch.Tensor:
    """Last-position logits of one unpadded sequence, no cache: (V,)."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0, -1].float()


def test_admissible_actions_are_admissible_commands_with_exact_allowed_sets(tiny_policy, household_suite):
    """Over 2 tasks x 2 rollouts x 10 turns: every action is a command of the state it was played in
    (checked by replaying the deterministic environment), its ids are the command's ids, and each token's
    allowed set is exactly the next ids of the commands sharing the prefix."""
    fmt = tiny_policy[2]
    records = _collect(tiny_policy, household_suite, max_turns=10)
    n_turns = n_forced = 0
    for rec in records:
        env = household_suite.make()
        _, info = env.reset(rec.task)
        for t in rec.turns:
            commands = info["admissible_commands"]
            assert t.action in commands and t.valid and t.format_valid and t.gen.finished
            assert t.gen.token_ids == fmt.command(t.action)
            for j, tok in enumerate(t.gen.token_ids):
                prefix = t.gen.token_ids[:j]
                expected = sorted({fmt.command(c)[j] for c in commands if fmt.command(c)[:j] == prefix})
                assert t.gen.allowed[j] == expected and tok in expected
                assert t.gen.policy_mask[j] == (len(expected) > 1)
                if len(expected) == 1:  # forced: no choice, log-prob and entropy exactly 0
                    assert (t.gen.logprobs[j], t.gen.entropy[j]) == (0.0, 0.0)
                    n_forced += 1
                else:
                    assert t.gen.logprobs[j] < 0 and 0 < t.gen.entropy[j] <= math.log(len(expected)) + TOL
            _, _, _, info = env.step(t.action)
            n_turns += 1
    assert n_turns >= 20 and n_forced > 0


def test_token_budget_cuts_an_admissible_action_inside_a_command(tiny_policy, household_suite):
    _, _, fmt, engine = tiny_policy
    prompts, commands = _prompts(tiny_policy, household_suite)
    tries = [TokenTrie([fmt.command(c) for c in cs], cs) for cs in commands]
    for g, cs in zip(engine.generate(SampleRequest(prompts, tries, 2, 1.0, False, 0)), commands):
        full = [fmt.command(c) for c in cs]
        assert len(g.token_ids) == 2 and any(ids[:2] == g.token_ids for ids in full)
        assert g.finished == (g.token_ids in full)  # only a one-word command ends within 2 tokens


@pytest.mark.parametrize("admissible", [True, False])
def test_same_seed_reproduces_and_another_seed_differs(tiny_policy, household_suite, admissible):
    _, _, fmt, engine = tiny_policy
    prompts, commands = _prompts(tiny_policy, household_suite, 4)
    tries = [TokenTrie([fmt.command(c) for c in cs], cs) if admissible else None for cs in commands]
    prompts, tries = prompts * 2, tries * 2  # 8 samples: two seeds agreeing everywhere is ~impossible
    a = engine.generate(SampleRequest(prompts, tries, 8, 1.0, False, 123))
    assert engine.generate(SampleRequest(prompts, tries, 8, 1.0, False, 123)) == a
    b = engine.generate(SampleRequest(prompts, tries, 8, 1.0, False, 124))
    assert [g.token_ids for g in b] != [g.token_ids for g in a]


@pytest.mark.parametrize("admissible", [True, False])
def test_greedy_picks_the_argmax_of_an_unbatched_uncached_forward(tiny_policy, household_suite, admissible):
    """Each greedy token is the argmax of (allowed-masked) logits recomputed without padding or cache; the
    seed is irrelevant. Precondition: the top-2 gap exceeds the kernels' disagreement (1e-4)."""
    model, _, fmt, engine = tiny_policy
    prompts, commands = _prompts(tiny_policy, household_suite)
    tries = [TokenTrie([fmt.command(c) for c in cs], cs) if admissible else None for cs in commands]
    gens = engine.generate(SampleRequest(prompts, tries, 5, 0.7, True, 1))
    assert engine.generate(SampleRequest(prompts, tries, 5, 0.7, True, 2)) == gens
    for prompt, gen in zip(prompts, gens):
        for j, tok in enumerate(gen.token_ids):
            logp = torch.log_softmax(_next_logits(model, prompt + gen.token_ids[:j]) / 0.7, -1)
            if gen.allowed[j]:
                logp = torch.full_like(logp, -math.inf).index_copy(
                    0, torch.tensor(gen.allowed[j]), logp[gen.allowed[j]]
                )
                logp = torch.log_softmax(logp, -1)
            top2 = logp.topk(2).values if logp.isfinite().sum() > 1 else None
            assert top2 is None or top2[0] - top2[1] > TOL
            assert tok == int(logp.argmax()) and gen.logprobs[j] == pytest.approx(float(logp.max()), abs=TOL)


def test_free_mode_produces_text_with_full_vocabulary_distributions(tiny_policy, household_suite):
    model, tokenizer, _, _ = tiny_policy
    records = _collect(tiny_policy, household_suite, action_mode="free", max_turns=2, max_action_tokens=6)
    turns = [t for r in records for t in r.turns]
    assert any(t.action for t in turns)  # decoded text reaches the environment
    log_v = math.log(len(tokenizer))
    for t in turns:
        assert t.gen.allowed == [[] for _ in t.gen.token_ids] and all(t.gen.policy_mask)
        assert (
            t.action
            == tokenizer.decode(
                [i for i in t.gen.token_ids if i != tiny_policy[2].end_id], skip_special_tokens=True
            ).strip()
        )
    # the first token's distribution is the full softmax: entropy of all V ids, near log V for an untrained model
    r = records[0]
    logp = torch.log_softmax(_next_logits(model, r.turns[0].prompt_ids), -1)
    assert r.turns[0].gen.entropy[0] == pytest.approx(float(-(logp.exp() * logp).sum()), abs=TOL)
    assert log_v - 0.1 < r.turns[0].gen.entropy[0] <= log_v + TOL


@pytest.mark.parametrize("context", ["window", "full"])
@pytest.mark.parametrize("action_mode", ["admissible", "free"])
def test_engine_logprobs_equal_learner_logprobs_on_rebuilt_rows(tiny_policy, household_suite, context, action_mode):
    """Sampler/learner consistency at T = 0.7, including the renormalisation over allowed ids:
    |log pi_engine - log pi_learner| <= 1e-4 and the same for the entropy, at every policy token."""
    model, tokenizer, _, _ = tiny_policy
    records = _collect(
        tiny_policy, household_suite, action_mode=action_mode, context=context, temperature=0.7, max_action_tokens=6
    )
    rows = [r for r in train_rows(store.turns_table(records), context) if r.positions]
    assert len({len(r.input_ids) for r in rows}) > 1  # right padding is exercised
    with torch.no_grad():
        logp, entropy = policy_logprobs(model, rows, 0.7, tokenizer.pad_token_id)  # flat (n,), in row order
    by_turn = {(rec.rollout_id, t.turn): t.gen for rec in records for t in rec.turns}
    gen_entropy = [
        h
        for r in rows
        for t in sorted(set(r.turn_id))
        for h, m in zip(by_turn[r.rollout_id, t].entropy, by_turn[r.rollout_id, t].policy_mask)
        if m
    ]
    assert logp.tolist() == pytest.approx([lp for r in rows for lp in r.sample_logp], abs=TOL)
    assert entropy.tolist() == pytest.approx(gen_entropy, abs=TOL)


@pytest.mark.parametrize("admissible", [True, False])
def test_session_turns_equal_fresh_generation_on_the_whole_sequence(tiny_policy, household_suite, admissible):
    """A session fed only new ids per turn, with slots dropped and reordered, samples (greedy) what a
    fresh ``generate`` on the whole sequence samples, with log-probs within 1e-4."""
    _, _, fmt, engine = tiny_policy
    prompts, commands = _prompts(tiny_policy, household_suite)

    def trie(cs):
        return TokenTrie([fmt.command(c) for c in cs], cs) if admissible else None

    session, seq = engine.session(), {}
    schedule = [
        ([10, 11, 12], prompts),
        ([12, 10], [fmt.user("nothing happens ."), fmt.user("you see nothing .")]),
        ([10], [fmt.user("ok .")]),
    ]
    for slots, new_ids in schedule:
        tries = [trie(commands[s - 10]) for s in slots]
        gens = session.extend(slots, SampleRequest(new_ids, tries, 5, 0.7, True, 0))
        for s, ids, t, g in zip(slots, new_ids, tries, gens):
            seq[s] = seq.get(s, []) + ids  # the session's sequence: everything sent to the slot and sampled
            fresh = engine.generate(SampleRequest([seq[s]], [t], 5, 0.7, True, 0))[0]
            assert g.token_ids == fresh.token_ids and g.policy_mask == fresh.policy_mask and g.allowed == fresh.allowed
            assert g.logprobs == pytest.approx(fresh.logprobs, abs=TOL)
            seq[s] += g.token_ids


def test_generate_restores_the_training_flag(tiny_policy, household_suite):
    model, _, _, engine = tiny_policy
    prompts, _ = _prompts(tiny_policy, household_suite, 2)
    model.train()
    try:
        engine.generate(SampleRequest(prompts, [None, None], 2, 1.0, False, 0))
        assert model.training
    finally:
        model.eval()
    engine.generate(SampleRequest(prompts, [None, None], 2, 1.0, False, 0))
    assert not model.training


def test_sampling_draws_what_torch_multinomial_draws(tiny_policy, household_suite):
    """The first token of each of 8 rows at T = 1 is ``torch.multinomial``'s sample (one per row, the
    seed's generator) from the row's softmax recomputed unbatched: the engine's draw is multinomial's
    own, so a seed samples the stream it sampled when the engine called ``torch.multinomial``."""
    model, _, _, engine = tiny_policy
    prompts = _prompts(tiny_policy, household_suite, 4)[0] * 2
    probs = torch.stack([torch.softmax(_next_logits(model, p), -1) for p in prompts])
    for seed in (0, 1, 2):
        expected = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(seed)).squeeze(-1).tolist()
        assert [
            g.token_ids[0] for g in engine.generate(SampleRequest(prompts, [None] * len(prompts), 1, 1.0, False, seed))
        ] == expected


@pytest.mark.parametrize("admissible", [True, False])
@pytest.mark.parametrize("keep_cache", [True, False])
def test_rows_leaving_the_batch_change_no_other_rows_samples(tiny_policy, household_suite, admissible, keep_cache):
    """8 rows sampled at T = 1 for 8 tokens; rows 0-3 are forced either to end at once (a trie of the end
    id alone) or to run the whole budget (a trie of one 9-token sequence). Rows 4-7 sample the same
    tokens either way, with log-probs and entropies within 1e-6, absolute or relative (the forward calls
    have 8 rows or 4: the floats may move in their last bits, a few float32 roundings of an entropy near 5;
    the random numbers do not), and rows 0-3 left the decode batch: the early batch computed 4 x 7 fewer
    decode positions (the late one feeds each of them 7 times; a row's last token is never fed within its
    turn)."""
    _, _, fmt, engine = tiny_policy
    prompts, commands = _prompts(tiny_policy, household_suite, 4)
    rest = [TokenTrie([fmt.command(c) for c in cs], cs) if admissible else None for cs in commands]
    word = fmt.command(commands[0][0])[0]
    gens, decoded = {}, {}
    for case, forced in (("early", [fmt.end_id]), ("late", [word] * 8 + [fmt.end_id])):
        before = engine.counts["decode_computed"]
        session = Session(engine, keep_cache=keep_cache)
        gens[case] = session.extend(
            list(range(8)), SampleRequest(prompts * 2, [TokenTrie([forced])] * 4 + rest, 8, 1.0, False, 7)
        )
        decoded[case] = engine.counts["decode_computed"] - before
        assert [g.token_ids for g in gens[case][:4]] == [forced[:8]] * 4
    for early, late in zip(gens["early"][4:], gens["late"][4:]):
        assert early.token_ids == late.token_ids and early.finished == late.finished
        assert early.logprobs == pytest.approx(late.logprobs, rel=1e-6, abs=1e-6)
        assert early.entropy == pytest.approx(late.entropy, rel=1e-6, abs=1e-6)
    assert decoded["late"] - decoded["early"] == 4 * 7
