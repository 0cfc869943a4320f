"""Checkpoints are verified on resume: a part missing or changed is named, the run falls back to the newest
checkpoint that verifies and replays from there; stored rollouts are checked against the digest recorded
for them; a finished run run again logs nothing twice."""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch
from flowkit import flat, newest_checkpoint, run_of, tiny_config
from safetensors.torch import load_file

from horizonrl import store
from horizonrl.models.loading import load_policy
from horizonrl.models.probe import probe_of, stored_probe
from horizonrl.training.checkpoint import (
    MANIFEST,
    CheckpointRef,
    checkpoint_dir,
    save_checkpoint,
    verify,
)
from mlflow import MlflowClient


def test_manifest_names_a_missing_resized_or_changed_file(tmp_path, tiny_policy):
    model, tokenizer, *_ = tiny_policy
    ref = save_checkpoint(tmp_path, 1, model, tokenizer, torch.optim.AdamW(model.parameters()), {}, {"memory": [1]})
    folder = checkpoint_dir(tmp_path, 1)
    listed = json.loads((folder / MANIFEST).read_text())["files"]
    assert {"model.safetensors", "probe.pt", "optimizer.pt", "estimator_state.json", "state.json"} <= set(listed)
    assert verify(ref) is None
    weights = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(weights[:-1] + bytes([weights[-1] ^ 1]))  # same size, one bit flipped
    assert verify(ref).startswith("model.safetensors differs from the file written")
    (folder / "model.safetensors").write_bytes(weights[:-8])
    assert verify(ref) == f"model.safetensors has {len(weights) - 8} bytes, its manifest says {len(weights)}"
    (folder / "optimizer.pt").unlink()
    (folder / "model.safetensors").write_bytes(weights)
    assert verify(ref) == "optimizer.pt is missing"
    (folder / MANIFEST).unlink()
    assert "manifest.json is missing" in verify(ref)
    assert newest_checkpoint(tmp_path) is None


def test_a_full_weight_checkpoint_carries_the_probe_of_the_weights_it_holds(tmp_path, tiny_policy):
    """The probe stored with the weights is the one the weights read back compute (what a sync of a vLLM
    server to this checkpoint is checked against, with no model loaded by whoever syncs), and not the
    probe of the weights before the update that wrote them."""
    model, tokenizer, *_ = tiny_policy
    before = probe_of(model, model.get_input_embeddings().num_embeddings)
    moved = copy.deepcopy(model)
    with torch.no_grad():
        moved.lm_head.weight.add_(0.05 * torch.randn_like(moved.lm_head.weight))
    moved.train()
    ref = save_checkpoint(tmp_path, 1, moved, tokenizer, None, {})
    assert moved.training  # the probe's forward pass left the learner's mode as it was
    stored = stored_probe(ref.path)
    reloaded = load_policy(ref.path)[0]
    again = probe_of(reloaded, reloaded.get_input_embeddings().num_embeddings)
    assert stored.prompt == again.prompt == before.prompt
    assert len(stored.logprobs) == model.get_input_embeddings().num_embeddings
    assert max(abs(a - b) for a, b in zip(stored.logprobs, again.logprobs)) <= 1e-6
    assert max(abs(a - b) for a, b in zip(stored.logprobs, before.logprobs)) > 1e-3
    assert stored_probe(tmp_path) is None  # a folder written without one


@contextmanager
def prefect_messages() -> Iterator[list[str]]:
    """Messages of Prefect's loggers within the block. Installed per call: importing the flow's modules
    the first time reconfigures logging (dropping a handler added earlier), and pytest's capture does not
    see Prefect's run loggers."""
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    handler, logger = Collect(logging.INFO), logging.getLogger("prefect")
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)


PARTS = ["model.safetensors", "optimizer.pt", "estimator_state.json", "state.json"]


