"""The vLLM engine on a real pretrained model, SmolLM2-135M-Instruct (Llama architecture, head_dim 64, 49,152
ids, ChatML), beside ``tests/test_vllm_live.py``'s tiny model: a real vLLM server (``.venv-vllm``, the CPU
build here) against transformers on the same float32 weights, tolerance 1e-4 nats.

The model is the cached ``data/models/smollm2-135m-instruct`` (``make setup-test`` fetches it; else the first
use here does). One server for the module (start-up ~35-60 s on 2 shared cores), with the trie processor,
the development endpoints and runtime LoRA loading; short household prompts and few tokens, so the module
costs little beyond the start. Tests that change the served weights put the start-up weights back; the
end-to-end run goes last and leaves its own checkpoint served. Marked slow (``make test``, not
``make test-fast``); never skipped.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_vllm_live import LORA_RANK, REQUESTS, TOL, _learner_logprobs, _plays_like, _prompts, _same, start_engine

from horizonrl.config import LoraConfig
from horizonrl.engines.base import SampleRequest, TokenTrie
from horizonrl.engines.hf import TransformersEngine
from horizonrl.engines.vllm_server import SERVED_NAME
from horizonrl.models import pretrained
from horizonrl.models.loading import initial_adapter_dir, load_policy
from horizonrl.models.probe import probe_of
from horizonrl.rollout.prompting import ChatFormat

pytestmark = pytest.mark.slow
DATA = Path(__file__).resolve().parents[1] / "data"  # the cache `make setup-test` fills
TOP_LOGPROBS = 64  # engine.vllm.top_logprobs' default: admissible entropies exact up to 64 allowed ids


@pytest.fixture(scope="module")
def smollm2():
    """(directory, model, tokenizer, fmt, transformers engine) of SmolLM2-135M-Instruct in float32."""
    torch.set_num_threads(1)
    path = pretrained.fetch("smollm2-135m-instruct", DATA)
    model, tokenizer = load_policy(path)
    fmt = ChatFormat.for_tokenizer(tokenizer)
    return path, model.eval(), tokenizer, fmt, TransformersEngine(model, tokenizer.pad_token_id, list(fmt.stop_ids))


@pytest.fixture(scope="module")
def real(smollm2, tmp_path_factory):
    """An engine owning a real server on SmolLM2 (saved untied: its serving copy only links the files)."""
    path, _, _, fmt, hf = smollm2
    root = tmp_path_factory.mktemp("vllm-real")
    engine = start_engine(path, root, hf.end_ids, TOP_LOGPROBS, 2048)
    try:
        engine.generate(
            SampleRequest([fmt.user("warm up.")], [None], 2, 1.0, True, 0)
        )  # the first request initialises lazily
        yield engine
    finally:
        engine.close()


def _tries(fmt, commands, admissible: bool = True) -> list[TokenTrie | None]:
    return [TokenTrie([fmt.command(c) for c in cs], cs) if admissible else None for cs in commands]


@pytest.mark.parametrize("admissible", [True, False])
def test_greedy_window_generations_equal_transformers(real, smollm2, household_suite, admissible):
    """Window prompts (goal as system message, observation): the same greedy tokens, masks, allowed sets and
    finished flags as transformers; log-probs within 1e-4 (admissible at T = 0.7 over each allowed set, one
    request per action; free at T = 1 over the 49k vocabulary), entropies equal (admissible) or the top-64
    lower bound (free)."""
    _, _, _, fmt, hf = smollm2
    prompts, commands = _prompts(fmt, household_suite)
    tries = _tries(fmt, commands, admissible)
    temperature, budget = (0.7, 12) if admissible else (1.0, 6)
    before = real.client.metrics()[REQUESTS]
    gens = real.generate(SampleRequest(prompts, tries, budget, temperature, True, 0))
    assert real.client.metrics()[REQUESTS] - before == len(prompts)
    for v, h, cs in zip(gens, hf.generate(SampleRequest(prompts, tries, budget, temperature, True, 0)), commands):
        if admissible:
            assert v.token_ids in [fmt.command(c) for c in cs]
        else:  # free: vLLM's entropy is over its top 64 ids, a lower bound of the whole vocabulary's
            assert all(a <= b + TOL for a, b in zip(v.entropy, h.entropy))
            h = replace(h, entropy=v.entropy)
        _same(v, h)


def test_full_context_session_equals_the_transformers_session(real, smollm2, household_suite):
    """Two turns of a full-history session (one slot leaves after the first): each turn's greedy admissible
    action and its log-probs equal the transformers session's."""
    _, _, _, fmt, hf = smollm2
    prompts, commands = _prompts(fmt, household_suite, history=1)
    vs, hs = real.session(), hf.session()
    schedule = [([0, 1, 2], prompts), ([2, 0], [fmt.user("Nothing happens."), fmt.user("You see nothing.")])]
    for slots, new_ids in schedule:
        tries = _tries(fmt, [commands[s] for s in slots])
        for v, h in zip(
            vs.extend(slots, SampleRequest(new_ids, tries, 12, 0.7, True, 0)),
            hs.extend(slots, SampleRequest(new_ids, tries, 12, 0.7, True, 0)),
        ):
            _same(v, h)


def test_sampled_free_actions_carry_the_learners_logprobs_over_the_whole_vocabulary(real, smollm2, household_suite):
    """Seeded sampling at T = 1 over all 49,152 ids: the same seed reproduces the tokens (log-probs to float
    rounding: concurrent requests batch differently, measured 1.4e-6), and every sampled token's
    log-prob (what a run stores as the behaviour log-prob) equals the learner's teacher-forced one within 1e-4."""
    _, model, _, fmt, _ = smollm2
    prompts, _ = _prompts(fmt, household_suite)
    a, b = (real.generate(SampleRequest(prompts, [None] * 3, 5, 1.0, False, 7)) for _ in range(2))
    assert [g.token_ids for g in a] == [g.token_ids for g in b]  # log-probs: to float rounding (batching)
    assert [lp for g in a for lp in g.logprobs] == pytest.approx([lp for g in b for lp in g.logprobs], abs=1e-5)
    for p, g in zip(prompts, a):
        assert g.logprobs == pytest.approx(_learner_logprobs(model, p, g, 1.0), abs=TOL)


