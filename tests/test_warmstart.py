"""The warm start: walkthroughs stored as demonstrations (trajectory schema, observations masked), behaviour
cloning that lowers its loss, the registered model, and a train run that starts from ``models:/...`` with
exactly those weights and its lineage tagged (real Prefect flows, MLflow on SQLite, Parquet, torch)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from flowkit import run_of, tiny_config
from safetensors.torch import load_file

from horizonrl import store
from horizonrl.config import TrainConfig, load_config
from horizonrl.rollout.prompting import ChatFormat
from horizonrl.tracking import mlflow_runs
from horizonrl.training.demonstrations import DEMONSTRATION, play_walkthroughs
from horizonrl.training.sequences import train_rows
from mlflow import MlflowClient


def test_demonstrations_mask_observations_and_follow_the_walkthrough(household_suite, tiny_policy):
    _, tokenizer, _, _ = tiny_policy
    fmt = ChatFormat.for_tokenizer(tokenizer)
    tasks = household_suite.tasks("train", "easy", 3)
    records = play_walkthroughs(
        household_suite, tasks, fmt, action_mode="admissible", context="full", history_turns=2, max_turns=15
    )
    env = household_suite.make()
    for task, rec in zip(tasks, records):
        env.reset(task)
        assert [t.action for t in rec.turns] == env.walkthrough() and rec.won and rec.kind == DEMONSTRATION
    turns = store.turns_table(records)
    for row, rec in zip(train_rows(turns, "full"), records):
        action_spans, at = set(), 0
        for t in rec.turns:
            at += len(t.prompt_ids)
            action_spans |= set(range(at, at + len(t.gen.token_ids)))
            at += len(t.gen.token_ids)
        assert row.positions and set(row.positions) <= action_spans, (
            "a policy token outside the actions: observations are not masked"
        )
        assert all(len(a) > 1 for a in row.allowed), "a forced token (one continuation) counted as a policy token"
        assert all(row.input_ids[p] in a for p, a in zip(row.positions, row.allowed))


def test_perturbed_share_replaces_one_action_in_that_share(household_suite, tiny_policy):
    fmt = ChatFormat.for_tokenizer(tiny_policy[1])
    tasks = household_suite.tasks("train", "easy", 4)
    kw = dict(action_mode="admissible", context="full", history_turns=2, max_turns=15, seed=5)
    clean = play_walkthroughs(household_suite, tasks, fmt, **kw)
    mixed = play_walkthroughs(household_suite, tasks, fmt, perturbed_share=0.5, **kw)
    changed = [a for a, b in zip(clean, mixed) if [t.action for t in a.turns] != [t.action for t in b.turns]]
    assert len(changed) == 2


def test_search_expert_demonstrations_follow_it_and_win(household_suite, tiny_policy):
    fmt = ChatFormat.for_tokenizer(tiny_policy[1])
    tasks = household_suite.tasks("train", "medium", 6)
    records = play_walkthroughs(
        household_suite,
        tasks,
        fmt,
        action_mode="admissible",
        context="full",
        history_turns=2,
        max_turns=30,
        expert="search",
    )
    env = household_suite.make()
    for task, rec in zip(tasks, records):
        env.reset(task)
        assert [t.action for t in rec.turns] == env.search_walkthrough() and rec.won


def test_search_expert_is_household_only():
    with pytest.raises(
        ValueError,
        match=re.escape(
            "config: warmstart.expert 'search' is built for env.name = 'household', not 'scienceworld-boil': use "
            "'walkthrough' (got 'search' from --set)"
        ),
    ):
        load_config(None, ["env.name=scienceworld-boil", "warmstart.expert=search"])
    assert load_config(None, ["warmstart.expert=search"]).warmstart.expert == "search"


@pytest.mark.slow
def test_warmstart_registers_a_policy_that_train_starts_from(prefect_harness, tmp_path, tracking_uri):
    from flows.train import train
    from flows.warmstart import warmstart

    cfg = tiny_config(tmp_path, tracking_uri, run_name="ws", iterations=1)
    cfg["env"].pop("max_turns")  # the tier's horizon: whole walkthroughs
    cfg["rollout"]["context"] = "full"
    cfg["warmstart"] = {
        "demonstrations": 6,
        "epochs": 3,
        "minibatch_size": 2,
        "lr": 3e-3,
        "lr_final": 1e-3,
        "model_name": "ws-test",
    }
    cfg["eval"] = {"every": 3, "n_tasks": 3, "n_tasks_ends": 4}
    summary = warmstart(config=cfg)
    assert summary["model_uri"] == "models:/ws-test/1" and summary["iterations"] == 3

    run_dir = Path(cfg["data_dir"]) / "test" / "ws"
    episodes = store.read_table(run_dir / "demonstrations" / "episodes.parquet", "episodes")
    assert (
        episodes.num_rows == 6
        and set(episodes["kind"].to_pylist()) == {DEMONSTRATION}
        and all(episodes["won"].to_pylist())
    )
    turns = store.read_table(run_dir / "demonstrations" / "turns.parquet", "turns")
    assert turns.num_rows == sum(episodes["n_turns"].to_pylist()) and {
        x for lp in turns["logprobs"].to_pylist() for x in lp
    } == {0.0}

    c = MlflowClient(tracking_uri)
    ws_run = run_of(c, "ws")
    assert c.get_model_version("ws-test", "1").run_id == ws_run.info.run_id
    assert (
        ws_run.data.tags["horizonrl.kind"] == "warmstart"
        and ws_run.data.tags["horizonrl.registered_model"] == "models:/ws-test/1"
    )
    paired = c.get_metric_history(ws_run.info.run_id, "eval/paired_tasks")
    assert [(m.step, m.value) for m in paired] == [(3, 3.0)], "last epoch (4 tasks) with 0 (3)"
    epoch_loss = [
        m.value for m in sorted(c.get_metric_history(ws_run.info.run_id, "clone/epoch_loss"), key=lambda m: m.step)
    ]
    assert len(epoch_loss) == 3 and epoch_loss[-1] < 0.8 * epoch_loss[0], (
        f"cloning did not lower the loss: {epoch_loss}"
    )
    assert len(c.get_metric_history(ws_run.info.run_id, "clone/loss")) == 3 * 3  # 6 rows / 2 per step, 3 epochs
    lr = [m.value for m in sorted(c.get_metric_history(ws_run.info.run_id, "clone/lr"), key=lambda m: m.step)]
    assert lr == pytest.approx([3e-3, 2e-3, 1e-3]), (
        "annealed linearly from warmstart.lr to warmstart.lr_final over the epochs"
    )
    assert sorted(m.step for m in c.get_metric_history(ws_run.info.run_id, "eval/success_rate")) == [0, 3]
    episodes_by_epoch = {m.step: m.value for m in c.get_metric_history(ws_run.info.run_id, "eval/episodes")}
    assert episodes_by_epoch == {0: 3, 3: 4}, "eval.n_tasks_ends after the last epoch only"

    rl = {**cfg, "run_name": "from-ws", "model": {"path": "models:/ws-test/1"}}
    train(config=rl)
    rl_run = run_of(c, "from-ws")
    assert (
        rl_run.data.tags[mlflow_runs.INIT_MODEL_TAG] == "models:/ws-test/1"
        and rl_run.data.tags[mlflow_runs.INIT_SOURCE_TAG] == ws_run.info.run_id
    )
    cloned = load_file(run_dir / "checkpoints" / "iter=00003" / "model.safetensors")
    started = load_file(Path(cfg["data_dir"]) / "test" / "from-ws" / "checkpoints" / "iter=00000" / "model.safetensors")
    assert cloned.keys() == started.keys() and all((cloned[k] == started[k]).all() for k in cloned)
    fresh = load_file(run_dir / "checkpoints" / "iter=00000" / "model.safetensors")
    assert any((cloned[k] != fresh[k]).any() for k in cloned), "the registered policy is the untrained one"


@pytest.mark.parametrize(
    "path, message", [("models:/ws-test", "models:/<name>/<version>"), ("models:/ws/latest", "version number")]
)
def test_bad_model_uri_is_named(tmp_path, tracking_uri, path, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig.model_validate({**tiny_config(tmp_path, tracking_uri), "model": {"path": path}})


def test_unknown_registered_model_is_named(tmp_path, tracking_uri):
    c = mlflow_runs.client(tracking_uri)
    with pytest.raises(Exception, match="ws-absent"):
        mlflow_runs.resolve_policy(c, "models:/ws-absent/1")


def test_cloning_in_micro_batches_takes_the_same_steps(household_suite, chat_model_dir):
    """A minibatch cloned in micro-batches of a few hundred tokens (a real model's trajectories do not fit
    in one pass) gives the losses and weights of one pass over it, up to float summation order; the listed
    prompt's demonstrations (the commands in every observation) are what is cloned."""
    import torch

    from horizonrl.models.loading import load_policy
    from horizonrl.training.cloning import clone_epoch

    torch.set_num_threads(1)
    _, tokenizer = load_policy(chat_model_dir("llama3"))
    fmt = ChatFormat.for_tokenizer(tokenizer, prompt="listed")
    tasks = household_suite.tasks("train", "easy", 4)
    records = play_walkthroughs(
        household_suite, tasks, fmt, action_mode="admissible", context="full", history_turns=2, max_turns=15
    )
    rows = train_rows(store.turns_table(records), "full")
    longest = max(len(r.input_ids) for r in rows)
    assert longest > 300  # whole listed trajectories: several micro-batches below
    results = []
    for micro_batch_tokens in (16_384, 300):
        model, _ = load_policy(chat_model_dir("llama3"))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = clone_epoch(model, optimizer, rows, 4, 1.0, tokenizer.pad_token_id, 0, micro_batch_tokens)
        results.append((losses, torch.cat([p.detach().flatten() for p in model.parameters()])))
    (one_pass, w1), (micro, w2) = results
    assert micro == pytest.approx(one_pass, abs=1e-5) and len(one_pass) == 1
    assert torch.allclose(w1, w2, atol=1e-5)


