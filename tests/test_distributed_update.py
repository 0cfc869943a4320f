"""The update on two ranks (torchrun, gloo, 2 CPU processes) against the same update in one process, for
both strategies (ddp: full replicas; fsdp: FSDP2 shards), served by one rank group.

The ranks are the real thing (``horizonrl.training.rank_group``: torchrun, ``torch.distributed`` with gloo,
a process per rank); the single-process side is ``ppo_update`` as the update task calls it. Tolerances:
weights max |diff| <= 1e-5 (float32; the issue's bound), figures to a relative 1e-5 or an absolute 1e-6
(the sums over micro-batches and ranks differ only in float summation order; the KL figures are sums of
differences of float32 log-probs of about -3, each resolved to ~2.4e-7).
"""

from __future__ import annotations

import dataclasses
import os
import time

import pytest
import torch
from flowkit import newest_checkpoint
from test_reliability import RUN, config, metric_steps, run_dir
from test_trainer import hand_rows, recompute_old_logprobs, settings

import methods
from horizonrl import faults
from horizonrl.config import ModelConfig, RayConfig, TrainConfig
from horizonrl.models.loading import load_policy
from horizonrl.training.checkpoint import (
    CheckpointRef,
    load_optimizer_state,
    save_checkpoint,
    verify,
)
from horizonrl.training.iteration import UpdatePlan, update_policy
from horizonrl.training.parallel import balanced_shares, rank_device, update_backend
from horizonrl.training.rank_group import RankFailed, RankGroup
from horizonrl.training.rank_worker import pid_alive
from horizonrl.training.trainer import ppo_update

KL_REF = methods.LOSSES.get("ppo_clip").params_cls(clip_mode="asymmetric", aggregation="token-mean", kl_coef=0.1)
# The run's default rate. AdamW divides by the gradient's running scale, so float summation order alone
# moves the weights by ~lr * 1e-3: one process with another micro-batch split differs from itself by
# 2e-6 at lr 1e-3 and by 4-7e-5 at lr 1e-2 (measured on these rows, 6 steps).
LR, WD = 1e-3, 0.01


TORCHRUN_REPORT = """
============================================================
horizonrl.training.rank_worker FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-04_13:29:36
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 24361)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 24361
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-04_13:29:35
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 24360)
  error_file: /tmp/torchelastic/error.json
  traceback : Traceback (most recent call last):
    RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:18142: Connection reset by peer.
============================================================
"""


# Seen in a run: torchrun stopped rank 0 with SIGTERM after rank 1's SIGKILL, and lists rank 0 first.
TORCHRUN_STOPPED_PEER = """
W1204 14:40:27.250000 11579 api.py:1028] Sending process 11632 closing signal SIGTERM
E1204 14:40:27.469000 11579 api.py:1002] failed (exitcode: -9) local_rank: 1 (pid: 11633) of binary: python
horizonrl.training.rank_worker FAILED
-------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-04_14:40:27
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 11632)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 11632
-------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-04_14:40:27
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 11633)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 11633
=======================================================
"""


def test_a_killed_rank_is_named_though_torchrun_observed_its_peer_first(tmp_path):
    """When rank 1 is killed, rank 0 fails on the closed connection, and under load torchrun may report
    rank 0 as the "first observed failure" (seen in a suite run): the error names the killed rank, and not
    rank 0's connection error as the cause."""
    group = RankGroup.__new__(RankGroup)  # only the report parsing: no torchrun started
    group.log, group.world_size = tmp_path / "torchrun.log", 2
    group.log.write_text(TORCHRUN_REPORT)
    said = group._failure().split(";")[0]
    assert said == "update rank 1 of 2 failed: -9 (pid: 24361)", said
    group.log.write_text(
        TORCHRUN_REPORT.replace("Signal 9 (SIGKILL) received by PID 24361", "Traceback: ValueError: x")
    )
    assert group._failure().startswith("update rank 0 of 2 failed: 1 (pid: 24360)")  # no kill: the root cause
    group.log.write_text(TORCHRUN_STOPPED_PEER)  # the peer torchrun stopped itself is not the killed rank
    assert group._failure().split(";")[0] == "update rank 1 of 2 failed: -9 (pid: 11633)  (SIGKILL)"


