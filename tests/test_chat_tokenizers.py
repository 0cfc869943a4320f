"""Genuine chat-model tokenizers (Qwen3, Llama 3; byte-level BPE, 152k / 128k ids) with their own chat
templates, around tiny random-weight models of the matching architecture (``chat_policy`` fixture).

What is checked, in both contexts and both action modes:

* the template renders every turn: the per-turn pieces are the ids of the template's own rendering;
* token-in/token-out: the rows the learner trains on are, id for id, the prompts the engine was given
  plus the ids it sampled, even where decoding and re-encoding those ids gives other ids;
* the learner's log-probs equal the sampler's at every policy token (<= 1e-5);
* admissible mode: the trie over BPE ids reaches every admissible command and nothing else;
* free mode: the ReAct parse rule on malformed replies, and format errors penalised as configured;
* Qwen3's thinking block: off by default (an empty block in the prompt), on: written by the policy.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_sequences import RecordingEngine

from horizonrl import store
from horizonrl.engines.base import TokenTrie
from horizonrl.rollout.loop import SamplingSettings, collect
from horizonrl.rollout.prompting import ChatFormat
from horizonrl.training.sequences import train_rows
from horizonrl.training.trainer import policy_logprobs

TOL = 1e-5
EMPTY_THINK = "<think>\n\n</think>\n\n"
# Commands where BPE's first token and digit splitting matter: a number alone, digits after a space,
# a slash, a command that is a prefix of another (at text and at id level), non-ASCII text.
TRICKY = [
    "2",
    "go to 10",
    "go to 1",
    "take apple 1 from countertop 12",
    "put mug 3 in/on shelf 1",
    "look",
    "look .",
    "open drawer 1",
    "open drawer 11",
    "examine café",
    "inventory",
]


def _states(suite, n_tasks: int = 4, steps: int = 3) -> list[tuple[str, str, list[str]]]:
    """(goal, observation, admissible commands) of the first ``steps`` states of ``n_tasks`` easy tasks."""
    out = []
    for task in suite.tasks("train", "easy", n_tasks):
        env = suite.make()
        obs, info = env.reset(task)
        for _ in range(steps):
            out.append((env.goal(), obs, info["admissible_commands"]))
            obs, _, done, info = env.step(info["admissible_commands"][0])
            if done:
                break
    return out


def _leaves(node: dict, prefix: tuple[int, ...] = ()) -> list[tuple[int, ...]]:
    if not node:
        return [prefix]
    return [leaf for t, child in node.items() for leaf in _leaves(child, prefix + (t,))]


def test_pieces_are_the_chat_templates_own_rendering(chat_policy):
    """system + user + reply + close + user, built piece by piece, is the template's rendering of that
    conversation (Qwen3 with thinking off keeps the empty block of the past turn: what was sampled after),
    and re-encoding that text gives the same ids: no BPE merge crosses a piece boundary."""
    name, _, tokenizer, _, _ = chat_policy
    for thinking in [False, True] if name == "qwen3" else [False]:
        fmt = ChatFormat.for_tokenizer(tokenizer, enable_thinking=thinking)
        goal, o1, a1, o2 = (
            "Put a clean mug in the cabinet.",
            "You are in the kitchen. You see a mug 1.",
            "take mug 1",
            " It is  dark.\n",
        )
        ids = fmt.system(goal) + fmt.user(o1) + fmt.command(a1) + fmt.close(fmt.command(a1)) + fmt.user(o2)
        conv = [
            {"role": "system", "content": goal},
            {"role": "user", "content": o1},
            {"role": "assistant", "content": a1},
            {"role": "user", "content": o2},
        ]
        rendered = tokenizer.apply_chat_template(
            conv, tokenize=False, add_generation_prompt=True, enable_thinking=thinking
        )
        text = tokenizer.decode(ids)
        if name == "qwen3" and not thinking:
            assert text.count(EMPTY_THINK) == 2 and rendered.count(EMPTY_THINK) == 1  # off: the block is prompt
            text = text.replace(EMPTY_THINK, "", 1)
        assert text == rendered
        assert ids == fmt.encode(tokenizer.decode(ids))
        assert tokenizer.convert_ids_to_tokens(fmt.end_id) == {"qwen3": "<|im_end|>", "llama3": "<|eot_id|>"}[name]
        if name == "qwen3" and not thinking:
            assert tokenizer.decode(fmt.user(o1)).endswith("<|im_start|>assistant\n" + EMPTY_THINK)
        if thinking:
            assert tokenizer.decode(fmt.user(o1)).endswith("<|im_start|>assistant\n")  # on: the policy writes the block


def test_trie_reaches_every_admissible_command_and_nothing_else(chat_policy, household_suite):
    """For real household states plus tricky commands: the trie's leaves are exactly the commands' id
    sequences, each decodes to its command, and each is the command's ids as the template places it
    after the assistant header (whatever a leading space or newline would have done to the first token)."""
    name, _, tokenizer, fmt, _ = chat_policy
    first_token_moves = 0
    for goal, obs, commands in _states(household_suite) + [("g", "o", TRICKY)]:
        trie = TokenTrie([fmt.command(c) for c in commands], commands)
        leaves = _leaves(trie.root)
        assert sorted(leaves) == sorted(tuple(fmt.command(c)) for c in commands)
        assert sorted(tokenizer.decode(list(leaf[:-1])) for leaf in leaves) == sorted(commands)
        assert all(leaf[-1] == fmt.end_id and fmt.end_id not in leaf[:-1] for leaf in leaves)
        assert set(trie.texts.values()) == set(commands)
        head = fmt.system(goal) + fmt.user(obs)
        for c in commands:
            conv = [
                {"role": "system", "content": goal},
                {"role": "user", "content": obs},
                {"role": "assistant", "content": c},
            ]
            rendered = fmt.encode(tokenizer.apply_chat_template(conv, tokenize=False, enable_thinking=False))
            assert rendered[: len(head) + len(fmt.command(c))] == head + fmt.command(c), c
            first_token_moves += (
                fmt.encode(" " + c)[0] != fmt.command(c)[0] or fmt.encode("\n" + c)[0] != fmt.command(c)[0]
            )
    assert first_token_moves > 0  # a leading space or newline would have changed the first token


def _play(chat_policy, suite, context: str, action_mode: str, fmt: ChatFormat | None = None, seed: int = 5):
    """2 easy tasks x 2 rollouts, 3 turns, T = 0.7; returns (records, {(rollout_id, turn): (sequence, generation)})."""
    _, _, _, default_fmt, engine = chat_policy
    spy = RecordingEngine(engine)
    settings = SamplingSettings(
        action_mode,
        context,
        history_turns=2,
        max_turns=3,
        max_action_tokens=12 if action_mode == "admissible" else 6,
        temperature=0.7,
        seed=seed,
    )
    records = collect(suite, suite.tasks("train", "easy", 2), 2, spy, fmt or default_fmt, settings)
    seen = {}
    for turn, call in enumerate(spy.calls):
        running = [r.rollout_id for r in records if len(r.turns) > turn]
        keys = running if set(call) == set(running) else range(len(running))  # session slots are rollout ids
        seen.update({(rid, turn): call[k] for rid, k in zip(running, keys)})
    assert len(seen) == sum(len(r.turns) for r in records) and max(len(r.turns) for r in records) == 3
    return records, seen


@pytest.mark.parametrize("context", ["window", "full"])
@pytest.mark.parametrize("action_mode", ["admissible", "free"])
def test_learner_trains_on_the_sampled_ids_with_the_samplers_logprobs(
    chat_policy, household_suite, tmp_path, context, action_mode
):
    """Through the Parquet turns table: every rebuilt row holds each engine call's sequence followed by the
    sampled ids (window: the row is that; full: each turn's is a prefix of the trajectory's row), policy
    positions point at them, and the learner's log-probs and entropies at T = 0.7 equal the sampler's
    (<= 1e-5; entropies <= 1e-4). Free mode finds replies whose decode-then-encode gives other ids: the rows keep the
    sampled ones."""
    name, model, tokenizer, fmt, _ = chat_policy
    records, seen = _play(chat_policy, household_suite, context, action_mode)
    path = tmp_path / "turns.parquet"
    store.write_table(store.turns_table(records), path, "turns")
    rows = train_rows(store.read_table(path, "turns"), context)
    by_turn = {(r.rollout_id, t.turn): t for r in records for t in r.turns}
    for row in rows:
        turns = [row.turn] if context == "window" else sorted(t for (rid, t) in seen if rid == row.rollout_id)
        positions = []
        for t in turns:
            sequence, gen = seen[(row.rollout_id, t)]
            assert row.input_ids[: len(sequence) + len(gen.token_ids)] == sequence + gen.token_ids
            assert by_turn[(row.rollout_id, t)].gen.token_ids == gen.token_ids
            positions += [len(sequence) + j for j, m in enumerate(gen.policy_mask) if m]
        assert row.positions == positions
    drifted = 0
    for turn in by_turn.values():
        ids = turn.gen.token_ids
        if action_mode == "admissible":
            if turn.gen.finished:
                assert ids == fmt.command(turn.action) and turn.format_valid
        else:
            assert all(turn.gen.policy_mask) and turn.gen.allowed == [[] for _ in ids]
            drifted += fmt.encode(tokenizer.decode(ids)) != ids
    if action_mode == "free":
        assert drifted > 0  # re-tokenising the sampled text would have trained on other ids
    rows = [r for r in rows if r.positions]
    with torch.no_grad():
        logp, entropy = policy_logprobs(model, rows, 0.7, tokenizer.pad_token_id)
    gen_entropy = [
        h
        for r in rows
        for t in sorted(set(r.turn_id))
        for h, m in zip(by_turn[r.rollout_id, t].gen.entropy, by_turn[r.rollout_id, t].gen.policy_mask)
        if m
    ]
    sample_logp = np.asarray([lp for r in rows for lp in r.sample_logp])
    assert np.abs(logp.numpy() - sample_logp).max() <= TOL
    # the entropy (~11.9 nats) sums 152k float32 terms in a different order on each side: 1e-6 relative
    assert np.abs(entropy.numpy() - np.asarray(gen_entropy)).max() <= 1e-4


def test_generation_stops_at_the_templates_end_of_turn_token(chat_policy, household_suite):
    """Every finished admissible action ends with the template's end-of-turn id, the only stop inside
    the trie; the engine stops at it (nothing is sampled after it) and the context closes the turn with
    the template's close (Qwen3 ``<|im_end|>\\n``, Llama 3 ``<|eot_id|>``)."""
    name, _, tokenizer, fmt, _ = chat_policy
    records, seen = _play(chat_policy, household_suite, "full", "admissible")
    finished = [g for _, g in seen.values() if g.finished]
    assert finished and all(g.token_ids[-1] == fmt.end_id and fmt.end_id not in g.token_ids[:-1] for g in finished)
    assert tokenizer.decode(fmt.close(finished[0].token_ids)) == {"qwen3": "\n", "llama3": ""}[name]
    assert (
        tokenizer.decode(fmt.close(finished[0].token_ids[:-1]))
        == {"qwen3": "<|im_end|>\n", "llama3": "<|eot_id|>"}[name]
    )