def test_a_warm_start_killed_in_its_last_evaluation_evaluates_on_resume(prefect_harness, tmp_path, tracking_uri):
    """SIGKILL in the evaluation after the last epoch (``HORIZONRL_FAULT=evaluate:1``: the epoch's checkpoint
    is written, its evaluation not logged): the same command run again evaluates that checkpoint before it
    registers it, so the policy RL starts from has its held-out success."""
    import os

    import yaml
    from flowkit import cli_run
    from prefect.settings import PREFECT_API_URL

    from flows.cli import main
    from horizonrl import faults

    cfg = tiny_config(tmp_path, tracking_uri, run_name="ws-killed", iterations=1)
    cfg["warmstart"] = {"demonstrations": 2, "epochs": 1, "minibatch_size": 2, "model_name": "ws-killed"}
    cfg["eval"] = {"every": 1, "n_tasks": 2, "greedy": False}
    path = tmp_path / "ws.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, faults.ENV: "evaluate:1", "PREFECT_API_URL": PREFECT_API_URL.value()}
    done = cli_run(["warmstart", "--config", str(path)], env, tmp_path / "cli-logs")
    assert done.returncode == -9, done.stderr[-3000:]
    c = MlflowClient(tracking_uri)
    run_id = run_of(c, "ws-killed").info.run_id
    assert [m.step for m in c.get_metric_history(run_id, "eval/success_rate")] == [0]
    assert main(["warmstart", "--config", str(path)]) == 0
    assert sorted(m.step for m in c.get_metric_history(run_id, "eval/success_rate")) == [0, 1]
    assert c.get_model_version("ws-killed", "1").run_id == run_id