def test_balanced_shares_are_disjoint_complete_and_balanced():
    weights = [50, 10, 40, 30, 30, 20, 5, 5]
    shares = balanced_shares(weights, 2)
    assert sorted(i for s in shares for i in s) == list(range(8))
    loads = [sum(weights[i] for i in s) for s in shares]
    assert abs(loads[0] - loads[1]) <= 10, loads
    assert balanced_shares(weights, 2) == shares, "every rank must compute the same split"
    assert balanced_shares([7], 3) == [[0], [], []], "a share may be empty"


def test_the_backend_is_nccl_on_cuda_and_a_rank_holds_the_gpu_of_its_local_rank():
    """The run's choice (``Learner.update_ranks``: ``update_backend(model.device)``) and where a rank
    puts its model (``rank_device``, torchrun's and Ray's ranks alike). No GPU here: the nccl ranks
    themselves run in ``test_nccl_ranks_on_cuda_give_the_weights_and_figures_of_one_process`` (make gpu-check)."""
    assert update_backend("cuda") == update_backend("cuda:1") == "nccl"
    assert update_backend("cpu") == "gloo"
    assert update_backend("auto") == ("nccl" if torch.cuda.is_available() else "gloo")
    assert rank_device("nccl", 1) == torch.device("cuda", 1) and rank_device("nccl", 0) == torch.device("cuda", 0)
    assert rank_device("gloo", 1) == torch.device("cpu")


def test_more_nccl_ranks_than_gpus_is_refused_naming_the_field():
    """torchrun's nccl ranks take a GPU each: with model.device cuda, a world size above the machine's GPUs
    is a config error naming update.world_size; the CPU (gloo) and Ray's cluster GPUs are not limited."""
    base = {"run_name": "gpus", "model": {"device": "cuda"}}
    too_many = max(2, torch.cuda.device_count() + 1)
    with pytest.raises(
        ValueError, match=r"update\.world_size is more than the \d+ GPUs torch sees \(model\.device = 'cuda'\): .*nccl"
    ):
        TrainConfig.model_validate({**base, "update": {"world_size": too_many}})
    TrainConfig.model_validate({**base, "update": {"world_size": too_many, "launcher": "ray"}})
    TrainConfig.model_validate({**base, "model": {"device": "cpu"}, "update": {"world_size": 4}})


def single(policy_dir, rows, s, seed, model=None, optimizer=None, ref=None):
    """``ppo_update`` in this process: (model, optimizer, figures)."""
    if model is None:
        model, _ = load_policy(policy_dir)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    result = ppo_update(model, optimizer, rows, s, seed, ref)
    return model, optimizer, result.stats


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


FIGURES = ("loss", "approx_kl", "traj_kl", "clip_frac", "entropy", "ratio_mean", "steps")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """One group of 2 ranks for the module's library tests (a job that names another policy or strategy
    loads it), so torchrun and the ranks' imports are paid once; stopped at the end, leaving no process."""
    group = RankGroup(tmp_path_factory.mktemp("ranks"), 2, "gloo")
    yield group
    group.stop()
    assert not group.alive


@pytest.fixture(scope="module")
def one_process(tiny_policy_dir):
    """Two updates in a row in this process (the reference both strategies are held to): LOOP's fixed row
    divisor with a short last minibatch and pi_old recomputed, then token-mean with a KL to the reference
    and the pi_old shortcut taken. Returns the jobs' inputs and the resulting model, optimizer, figures."""
    model, tokenizer = load_policy(tiny_policy_dir)
    vocab = model.get_output_embeddings().weight.shape[0]
    rows = hand_rows(vocab, 21, seed=5)  # 21 trajectories, minibatch 8: the last minibatch has 5
    s1 = settings(tokenizer.pad_token_id, epochs=2, fixed_row_divisor=True, micro_batch_tokens=120)
    ref, _ = load_policy(tiny_policy_dir)
    ref.eval().requires_grad_(False)
    model, optimizer, stats1 = single(tiny_policy_dir, rows, s1, seed=11)
    weights1 = {k: v.clone() for k, v in model.state_dict().items()}
    rows2 = hand_rows(vocab, 16, seed=6)
    old2 = recompute_old_logprobs(model, rows2, s1)  # the stored log-probs are pi_old: the shortcut applies
    rows2 = [dataclasses.replace(r, sample_logp=o) for r, o in zip(rows2, old2)]
    s2 = settings(tokenizer.pad_token_id, loss_params=KL_REF, pi_old_tol=1e-3, grad_clip=0.5)
    model, optimizer, stats2 = single(tiny_policy_dir, rows2, s2, seed=12, model=model, optimizer=optimizer, ref=ref)
    return rows, s1, stats1, rows2, s2, stats2, model, optimizer, weights1


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_give_the_weights_and_figures_of_one_process(tiny_policy_dir, ranks, one_process, strategy):
    """The two updates of ``one_process`` on one rank group (kept alive, the second continuing from the
    first's weights and AdamW state, held whole under ddp and sharded under fsdp)."""
    check_two_updates(ranks, tiny_policy_dir, one_process, strategy)