def test_thinking_block_off_by_default_and_policy_tokens_when_on(chat_policy, household_suite):
    """Qwen3, free mode: thinking off puts the template's empty block at the end of every prompt; on, the
    prompt ends at the assistant header and every id of the reply (a thinking block included) is a policy
    token with the full-vocabulary distribution. Llama 3's template has no block: asking for it is an error."""
    name, _, tokenizer, fmt, _ = chat_policy
    if name == "llama3":
        with pytest.raises(ValueError, match="enable_thinking"):
            ChatFormat.for_tokenizer(tokenizer, enable_thinking=True)
        return
    block = fmt.encode(EMPTY_THINK)
    _, seen_off = _play(chat_policy, household_suite, "window", "free")
    assert all(seq[-len(block) :] == block for seq, _ in seen_off.values())
    on = ChatFormat.for_tokenizer(tokenizer, enable_thinking=True)
    records, seen_on = _play(chat_policy, household_suite, "window", "free", fmt=on)
    header = fmt.encode("<|im_start|>assistant\n")
    for seq, gen in seen_on.values():
        assert seq[-len(header) :] == header and seq[-len(block) :] != block
        assert all(gen.policy_mask) and gen.allowed == [[] for _ in gen.token_ids]
    rows = train_rows(store.turns_table(records), "window")
    assert sum(len(r.positions) for r in rows) == sum(len(g.token_ids) for _, g in seen_on.values())
    think = fmt.encode("<think>\nthe mug is dirty\n</think>\n\ntake mug 1")  # a reply with its block, parsed
    assert on.parse_action(think + [fmt.end_id], True) == ("take mug 1", True)