@pytest.mark.slow
def test_a_damaged_checkpoint_is_named_and_replayed_from_the_one_before(prefect_harness, tmp_path):
    """BLPO (it has estimator state) for 2 iterations; then each part of checkpoint 2 in turn is deleted
    and the same run started again: each restart names the part, falls back to checkpoint 1 and replays
    iteration 2 into the very weights, optimizer state and BLPO memory of the first run, and logs no
    metric, summary or model twice. Last, a stored rollout file changed after it was written stops the
    replay, named, instead of being reused."""
    from flows.train import train

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    cfg = tiny_config(tmp_path, uri, "ck", iterations=2)
    cfg.update(method="blpo", eval={"every": 2, "n_tasks": 2, "greedy": False})
    train(config=cfg)
    run_dir = tmp_path / "data" / "test" / "ck"
    ck2 = checkpoint_dir(run_dir, 2)
    weights = load_file(ck2 / "model.safetensors")
    optimizer = torch.load(ck2 / "optimizer.pt", weights_only=True)
    memory = (ck2 / "estimator_state.json").read_text()
    assert json.loads(memory), "BLPO wrote no estimator state, so the test would check nothing"

    for part in PARTS:
        (ck2 / part).unlink()
        with prefect_messages() as messages:
            train(config=cfg)
        log = "\n".join(messages)
        assert f"checkpoint {ck2} fails verification: {part} is missing" in log, part
        assert f"falling back to checkpoint {checkpoint_dir(run_dir, 1)}" in log, part
        assert verify(CheckpointRef(str(ck2), 2)) is None, part
        got = load_file(ck2 / "model.safetensors")
        assert all(torch.equal(got[k], weights[k]) for k in weights), f"{part}: the replayed weights differ"
        replayed = torch.load(ck2 / "optimizer.pt", weights_only=True)["state"]
        for p, moments in optimizer["state"].items():
            assert all(torch.equal(replayed[p][k], v) for k, v in moments.items()), (
                f"{part}: optimizer state of parameter {p} differs"
            )
        assert (ck2 / "estimator_state.json").read_text() == memory, part

    c = MlflowClient(uri)
    run = run_of(c, "ck")
    for key in run.data.metrics:
        history = [m.step for m in c.get_metric_history(run.info.run_id, key)]
        assert len(history) == len(set(history)), f"{key} logged twice at a step: {history}"
    assert [m.step for m in c.get_metric_history(run.info.run_id, "summary/final_success_rate")] == [2]
    assert sorted(m.step for m in c.get_metric_history(run.info.run_id, "eval/success_rate")) == [0, 2]
    import mlflow

    mlflow.set_tracking_uri(uri)
    models = mlflow.search_logged_models(experiment_ids=[run.info.experiment_id], output_format="list")
    assert [m.name for m in models] == ["policy"], "the finished run logged its policy model again"
    assert run.info.status == "FINISHED"

    episodes = store.iteration_dir(tmp_path / "data", "test", "ck", 2) / "episodes.parquet"
    table = pq.read_table(episodes)
    changed = table.set_column(table.schema.get_field_index("won"), "won", pa.array([True] * table.num_rows))
    assert not changed.equals(table)
    pq.write_table(changed, episodes)  # valid, same schema and metadata: only the digest tells
    (ck2 / "optimizer.pt").unlink()
    with pytest.raises(
        store.StoreError, match=f"{episodes}: sha256 .* differs from the digest recorded when it was written"
    ):
        train(config=cfg)
    assert pc.all(store.read_table(episodes, "episodes")["won"]).as_py(), "the changed file was replaced, not named"
    assert verify(CheckpointRef(str(ck2), 2)) == "optimizer.pt is missing"


def test_no_checkpoint_verifies_stops_and_says_what_to_do(prefect_harness, tmp_path, capsys):
    """With every checkpoint damaged the run does not silently start over: it stops, naming each."""
    from flows.cli import main

    cfg = tiny_config(tmp_path, f"sqlite:///{tmp_path}/mlflow.db", "none", iterations=1)
    run_dir = tmp_path / "data" / "test" / "none"
    folder = checkpoint_dir(run_dir, 0)
    folder.mkdir(parents=True)
    (folder / "state.json").write_text(json.dumps({"iteration": 0}))  # no manifest
    assert main(["train", *(f"--set={k}={v}" for k, v in flat(cfg).items())]) == 1
    err = capsys.readouterr().err
    assert f"{folder}: manifest.json is missing" in err and f"move {run_dir / 'checkpoints'} away" in err, err
    assert sorted(p.name for p in folder.iterdir()) == ["state.json"]
    assert not (tmp_path / "mlflow.db").exists(), "an MLflow run was created for a run that cannot start"