def test_full_weights_reload_in_place_verified_by_the_probe(real, smollm2, household_suite, tmp_path):
    """A moved SmolLM2 checkpoint (untied head, as the trainer saves this model) reaches the running server in
    place, no restart, the probe within 1e-4; greedy admissible actions then equal transformers' on the moved
    weights. The start-up weights go back in place too."""
    path, model, tokenizer, fmt, hf = smollm2
    moved, _ = load_policy(path)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=gen))
    moved.save_pretrained(tmp_path / "iter=1", safe_serialization=True)
    tokenizer.save_pretrained(tmp_path / "iter=1")
    pid = real.server.proc.pid
    try:
        real.sync(str(tmp_path / "iter=1"), probe_of(moved.eval(), len(tokenizer)))
        s = real.last_sync
        assert (s.path, s.reason) == ("in_place", None) and s.probe_max_diff <= TOL and real.server.proc.pid == pid
        _plays_like(real, TransformersEngine(moved, tokenizer.pad_token_id, hf.end_ids), fmt, household_suite, 12)
    finally:
        real.sync(str(path), probe_of(model, len(tokenizer)))
    assert real.last_sync.path == "in_place" and real.last_sync.probe_max_diff <= TOL and real.server.proc.pid == pid


def test_a_lora_adapter_hot_loads_and_serves_the_learners_logprobs(real, smollm2, household_suite, tmp_path):
    """LoRA adapters over SmolLM2 (rank 8, every projection), moved from their zero start, reach the running
    server through ``/v1/load_lora_adapter`` (path ``adapter``, no restart): greedy admissible actions equal
    transformers' on base + adapter, and the served log-probs equal the learner's (peft) within 1e-4."""
    path, _, tokenizer, fmt, hf = smollm2
    learner, _ = load_policy(initial_adapter_dir(tmp_path, path, LoraConfig(rank=LORA_RANK), 0))
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in learner.named_parameters():
            if "lora_" in name:
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
    learner.save_pretrained(tmp_path / "iter=1", safe_serialization=True)
    tokenizer.save_pretrained(tmp_path / "iter=1")
    pid = real.server.proc.pid
    prompts, commands = _prompts(fmt, household_suite)
    tries = _tries(fmt, commands)
    try:
        real.sync(str(tmp_path / "iter=1"))
        assert real.last_sync.path == "adapter" and real.server.proc.pid == pid
        with torch.no_grad():
            merged = load_policy(tmp_path / "iter=1")[0].merge_and_unload().eval()
        gens = real.generate(SampleRequest(prompts, tries, 12, 0.7, True, 0))
        merged_hf = TransformersEngine(merged, tokenizer.pad_token_id, hf.end_ids)
        for p, v, h in zip(prompts, gens, merged_hf.generate(SampleRequest(prompts, tries, 12, 0.7, True, 0))):
            _same(v, h)
            assert v.logprobs == pytest.approx(_learner_logprobs(learner.eval(), p, v, 0.7), abs=TOL)
    finally:
        if real.model != SERVED_NAME:
            real.client.post("/v1/unload_lora_adapter", {"lora_name": real.model})
        real.model, real.policy_path = SERVED_NAME, None  # the base again: what the server started on


def test_a_train_run_on_smollm2_end_to_end(real, smollm2, prefect_harness, tmp_path):
    """One iteration of the real train flow on SmolLM2 with LoRA adapters (2 tasks x 2 rollouts, 2 turns,
    window context) played on this server, the adapters hot-loaded: the run finishes, its update found the
    learner's recomputed log-probs of the sampled actions within 1e-4 of the sampler's
    (``update/pi_old_max_diff``, 49k-id vocabulary), and it evaluated before and after. LoRA keeps the
    run's checkpoints and logged model to megabytes (full weights: 1.7 GB each with AdamW's state, about a
    minute of the suite's time); the full-weight reload is the test above's."""
    from flowkit import run_of, tiny_config

    from flows.train import train
    from mlflow import MlflowClient

    path = smollm2[0]
    cfg = tiny_config(tmp_path, f"sqlite:///{tmp_path}/mlflow.db", "smollm2", iterations=1)
    cfg.update(
        model={"path": str(path), "lora": {"rank": LORA_RANK}},  # adapters: checkpoints of MBs, not 1.7 GB
        env={"name": "household", "tier": "easy", "max_turns": 2, "train_pool": 50},
        advantage_params={"kl_lambda": 0.5},  # a constant advantage: the update has rows to train on
        update={"minibatch_size": 4, "epochs": 1, "lr": 1e-4},
        engine={"name": "vllm", "vllm": {"url": real.client.base_url, "top_logprobs": TOP_LOGPROBS}},
        eval={"every": 10, "n_tasks": 1},
    )
    try:
        train(config=cfg)
    finally:
        real.policy_path = None  # the server now serves this run's checkpoint
    c = MlflowClient(cfg["tracking_uri"])
    run = run_of(c, "smollm2")
    assert run.info.status == "FINISHED"
    diff = c.get_metric_history(run.info.run_id, "update/pi_old_max_diff")
    assert len(diff) == 1 and 0.0 <= diff[0].value <= TOL
    assert {m.step for m in c.get_metric_history(run.info.run_id, "eval/success_rate")} == {0, 1}