REACT_CASES = [  # (reply, finished, expected command, expected format_valid)
    ("I need the mug first.\nAction: take mug 1", True, "take mug 1", True),
    ("Action: go to cabinet 2", True, "go to cabinet 2", True),
    ("<think>\nwhere is it\n</think>\n\nIt is on the table.\nAction:  look ", True, "look", True),
    ("I need the mug first.\nAction: take mug 1", False, "take mug 1", False),  # cut at the token budget
    ("take mug 1", True, "", False),  # no action line
    ("Action: take mug 1\nAction: look", True, "look", False),  # two action lines
    ("Action: take mug 1\nthen I will clean it", True, "take mug 1", False),  # text after the action line
    ("Thought only.\nAction:", True, "", False),  # empty command
    ("<think>\nstill thinking", True, "", False),  # unclosed thinking block
    ("", True, "", False),
]


@pytest.mark.parametrize("reply,finished,command,valid", REACT_CASES)
def test_react_parse_rule_on_well_formed_and_malformed_replies(chat_policy, reply, finished, command, valid):
    _, _, tokenizer, fmt, _ = chat_policy
    react = ChatFormat.for_tokenizer(tokenizer, free_format="react")
    ids = react.encode(reply) + ([react.end_id] if finished else [])
    assert react.parse_action(ids, finished) == (command, valid)
    assert "Action: <command>" in tokenizer.decode(react.system("goal"))  # the system message states the format