@pytest.mark.slow
@pytest.mark.extra  # the ray extra
def test_a_ray_actor_group_gives_the_weights_and_figures_of_one_process(tiny_policy_dir, one_process):
    """``update.launcher: ray``: the first update on 2 Ray actors of a local cluster (as the run starts
    it, ``Cluster.join``), sharded (fsdp): its weights and figures are one process's, and the
    actors' processes are gone after ``stop``. (Continuing across jobs is the torchrun tests'; the rank
    code is the same.)"""
    from horizonrl.run.cluster import Cluster
    from horizonrl.training.ray_ranks import RayRankGroup

    cluster = Cluster(RayConfig(num_cpus=2))
    cluster.join()
    try:
        group = RayRankGroup(2, "gloo")
        try:
            rows, s1, stats1, _, _, _, model, _, weights1 = one_process
            common = dict(lr=LR, weight_decay=WD, model=ModelConfig(), iteration=1, strategy="fsdp")
            out = group.update(policy=str(tiny_policy_dir), rows=rows, settings=s1, seed=11, **common)
            assert max_diff(out["model"], weights1) <= 1e-5
            for k in FIGURES:
                assert out["stats"][k] == pytest.approx(stats1[k], rel=1e-5, abs=1e-6), k
            n, held = sum(p.numel() for p in model.parameters()), out["held_numel"]
            assert sum(held) == n and max(held) < 0.51 * n and out["stats"]["world_size"] == 2.0, held
        finally:
            pids = group.rank_pids()
            group.stop()
        deadline = time.monotonic() + 30
        while any(pid_alive(p) for p in pids.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(pids) == 2 and not any(pid_alive(p) for p in pids.values()), pids
    finally:
        cluster.leave()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (make gpu-check runs it)")
def test_nccl_ranks_on_cuda_give_the_weights_and_figures_of_one_process(tiny_policy_dir, one_process, tmp_path):
    """``model.device: cuda``: ranks on the backend a run picks there (nccl), each on the GPU of its local
    rank, give the first update of ``one_process`` done in this process on cuda:0, float32, for ddp and
    fsdp. Two ranks need two GPUs (nccl refuses two ranks on one device); on one GPU it is one rank, which
    still runs the nccl group, the model on its GPU, the all-reduce or FSDP2's reduce-scatter and the
    gather of the whole state."""
    rows, s1, *_ = one_process
    model, _ = load_policy(tiny_policy_dir)
    model.to("cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    _, _, stats = single(tiny_policy_dir, rows, s1, seed=11, model=model, optimizer=optimizer)
    want = {k: v.cpu() for k, v in model.state_dict().items()}
    n = min(2, torch.cuda.device_count())
    group = RankGroup(tmp_path, n, update_backend("cuda"))
    try:
        for strategy in ("ddp", "fsdp"):
            out = group.update(
                policy=str(tiny_policy_dir),
                rows=rows,
                settings=s1,
                seed=11,
                lr=LR,
                weight_decay=WD,
                model=ModelConfig(device="cuda", dtype="float32"),
                iteration=1,
                strategy=strategy,
            )
            assert max_diff(out["model"], want) <= 1e-5, strategy
            for k in FIGURES:
                assert out["stats"][k] == pytest.approx(stats[k], rel=1e-5, abs=1e-6), (strategy, k)
            assert out["stats"]["world_size"] == float(n)
    finally:
        group.stop()
    assert not group.alive


def check_two_updates(ranks, tiny_policy_dir, one_process, strategy: str) -> None:
    """``one_process``'s two updates on the rank group ``ranks`` against its figures, weights and AdamW state."""
    rows, s1, stats1, rows2, s2, stats2, model, optimizer, _ = one_process
    common = dict(lr=LR, weight_decay=WD, model=ModelConfig(), iteration=1, strategy=strategy)
    out1 = ranks.update(policy=str(tiny_policy_dir), rows=rows, settings=s1, seed=11, **common)
    ranks.advance(CheckpointRef("in-memory", 1))  # the ranks continue from their own state
    pids = ranks.rank_pids()
    out2 = ranks.update(policy="in-memory", rows=rows2, settings=s2, seed=12, reference=str(tiny_policy_dir), **common)
    assert ranks.rank_pids() == pids and len(pids) == 2, "the same two ranks served both updates"
    n = sum(p.numel() for p in model.parameters())
    held = out2["held_numel"]  # fsdp: each weight's dim 0 split in two (the first part the larger when odd)
    assert held == [n, n] if strategy == "ddp" else (sum(held) == n and max(held) < 0.51 * n), held

    assert max_diff(out2["model"], model.state_dict()) <= 1e-5
    for got, want in ((out1["stats"], stats1), (out2["stats"], stats2)):
        for k in FIGURES:
            assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-6), k
    assert stats2["kl_ref"] > 0 and out2["stats"]["kl_ref"] == pytest.approx(stats2["kl_ref"], rel=1e-5, abs=1e-7)
    assert out2["stats"]["pi_old_shortcut"] == stats2["pi_old_shortcut"] == 1.0
    assert out1["stats"]["world_size"] == 2.0 and 0.0 < out1["stats"]["comm_share"] < 1.0
    assert out1["stats"]["step_s_rank0"] > 0 and out1["stats"]["step_s_rank1"] > 0
    # the optimizer state is whole: it loads into a one-process AdamW and equals this process's
    fresh = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    fresh.load_state_dict(out2["optimizer"])
    for p in model.parameters():
        a, b = fresh.state[p], optimizer.state[p]
        assert float((a["exp_avg"] - b["exp_avg"]).abs().max()) <= 1e-6


def _iteration(cfg, run_dir, it, policy, rows, s, ranks=None):
    """Iteration ``it`` as the update task runs it from checkpoint ``policy`` loaded afresh (a new process,
    or a resume): weights and AdamW state from disk, then ``update_policy``."""
    model, tokenizer = load_policy(policy.path)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.update.lr, weight_decay=cfg.update.weight_decay)
    load_optimizer_state(policy, optimizer)
    plan = dataclasses.replace(UpdatePlan.from_config(cfg, horizon=1), settings=s)
    return update_policy(plan, run_dir, it, policy, model, tokenizer, optimizer, rows, 100 + it, {}, ranks=ranks)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_checkpoint_resumes_with_another_world_size(tiny_policy_dir, ranks, tmp_path, strategy):
    """Iterations 1-2 in one process (the reference), against 2 ranks then 1 process and 1 process then 2
    ranks: every checkpoint verifies against its manifest and the second one's weights are the reference's
    (max |diff| <= 1e-5), so a checkpoint is whole whatever world size or strategy wrote it or reads it."""
    update = {"lr": LR, "lr_final": LR / 2, "strategy": strategy}
    cfg = TrainConfig.model_validate({"run_name": "ws", "iterations": 2, "update": update})
    model, tokenizer = load_policy(tiny_policy_dir)
    vocab = model.get_output_embeddings().weight.shape[0]
    rows = [hand_rows(vocab, 12, seed=20 + it) for it in (1, 2)]
    s = settings(tokenizer.pad_token_id, epochs=2, minibatch_size=5, fixed_row_divisor=True)
    runs = {name: tmp_path / name for name in ("one", "two-one", "one-two")}
    start = {name: save_checkpoint(d, 0, model, tokenizer, None, {}) for name, d in runs.items()}

    ref1, _ = _iteration(cfg, runs["one"], 1, start["one"], rows[0], s)
    ref2, stats = _iteration(cfg, runs["one"], 2, ref1, rows[1], s)
    assert stats["steps"] > 0 and stats["lr"] == LR / 2
    want = load_policy(ref2.path)[0].state_dict()

    a1, stats_a = _iteration(cfg, runs["two-one"], 1, start["two-one"], rows[0], s, ranks)
    assert stats_a["world_size"] == 2.0
    b1, _ = _iteration(cfg, runs["one-two"], 1, start["one-two"], rows[0], s)
    b2, stats_b = _iteration(cfg, runs["one-two"], 2, b1, rows[1], s, ranks)  # the ranks load b1 from disk
    assert stats_b["world_size"] == 2.0
    a2, _ = _iteration(cfg, runs["two-one"], 2, a1, rows[1], s)
    for ref in (a1, a2, b1, b2):
        assert verify(ref) is None, ref
    for ref in (a2, b2):
        assert max_diff(load_policy(ref.path)[0].state_dict(), want) <= 1e-5, ref


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_lora_adapters_train_on_two_ranks_as_in_one_process(tiny_policy_dir, ranks, tmp_path, strategy):
    """A LoRA policy (peft): only the adapters have gradients, so only they are all-reduced (ddp) or
    reduce-scattered into their shards (fsdp, the frozen base weights sharded beside them); the two ranks'
    adapters equal one process's (max |diff| <= 1e-5) and the base weights do not move."""
    from horizonrl.config import LoraConfig
    from horizonrl.models.loading import initial_adapter_dir

    adir = initial_adapter_dir(tmp_path, tiny_policy_dir, LoraConfig(rank=4, alpha=8.0), seed=0)
    model, tokenizer = load_policy(adir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rows = hand_rows(model.get_output_embeddings().weight.shape[0], 10, seed=9)
    s = settings(tokenizer.pad_token_id, epochs=2, minibatch_size=4, fixed_row_divisor=True)
    model, _, stats = single(adir, rows, s, seed=3)
    out = ranks.update(
        policy=str(adir),
        rows=rows,
        settings=s,
        seed=3,
        lr=LR,
        weight_decay=WD,
        model=ModelConfig(),
        iteration=1,
        strategy=strategy,
    )
    got, want = out["model"], model.state_dict()
    lora_keys = [k for k in want if "lora_" in k]
    assert lora_keys and stats["steps"] > 0
    assert max(float((got[k] - before[k]).abs().max()) for k in lora_keys) > 1e-4, "the adapters trained"
    assert max_diff(got, want) <= 1e-5
    assert all(torch.equal(got[k], before[k]) for k in want if "lora_" not in k), "base weights unchanged"
    n, held = sum(p.numel() for p in model.parameters()), out["held_numel"]
    assert held == [n, n] if strategy == "ddp" else (sum(held) == n and max(held) < 0.51 * n), held


def rank_processes(root) -> list[int]:
    """Pids of live update ranks (and their torchrun) of runs under ``root``: their command line names the
    run's spool folder. Orphans count: a rank whose torchrun died is no child of this process."""
    import psutil

    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        if any(str(root) in a for a in p.info["cmdline"] or []) and p.pid != os.getpid():
            found.append(p.pid)
    return found


@pytest.mark.slow
def test_a_killed_rank_fails_the_run_naming_it_and_the_rerun_resumes(prefect_harness, tmp_path, monkeypatch):
    """The train flow (in this process, on the session's Prefect harness) with ``update.world_size: 2``:
    iteration 1's update runs on the ranks, then the last rank SIGKILLs itself on receiving iteration 2's
    job (``HORIZONRL_FAULT=update-rank:2``; torchrun's own processes, inheriting the variable). The run
    fails with the rank named, no rank left and checkpoint 1 kept; the same run again starts new ranks from
    checkpoint 1, finishes, and leaves no rank behind (the spool folder is removed when the ranks stop)."""
    from flows.train import train

    cfg = config(tmp_path, iterations=2, update={"minibatch_size": 2, "world_size": 2})
    cfg["eval"]["every"] = 10  # before the first iteration and after the last only
    monkeypatch.setenv(faults.ENV, "update-rank:2")
    with pytest.raises(RankFailed, match=r"^update rank 1 of 2 failed: -9 "):
        train(config=cfg)
    assert newest_checkpoint(run_dir(tmp_path)).iteration == 1
    deadline = time.monotonic() + 30
    while rank_processes(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not rank_processes(tmp_path), "a rank outlived the failed update"
    monkeypatch.delenv(faults.ENV)
    train(config=cfg)
    assert newest_checkpoint(run_dir(tmp_path)).iteration == 2
    steps = metric_steps(f"sqlite:///{tmp_path}/mlflow.db", RUN)
    assert steps["update/comm_share"] == [1, 2] and steps["update/world_size"] == [1, 2]
    assert not list((run_dir(tmp_path) / ".update-ranks").glob("*/")), "the ranks' spool is left"
    assert not rank_processes(tmp_path), "a rank outlived the run"
