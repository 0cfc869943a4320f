"""The ``listed`` prompt (``rollout.prompt``) for pretrained chat models, on genuine tokenizers (Qwen3,
Llama 3, and a ChatML template that, like SmolLM2's, injects a default system prompt when a conversation
has none) around tiny random-weight models:

* the pieces are the template's own rendering of the conversation the prompt describes: the project's
  system message (the game, the task, the reply format), each observation with its admissible commands;
* the template's default system prompt never appears;
* played by ``collect`` in both contexts, every turn's prompt ends with that turn's observation and
  commands; in window context with at most ``history_turns`` past turns; free mode's format penalty holds;
* the default (``compact``) is what it was: the goal as the system message, the bare observation.
"""

from __future__ import annotations

import pytest
from test_sequences import RecordingEngine
from transformers import AutoTokenizer

from horizonrl.rollout.loop import SamplingSettings, collect
from horizonrl.rollout.prompting import (
    COMMANDS_HEADER,
    LISTED_REPLY,
    LISTED_SYSTEM,
    REACT_INSTRUCTION,
    ChatFormat,
)

EMPTY_THINK = "<think>\n\n</think>\n\n"
DEFAULT_SYSTEM = "You are a helpful assistant called Default, made by nobody in particular."
# ChatML that adds DEFAULT_SYSTEM when the conversation does not start with a system message (as
# SmolLM2-Instruct's template adds its own), written for this test.
DEFAULT_SYSTEM_CHATML = (
    "{%- if messages[0]['role'] != 'system' -%}"
    "{{ '<|im_start|>system\\n" + DEFAULT_SYSTEM + "<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
GOAL = "Put a clean mug in the cabinet."
TURNS = [
    ("You are in the kitchen. You see a mug 1.", ["take mug 1", "go to cabinet 1", "look"]),
    (" It is  dark.\n", ["go to 10", "put mug 3 in/on shelf 1", "examine café"]),
]


@pytest.fixture(scope="module")
def default_system_tokenizer(chat_model_dir):
    """Qwen3's tokenizer (ChatML's special tokens) with DEFAULT_SYSTEM_CHATML as its chat template."""
    tokenizer = AutoTokenizer.from_pretrained(chat_model_dir("qwen3"))
    tokenizer.chat_template = DEFAULT_SYSTEM_CHATML
    return tokenizer


def _listed_conversation(tokenizer, fmt: ChatFormat, reply: str) -> tuple[list[int], str]:
    """(ids built piece by piece, the template's rendering) of system, user, assistant, user."""
    (o1, c1), (o2, c2) = TURNS
    a1 = fmt.command(c1[0])
    ids = fmt.system(GOAL) + fmt.user(o1, c1) + a1 + fmt.close(a1) + fmt.user(o2, c2)
    conv = [
        {"role": "system", "content": f"{LISTED_SYSTEM}\nTask: {GOAL}\n{reply}"},
        {"role": "user", "content": f"{o1.rstrip()}\n\n{COMMANDS_HEADER}\n" + "\n".join(c1)},
        {"role": "assistant", "content": c1[0]},
        {"role": "user", "content": f"{o2.rstrip()}\n\n{COMMANDS_HEADER}\n" + "\n".join(c2)},
    ]
    return ids, tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True, enable_thinking=False)


@pytest.mark.parametrize("free_format,reply", [("plain", LISTED_REPLY), ("react", REACT_INSTRUCTION)])
def test_listed_pieces_are_the_templates_rendering(chat_policy, free_format, reply):
    name, _, tokenizer, _, _ = chat_policy
    fmt = ChatFormat.for_tokenizer(tokenizer, free_format=free_format, prompt="listed")
    ids, rendered = _listed_conversation(tokenizer, fmt, reply)
    text = tokenizer.decode(ids)
    if name == "qwen3":  # thinking off: the past turn's empty block stays in the context (it was prompt)
        assert text.count(EMPTY_THINK) == 2
        text = text.replace(EMPTY_THINK, "", 1)
    assert text == rendered
    assert ids == fmt.encode(tokenizer.decode(ids))  # no BPE merge crosses a piece boundary
    assert GOAL in tokenizer.decode(fmt.system(GOAL)) and reply in tokenizer.decode(fmt.system(GOAL))


def test_a_templates_default_system_prompt_never_appears(default_system_tokenizer):
    """The template injects DEFAULT_SYSTEM into a conversation without a system message; every piece of
    either prompt comes from a conversation that has one, so it is never in the context."""
    tokenizer = default_system_tokenizer
    bare = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert DEFAULT_SYSTEM in bare  # the template does inject it
    fmt = ChatFormat.for_tokenizer(tokenizer, prompt="listed")
    ids, rendered = _listed_conversation(tokenizer, fmt, LISTED_REPLY)
    assert tokenizer.decode(ids) == rendered
    compact = ChatFormat.for_tokenizer(tokenizer)
    for f in (fmt, compact):
        (o1, c1), _ = TURNS
        pieces = f.system(GOAL) + f.user(o1, c1) + f.close(f.command(c1[0])) + f.user(o1, c1)
        assert "Default" not in tokenizer.decode(pieces)
    assert tokenizer.decode(compact.system(GOAL)) == f"<|im_start|>system\n{GOAL}<|im_end|>\n"


def test_compact_is_the_goal_and_the_bare_observation(chat_policy):
    """The default prompt ignores the commands: the same ids as before the field existed."""
    _, _, tokenizer, fmt, _ = chat_policy
    assert fmt.prompt == "compact"
    (o1, c1), _ = TURNS
    assert fmt.user(o1, c1) == fmt.user(o1) == fmt.users([o1])[0]
    assert COMMANDS_HEADER not in tokenizer.decode(fmt.user(o1, c1))
    assert LISTED_SYSTEM not in tokenizer.decode(fmt.system(GOAL))