def test_plain_format_takes_the_whole_reply(chat_policy):
    _, _, _, fmt, _ = chat_policy
    assert fmt.parse_action(fmt.encode("  take mug 1 \n") + [fmt.end_id], True) == ("take mug 1", True)
    assert fmt.parse_action(fmt.encode("take mug"), False) == ("take mug", False)
    assert fmt.parse_action([fmt.end_id], True) == ("", False)


def test_format_errors_are_counted_and_penalised(chat_policy, household_suite):
    """Same seed with and without ``format_penalty`` 0.25: the same replies, every format error's reward
    lower by exactly 0.25, every other reward unchanged; the untrained model's replies are format errors."""
    _, _, tokenizer, _, _ = chat_policy
    plain = ChatFormat.for_tokenizer(tokenizer, free_format="react")
    penalised = ChatFormat.for_tokenizer(tokenizer, free_format="react", format_penalty=0.25)
    a, _ = _play(chat_policy, household_suite, "window", "free", fmt=plain)
    b, _ = _play(chat_policy, household_suite, "window", "free", fmt=penalised)
    pairs = [(s, t) for r, q in zip(a, b) for s, t in zip(r.turns, q.turns)]
    assert len(pairs) == sum(len(r.turns) for r in a) and all(s.gen.token_ids == t.gen.token_ids for s, t in pairs)
    errors = [s.format_valid is False for s, _ in pairs]
    assert sum(errors) > 0
    for (s, t), error in zip(pairs, errors):
        assert t.format_valid == s.format_valid
        assert t.reward == pytest.approx(s.reward - (0.25 if error else 0.0), abs=1e-12)


def test_thinking_in_admissible_mode_is_refused_naming_the_fields():
    from horizonrl.config import load_config

    with pytest.raises(ValueError, match="config: rollout.enable_thinking needs rollout.action_mode = 'free'"):
        load_config(None, ["rollout.enable_thinking=true", "model.tokenizer=qwen3"])
    assert load_config(None, ["rollout.enable_thinking=true", "rollout.action_mode=free"]).rollout.enable_thinking