def test_train_with_before_rl_warm_starts_then_trains_from_it_and_resumes_past_it(
    prefect_harness, tmp_path, tracking_uri
):
    """``warmstart.before_rl``: one train command clones first (its own run and registered model, no
    evaluation), then RL starts from exactly the cloned weights with the lineage tagged; run again to extend
    it, the warm start is neither repeated nor registered again, and the RL config keeps ``model.path``."""
    import yaml

    from flows.train import train

    cfg = tiny_config(tmp_path, tracking_uri, run_name="recipe", iterations=1)
    cfg["rollout"]["context"] = "full"
    cfg["warmstart"] = {"demonstrations": 4, "epochs": 2, "minibatch_size": 2, "lr": 3e-3, "before_rl": True}
    cfg["eval"] = {"every": 1, "n_tasks": 2, "greedy": False}
    train(config=cfg)

    c = MlflowClient(tracking_uri)
    ws_run, rl_run = run_of(c, "recipe-warmstart"), run_of(c, "recipe")
    assert ws_run.data.tags["horizonrl.kind"] == "warmstart"
    assert [int(v.version) for v in c.search_model_versions("name = 'recipe-warmstart'")] == [1]
    assert c.get_metric_history(ws_run.info.run_id, "eval/success_rate") == [], "the RL run evaluates the warm start"
    assert len(c.get_metric_history(ws_run.info.run_id, "clone/epoch_loss")) == 2
    assert (
        rl_run.data.tags[mlflow_runs.INIT_MODEL_TAG] == "models:/recipe-warmstart/1"
        and rl_run.data.tags[mlflow_runs.INIT_SOURCE_TAG] == ws_run.info.run_id
    )
    data = Path(cfg["data_dir"]) / "test"
    cloned = load_file(data / "recipe-warmstart" / "checkpoints" / "iter=00002" / "model.safetensors")
    started = load_file(data / "recipe" / "checkpoints" / "iter=00000" / "model.safetensors")
    assert cloned.keys() == started.keys() and all((cloned[k] == started[k]).all() for k in cloned)
    assert yaml.safe_load((data / "recipe" / "config.yaml").read_text())["model"]["path"] is None

    train(config={**cfg, "iterations": 2})  # extended: resumes the RL run only
    assert [int(v.version) for v in c.search_model_versions("name = 'recipe-warmstart'")] == [1]
    assert len(c.get_metric_history(ws_run.info.run_id, "clone/epoch_loss")) == 2
    assert max(m.step for m in c.get_metric_history(rl_run.info.run_id, "eval/success_rate")) == 2


def test_warm_start_config_names_its_run_and_model_after_the_train_run(tmp_path, tracking_uri):
    from horizonrl.config import warm_start_config

    cfg = TrainConfig.model_validate(
        {**tiny_config(tmp_path, tracking_uri, run_name="smol--seed=1"), "warmstart": {"before_rl": True}}
    )
    ws = warm_start_config(cfg)
    assert (ws.run_name, ws.warmstart.model_name, ws.warmstart.before_rl) == (
        "smol--seed-1-warmstart",
        "smol--seed-1-warmstart",
        False,
    )
    assert ws.model_dump() | {"run_name": cfg.run_name, "warmstart": cfg.warmstart.model_dump()} == cfg.model_dump()


@pytest.mark.parametrize(
    "model, message",
    [({"lora": {"rank": 4}}, "model.lora"), ({"path": "models:/ws/1"}, "trained policy already")],
)
def test_before_rl_refuses_what_it_cannot_chain(tmp_path, tracking_uri, model, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig.model_validate(
            {**tiny_config(tmp_path, tracking_uri), "model": model, "warmstart": {"before_rl": True}}
        )