def test_bad_prompt_and_missing_commands_are_named(chat_policy):
    _, _, tokenizer, _, _ = chat_policy
    with pytest.raises(ValueError, match="rollout.prompt = 'chatty'"):
        ChatFormat.for_tokenizer(tokenizer, prompt="chatty")
    listed = ChatFormat.for_tokenizer(tokenizer, prompt="listed")
    with pytest.raises(ValueError, match="rollout.prompt = 'listed'.*admissible commands"):
        listed.user("an observation")


def _replayed(suite, record) -> tuple[str, list[tuple[str, list[str], float]]]:
    """The goal and (observation, admissible commands, environment reward) of each of ``record``'s turns, by
    replaying its actions in a fresh environment (the household is deterministic)."""
    env = suite.make()
    obs, info = env.reset(record.task)
    goal, out = info["goal"], []
    for turn in record.turns:
        assert obs == turn.observation
        commands = info["admissible_commands"]
        obs, reward, _, info = env.step(turn.action)
        out.append((turn.observation, commands, float(reward)))
    env.close()
    return goal, out


@pytest.mark.parametrize(
    "context,action_mode,free_format", [("window", "admissible", "plain"), ("full", "free", "react")]
)
def test_listed_episodes_show_each_turns_commands(chat_policy, household_suite, context, action_mode, free_format):
    name, _, tokenizer, _, engine = chat_policy
    fmt = ChatFormat.for_tokenizer(tokenizer, free_format=free_format, format_penalty=0.1, prompt="listed")
    spy = RecordingEngine(engine)
    settings = SamplingSettings(action_mode, context, 1, 3, 12, 1.0, 7)
    records = collect(household_suite, household_suite.tasks("train", "easy", 2), 2, spy, fmt, settings)
    assert sum(len(r.turns) for r in records) > len(records)  # there is a history
    penalised = 0
    for record in records:
        goal, replayed = _replayed(household_suite, record)
        system = fmt.system(goal)
        assert LISTED_SYSTEM in tokenizer.decode(system) and goal in tokenizer.decode(system)
        for turn, (obs, commands, env_reward) in zip(record.turns, replayed):
            assert turn.prompt_ids[-len(fmt.user(obs, commands)) :] == fmt.user(obs, commands)
            assert all(c in tokenizer.decode(turn.prompt_ids) for c in commands)
            if context == "window":
                shown = tokenizer.decode(turn.prompt_ids).count(COMMANDS_HEADER)
                assert shown == min(turn.turn, 1) + 1  # the last history_turns turns, then this one
                assert turn.prompt_ids[: len(system)] == system
            expected = env_reward - (0.0 if turn.format_valid else 0.1)
            assert turn.reward == pytest.approx(expected)
            penalised += not turn.format_valid
    if action_mode == "free":
        assert penalised > 0  # random weights break the ReAct format: the penalty is exercised


def test_listed_branches_see_what_their_parent_saw(chat_policy, household_suite):
    """APPO in window context: a branch's history is rebuilt from its parent's turns, each observation with
    the commands offered at that turn, so the branch's prompt at its split turn is its parent's."""
    from horizonrl.rollout.branching import collect_branches, plan_branches
    from methods.appo import BranchingParams

    _, _, tokenizer, _, engine = chat_policy
    fmt = ChatFormat.for_tokenizer(tokenizer, prompt="listed")
    settings = SamplingSettings("admissible", "window", 1, 4, 12, 1.0, 3)
    initial = collect(household_suite, household_suite.tasks("train", "easy", 2), 3, engine, fmt, settings)
    starts, _, _ = plan_branches(initial, 3, BranchingParams(), tokenizer)
    branches = collect_branches(household_suite, starts, engine, fmt, settings, first_rollout_id=100)
    split_turns = []
    for branch, start in zip(branches, starts):
        lengths = [len(t.gen.token_ids) for t in start.parent.turns]
        turn = next(k for k in range(len(lengths)) if sum(lengths[: k + 1]) > start.split)
        split_turns.append(turn)
        assert branch.turns[turn].prompt_ids == start.parent.turns[turn].prompt_ids
    assert max(split_turns) > 0  # some branch starts after a history


def test_a_logged_policy_is_prompted_as_its_run_was(tiny_policy_dir, household_suite, tmp_path):
    """The policy logged from code carries its run's prompt settings as its model config: loaded with
    ``mlflow.pyfunc.load_model``, a ``listed`` run's policy builds the listed prompt (the goal under the
    project's system message, the commands after the observation) and picks an admissible command."""
    import pandas as pd

    import mlflow
    from horizonrl.tracking import mlflow_runs
    from mlflow import MlflowClient

    c = MlflowClient(f"sqlite:///{tmp_path}/m.db")
    run_id = c.create_run(c.create_experiment("p", artifact_location=str(tmp_path / "art"))).info.run_id
    chat = {"prompt": "listed", "free_format": "plain", "enable_thinking": False}
    mlflow_runs.log_policy(c, run_id, tiny_policy_dir, 0, chat)
    model = mlflow.pyfunc.load_model(f"models:/{mlflow_runs.policy_models(c, run_id)[0].model_id}")
    assert model.unwrap_python_model().fmt.prompt == "listed"
    env = household_suite.make()
    obs, info = env.reset(household_suite.tasks("test", "easy", 1)[0])
    row = {"goal": env.goal(), "observation": obs, "admissible": list(info["admissible_commands"])}
    [action] = model.predict(pd.DataFrame([row]))
    assert action in row["admissible"]