TRAIN_RUNS = [  # (tokenizer, context, action_mode, method): each tokenizer in both contexts, each action mode twice
    ("qwen3", "full", "admissible", "loop"),
    ("qwen3", "window", "free", "rloo"),
    ("llama3", "full", "free", "rloo"),
    ("llama3", "window", "admissible", "loop"),
]


@pytest.mark.slow
@pytest.mark.parametrize("tokenizer,context,action_mode,method", TRAIN_RUNS)
def test_two_iteration_train_run(
    prefect_harness,
    chat_model_dir,
    chat_tokenizer_cache,
    tmp_path,
    tracking_uri,
    tokenizer,
    context,
    action_mode,
    method,
):
    """The real train flow for 2 iterations around a genuine tokenizer: every stage logs, the stored
    prompts are rendered by the model's chat template, the update steps on the rows (admissible runs: the
    weights move; free runs use RLOO, which keeps the zero-advantage rows an untrained model's all-error
    replies give), and in free mode (ReAct, penalty 0.1) the logged format-error rate is the stored one
    and each error's reward carries the penalty."""
    from conftest import CHAT_TINY
    from flowkit import run_of, steps, tiny_config
    from safetensors.torch import load_file

    from flows.train import train
    from horizonrl.models.loading import load_policy
    from mlflow import MlflowClient

    cfg = tiny_config(tmp_path, tracking_uri, f"{tokenizer}-{context}-{action_mode}")
    cfg["method"] = method
    cfg["env"]["max_turns"] = 3
    cfg["model"] = {"tokenizer": tokenizer, "tiny": CHAT_TINY}
    cfg["rollout"].update(
        context=context, action_mode=action_mode, max_action_tokens=6, free_format="react", format_penalty=0.1
    )
    cfg["eval"] = {"every": 2, "n_tasks": 1}
    data = tmp_path / "data"
    data.mkdir()
    (data / "tokenizers").symlink_to(chat_tokenizer_cache)  # fetched once per machine, not per run
    (data / "models").symlink_to(chat_model_dir(tokenizer).parent)  # built once per session
    train(config=cfg)

    c = MlflowClient(tracking_uri)
    run = run_of(c, cfg["run_name"])
    assert run.info.status == "FINISHED" and run.data.params["model.tokenizer"] == tokenizer
    for key in ("collect/success_rate", "collect/format_invalid_rate", "advantage/kept_fraction", "update/steps"):
        assert steps(c, run.info.run_id, key) == [1, 2], key
    assert sum(m.value for m in c.get_metric_history(run.info.run_id, "update/steps")) > 0
    ckpt = data / "test" / cfg["run_name"] / "checkpoints"
    model, tok = load_policy(ckpt / "iter=00002")
    assert (
        type(model).__name__ == {"qwen3": "Qwen3ForCausalLM", "llama3": "LlamaForCausalLM"}[tokenizer]
        and len(tok) > 128_000
    )
    if action_mode == "admissible":
        before, after = (
            load_file(ckpt / "iter=00000" / "model.safetensors"),
            load_file(ckpt / "iter=00002" / "model.safetensors"),
        )
        assert any(not torch.equal(before[k], after[k]) for k in before)
    turns = store.read_table(
        store.iteration_dir(data, "test", cfg["run_name"], 2) / "turns.parquet", "turns"
    ).to_pylist()
    header = {
        "qwen3": "<|im_start|>system\n",
        "llama3": "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n",
    }[tokenizer]
    assert all(tok.decode(t["prompt_ids"]).startswith(header) for t in turns if t["turn"] == 0 or context == "window")
    invalid = [not t["format_valid"] for t in turns]
    logged = [m.value for m in c.get_metric_history(run.info.run_id, "collect/format_invalid_rate") if m.step == 2]
    assert logged == [pytest.approx(sum(invalid) / len(invalid))]
    if action_mode == "free":
        assert all(t["reward"] == pytest.approx(float(t["won"]) - 0.1 * bad) for t, bad in zip(turns, invalid))
