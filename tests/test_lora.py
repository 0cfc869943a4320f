"""LoRA (peft) on the tiny policy, on CPU: the initial adapter leaves the base policy unchanged, training
moves adapter weights only and lowers the loss, checkpoints hold the adapter as safetensors and load back
bit-exactly, and the holder logs each new checkpoint's adapter to MLflow."""

from __future__ import annotations

import json
from pathlib import Path

import peft
import pytest
import torch
from safetensors.torch import load_file

from horizonrl import store
from horizonrl.config import LoraConfig, load_config
from horizonrl.engines.hf import TransformersEngine
from horizonrl.models.loading import initial_adapter_dir, load_policy
from horizonrl.models.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from horizonrl.models.probe import stored_probe
from horizonrl.rollout.loop import SamplingSettings, collect
from horizonrl.rollout.prompting import ChatFormat
from horizonrl.training.checkpoint import load_optimizer_state, save_checkpoint
from horizonrl.training.sequences import train_rows
from horizonrl.training.trainer import UpdateSettings, policy_logprobs, ppo_update

LORA = LoraConfig(rank=4, alpha=8.0)


@pytest.fixture(autouse=True)
def _one_thread():
    """The machine is shared and the model tiny: more threads only contend (10x slower under load)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _rows(model, tokenizer, suite):
    """Rollouts sampled by the transformers engine from the LoRA-wrapped model (full context)."""
    fmt = ChatFormat.for_tokenizer(tokenizer)
    engine = TransformersEngine(model, tokenizer.pad_token_id, [fmt.end_id, tokenizer.eos_token_id])
    records = collect(
        suite, suite.tasks("train", "easy", 2), 2, engine, fmt, SamplingSettings("admissible", "full", 2, 4, 8, 1.0, 0)
    )
    return [r for r in train_rows(store.turns_table(records), "full") if r.positions]


def test_lora_trains_adapters_only_lowers_the_loss_and_round_trips_exactly(tiny_policy_dir, household_suite, tmp_path):
    torch.manual_seed(0)
    adir = initial_adapter_dir(tmp_path, tiny_policy_dir, LORA, seed=0)
    assert (adir / ADAPTER_WEIGHTS).is_file() and not (adir / "model.safetensors").exists()
    written = json.loads((adir / ADAPTER_CONFIG).read_text())
    assert written["base_model_name_or_path"] == str(Path(tiny_policy_dir).resolve())
    assert written["target_modules"] == sorted(LORA.target_modules)  # peft's set order, settled
    assert initial_adapter_dir(tmp_path, tiny_policy_dir, LORA, seed=0) == adir  # built once
    model, tokenizer = load_policy(adir)
    base, _ = load_policy(tiny_policy_dir)
    probe = torch.tensor([list(range(4, 40))])  # (1, 36)
    with torch.no_grad():
        assert torch.equal(model(input_ids=probe).logits, base(input_ids=probe).logits)  # B = 0: the base policy

    rows = _rows(model, tokenizer, household_suite)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)  # as the holder builds it
    model.train()
    losses = []
    for _ in range(6):  # behaviour cloning of the sampled actions through the learner's log-prob path
        logp, _ = policy_logprobs(model, rows, 1.0, tokenizer.pad_token_id)  # (n,)
        loss = -logp.mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0] - 0.05, losses
    for r in rows:
        r.adv = [1.0] * len(r.positions)
    cfg = load_config(
        None, ["method=rloo", "update.minibatch_size=4", "update.high_kl_threshold=1e9"]
    )  # verl's clip, 1 epoch
    s = UpdateSettings.from_config(
        cfg, tokenizer.pad_token_id, sampled_here=False
    )  # cloned since sampling: pi_old recomputed
    stats = ppo_update(model, optimizer, rows, s, seed=0).stats  # the real PPO step runs on the peft model
    assert stats["steps"] >= 1 and all(torch.isfinite(torch.tensor(v)) for v in stats.values())

    changed = {n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert changed and all("lora_" in n for n in changed)
    assert {n for n in before if "lora_B" in n} <= changed  # every B left zero
    assert all(not p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)

    ref = save_checkpoint(tmp_path / "run", 1, model, tokenizer, optimizer, {"seed": 0})
    files = {p.name for p in Path(ref.path).iterdir()}
    assert {ADAPTER_CONFIG, ADAPTER_WEIGHTS, "optimizer.pt"} <= files and "model.safetensors" not in files
    # the same bytes in any process (peft writes target_modules in a salted set's order): one policy digest
    assert json.loads((Path(ref.path) / ADAPTER_CONFIG).read_text())["target_modules"] == sorted(LORA.target_modules)
    saved = load_file(str(Path(ref.path) / ADAPTER_WEIGHTS))
    adapter = peft.get_peft_model_state_dict(model)  # the adapter tensors by name
    assert saved.keys() == adapter.keys() and all(torch.equal(saved[k], v) for k, v in adapter.items())
    loaded, _ = load_policy(ref.path)
    model.eval()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=probe).logits, model(input_ids=probe).logits)
    assert all(p.requires_grad == ("lora_" in n) for n, p in loaded.named_parameters())  # trainable again
    assert load_optimizer_state(ref, torch.optim.AdamW(loaded.parameters(), lr=1e-2))


def test_learner_builds_a_lora_policy_and_each_checkpoints_adapter_is_logged(tiny_policy_dir, tmp_path):
    from horizonrl.run.learner import initial_model_dir
    from horizonrl.run.owners import build_run
    from horizonrl.tracking import mlflow_runs
    from mlflow import MlflowClient
    from tasks.context import RunContext
    from tasks.tracking import log_adapter

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    cfg = load_config(
        None, [f"model.path={tiny_policy_dir}", "model.lora.rank=4", f"data_dir={tmp_path}/data", f"tracking_uri={uri}"]
    )
    c = MlflowClient(uri)
    run_id = c.create_run(c.create_experiment("lora", artifact_location=(tmp_path / "artifacts").as_uri())).info.run_id
    built = build_run(cfg)
    learner, player = built.learner, built.player
    model, tokenizer = load_policy(initial_model_dir(cfg, built.suite))  # what the run's start does
    ref0 = save_checkpoint(tmp_path / "run", 0, model, tokenizer, None, {"mlflow_run_id": run_id})
    loaded = learner.get(ref0)
    player.sync(ref0)
    assert type(loaded.model).__name__ == "PeftModelForCausalLM" and player.engine.model is loaded.model
    assert player.engine.device.type == "cpu"
    assert next(p for n, p in loaded.model.named_parameters() if "lora_A" in n).requires_grad
    ref1 = save_checkpoint(
        tmp_path / "run", 1, loaded.model, loaded.tokenizer, loaded.optimizer, {"mlflow_run_id": run_id}
    )
    assert stored_probe(ref1.path) is None  # an adapter is hot-loaded, never checked against a probe
    learner.weights.advance(ref1)  # what the learner's update does after writing the checkpoint; the task logs it
    log_adapter(RunContext(cfg, str(tmp_path / "run"), uri, run_id), ref1)
    logged = {Path(a.path).name for a in c.list_artifacts(run_id, "adapters/iter=00001")}
    assert logged == {ADAPTER_CONFIG, ADAPTER_WEIGHTS}
    assert mlflow_runs.tracking_uri(cfg.tracking_uri) == uri
    c.set_terminated(run_id)  # runs end (the suite checks none is left RUNNING)
