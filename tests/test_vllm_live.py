"""VLLMEngine against a real vLLM server (vLLM 0.32.0 from ``.venv-vllm``, ``make vllm-venv``): the CPU build
where no CUDA device is present, so these tests run on every machine and are never skipped.

One server for the module (start-up 50-110 s on 2 shared CPU cores, mostly imports; the first request's lazy
initialisation is paid in the fixture), serving the session's tiny policy (Qwen2, hidden 128 / 4 heads:
head_dim 32, which the CPU attention kernel serves; word-level tokenizer, 123 ids) in float32, with the trie
logits processor (one request per admissible action), the development endpoints (in-place weight reloads)
and runtime LoRA loading. The live tests are marked slow (``make test``, not ``make test-fast``). Every check
compares with ``TransformersEngine`` or the learner on the same weights; tolerance 1e-4 nats on log-probs and
entropies (measured: 1e-6). Tests that change the served weights put the start-up weights back; the two
that restart the server run last (a corrupted in-place reload; a killed server, restarted on the Qwen3
policy, which the Qwen3 tokenizer tests then use: two restarts in all, no server of their own).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from horizonrl.config import LoraConfig, ModelConfig
from horizonrl.engines import vllm_cache
from horizonrl.engines.base import SampleRequest, TokenTrie, allowed_log_softmax
from horizonrl.engines.hf import TransformersEngine
from horizonrl.engines.vllm import VLLMEngine
from horizonrl.engines.vllm_server import SERVED_NAME, ServerSpec, VLLMServer, free_port, max_positions, serving_copy
from horizonrl.engines.vllm_wire import VLLMClient, VLLMError, completion_body
from horizonrl.models.loading import initial_adapter_dir, load_policy, tiny_model_dir
from horizonrl.models.probe import probe_of
from horizonrl.rollout.loop import SamplingSettings, collect
from horizonrl.rollout.metrics import EvaluationIncomplete, check_complete
from horizonrl.rollout.prompting import ChatFormat
from horizonrl.rollout.records import ENGINE_FAULT

# A server start (and a restart) costs minutes, and the server runs from .venv-vllm (make setup-test): CI's
# `make test`, not `make test-fast`.
pytestmark = [pytest.mark.slow, pytest.mark.extra]
TOL = 1e-4
VLLM_PYTHON = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"
REQUESTS = "vllm:request_success_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"
LORA_RANK = 8
VLLM_CACHE = vllm_cache.cache_root()  # the machine's, as a run's server uses (make setup-test fills it)


def start_engine(
    source: Path, root: Path, end_ids: list[int], top_logprobs: int, max_model_len: int | None
) -> VLLMEngine:
    """An engine owning a real server (trie processor, in-place reloads, runtime LoRA) on ``source``'s
    untied serving copy, its weight copies under ``root``."""
    spec = ServerSpec(
        python=str(VLLM_PYTHON),
        model=str(serving_copy(source, root / "weights" / "w000000")),
        port=free_port(),
        gpu_memory_utilization=0.2,
        max_logprobs=top_logprobs,
        max_lora_rank=LORA_RANK,  # runtime adapter loading on (start-up cost within the noise: measured)
        dtype="float32",
        device="cuda" if torch.cuda.is_available() else "cpu",
        cache_root=str(VLLM_CACHE),
        dev_mode=True,
        max_model_len=max_model_len,
        trie_processor=True,
    )
    server = VLLMServer(spec, root / "server.log", startup_timeout_s=600, source=str(source))
    server.start()
    return VLLMEngine(
        VLLMClient(server.url),
        end_ids,
        top_logprobs,
        max_concurrency=8,
        server=server,
        weights_dir=root / "weights",
        one_request=True,
    )


@pytest.fixture(scope="module")
def live(tiny_policy, tiny_policy_dir, tmp_path_factory):
    """An engine owning a real server on the tiny policy's untied serving copy, warmed up."""
    model, tokenizer, fmt, hf = tiny_policy
    root = tmp_path_factory.mktemp("vllm")
    engine = start_engine(tiny_policy_dir, root, hf.end_ids, len(tokenizer), max_positions(tiny_policy_dir))
    try:
        engine.generate(
            SampleRequest([fmt.user("warm up .")], [None], 2, 1.0, True, 0)
        )  # the first request initialises lazily (up to ~25 s)
        yield engine
    finally:
        engine.close()


@pytest.fixture(scope="module")
def qwen3_policy(session_dir, chat_tokenizer_cache):
    """(directory, model, tokenizer, fmt, transformers engine) of a tiny Qwen3 around the genuine Qwen3 tokenizer
    (151k ids; hidden 128 / 4 heads: head_dim 32, which the CPU kernel serves)."""
    path = tiny_model_dir(session_dir, "household", ModelConfig(tokenizer="qwen3"), [], chat_tokenizer_cache)
    model, tokenizer = load_policy(path)
    fmt = ChatFormat.for_tokenizer(tokenizer)
    return path, model.eval(), tokenizer, fmt, TransformersEngine(model, tokenizer.pad_token_id, list(fmt.stop_ids))


def _prompts(fmt, suite, n: int = 3, history: int = 0) -> tuple[list[list[int]], list[list[str]]]:
    """``n`` household prompts, prompt i with ``history + i`` earlier turns, and their admissible commands."""
    prompts, commands = [], []
    for i, task in enumerate(suite.tasks("train", "easy", n)):
        env = suite.make()
        obs, info = env.reset(task)
        turns = (fmt.user("nothing happens .") + fmt.command("inventory")) * (history + i)
        prompts.append(fmt.system(env.goal()) + turns + fmt.user(obs))
        commands.append(info["admissible_commands"])
    return prompts, commands


def _plays_like(served, hf, fmt, suite, budget: int) -> None:
    """``served``'s greedy admissible actions and their log-probs equal the transformers engine ``hf``'s on
    three household prompts (after a weight sync: the served weights are ``hf``'s model)."""
    prompts, commands = _prompts(fmt, suite)
    tries = [TokenTrie([fmt.command(c) for c in cs], cs) for cs in commands]
    request = SampleRequest(prompts, tries, budget, 0.7, True, 0)
    for v, h in zip(served.generate(request), hf.generate(request)):
        _same(v, h)


def _same(a, b) -> None:
    assert (a.token_ids, a.policy_mask, a.allowed, a.finished) == (b.token_ids, b.policy_mask, b.allowed, b.finished)
    assert a.logprobs == pytest.approx(b.logprobs, abs=TOL) and a.entropy == pytest.approx(b.entropy, abs=TOL)


def _learner_logprobs(model, prompt: list[int], gen, temperature: float) -> list[float]:
    """The learner's log-probs of ``gen``'s tokens (teacher-forced, tempered, over each token's allowed set)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + gen.token_ids])).logits[0, len(prompt) - 1 : -1].float()
    lp = allowed_log_softmax(logits / temperature, gen.allowed)
    return [float(lp[j, t]) if m else 0.0 for j, (t, m) in enumerate(zip(gen.token_ids, gen.policy_mask))]


def _perturbed(tiny_policy_dir, out: Path, seed: int) -> tuple[torch.nn.Module, Path]:
    """A checkpoint of the tiny policy with every weight moved (tied head, as the trainer saves it)."""
    model, tokenizer = load_policy(tiny_policy_dir)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return model.eval(), out


@pytest.mark.parametrize("admissible", [True, False])
def test_greedy_window_generations_equal_the_transformers_engine(live, tiny_policy, household_suite, admissible):
    """Window context (whole prompts): same tokens, masks, allowed sets and finished flags; log-probs and
    entropies at T = 0.7 within 1e-4 (top_logprobs = V: nothing cut). One request per action in either
    mode (the server's own request counter): admissible actions through the trie logits processor."""
    _, _, fmt, hf = tiny_policy
    prompts, commands = _prompts(fmt, household_suite)
    tries = [TokenTrie([fmt.command(c) for c in cs], cs) if admissible else None for cs in commands]
    before = live.client.metrics()[REQUESTS]
    gens = live.generate(SampleRequest(prompts, tries, 6, 0.7, True, 0))
    sent = live.client.metrics()[REQUESTS] - before
    for v, h in zip(gens, hf.generate(SampleRequest(prompts, tries, 6, 0.7, True, 0))):
        _same(v, h)
    assert sent == len(prompts)


def test_one_request_per_action_equals_the_per_step_path(live, tiny_policy, household_suite):
    """The trie processor's single request against the per-step path (one ``allowed_token_ids`` request per
    token with a choice, none for a forced token) on the same server: greedy actions identical, forced
    tokens policy_mask False, log-probs and entropies within 1e-4; requests 3 against the branching count."""
    _, tokenizer, fmt, hf = tiny_policy
    prompts, commands = _prompts(fmt, household_suite)
    tries = [TokenTrie([fmt.command(c) for c in cs], cs) for cs in commands]
    per_step = VLLMEngine(live.client, hf.end_ids, len(tokenizer), one_request=False)
    try:
        counts = []
        for engine in (live, per_step):
            before = live.client.metrics()[REQUESTS]
            gens = engine.generate(SampleRequest(prompts, tries, 8, 0.7, True, 0))
            counts.append(live.client.metrics()[REQUESTS] - before)
            if engine is live:
                one = gens
    finally:
        per_step.close()
    for a, b in zip(one, gens):
        _same(a, b)
        assert all(m == (len(al) > 1) for m, al in zip(a.policy_mask, a.allowed))
        assert all(lp == 0.0 for lp, m in zip(a.logprobs, a.policy_mask) if not m)
    assert counts == [len(prompts), sum(sum(g.policy_mask) for g in gens)] and counts[1] > counts[0]


def test_full_context_session_equals_the_transformers_session_and_reuses_its_prefix(live, tiny_policy, household_suite):
    """Two turns of a full-history session (slot 11 leaves after the first): each turn equals the
    transformers session's, and the second turn's prompts hit the server's prefix cache (whole blocks only:
    128 tokens on the CPU build, 16 on GPU; so the histories are ~300 tokens long)."""
    _, _, fmt, hf = tiny_policy
    prompts, commands = _prompts(fmt, household_suite, history=30)

    def trie(cs):
        return TokenTrie([fmt.command(c) for c in cs], cs)

    vs, hs = live.session(), hf.session()
    schedule = [([10, 11, 12], prompts), ([12, 10], [fmt.user("nothing happens ."), fmt.user("you see nothing .")])]
    hits = []
    for slots, new_ids in schedule:
        tries = [trie(commands[s - 10]) for s in slots]
        before = live.client.metrics()[PREFIX_HITS]
        for v, h in zip(
            vs.extend(slots, SampleRequest(new_ids, tries, 5, 0.7, True, 0)),
            hs.extend(slots, SampleRequest(new_ids, tries, 5, 0.7, True, 0)),
        ):
            _same(v, h)
        hits.append(live.client.metrics()[PREFIX_HITS] - before)
    assert hits[1] >= 2 * 16  # both continuing slots reuse at least a block of their first turn


@pytest.mark.parametrize("admissible", [True, False])
def test_sampled_runs_reproduce_by_seed_and_carry_the_learners_logprobs(live, tiny_policy, household_suite, admissible):
    """The same seed gives the same tokens and log-probs; another seed other tokens; each sampled token's
    log-prob (the behaviour log-prob a run stores) equals the learner's teacher-forced one within 1e-4."""
    model, _, fmt, _ = tiny_policy
    prompts, commands = _prompts(fmt, household_suite)
    tries = [TokenTrie([fmt.command(c) for c in cs], cs) if admissible else None for cs in commands]
    a, b, c = (live.generate(SampleRequest(prompts, tries, 6, 1.0, False, s)) for s in (5, 5, 6))
    assert [(g.token_ids, g.logprobs) for g in a] == [(g.token_ids, g.logprobs) for g in b]
    assert [g.token_ids for g in a] != [g.token_ids for g in c]
    for p, g in zip(prompts, a + c):
        assert g.logprobs == pytest.approx(_learner_logprobs(model, p, g, 1.0), abs=TOL)


def test_many_long_seeded_requests_at_once_keep_the_server_alive(live, tiny_policy, household_suite):
    """16 sampled (seeded) requests of ~700 tokens at once exceed a step's prefill budget. vLLM 0.32's CPU
    runner would split a prefill over steps and then die rewinding the request's CPU generator; the server
    runs with chunked prefill off (engines/vllm.py), so all 16 come back, reproducible by seed."""
    _, tokenizer, fmt, hf = tiny_policy
    prompts, _ = _prompts(fmt, household_suite, n=16, history=70)
    assert min(map(len, prompts)) > 700
    wide = VLLMEngine(live.client, hf.end_ids, len(tokenizer), max_concurrency=16)
    try:
        a, b = (wide.generate(SampleRequest(prompts, [None] * 16, 4, 1.0, False, 9)) for _ in range(2))
    finally:
        wide.close()
    assert all(len(g.token_ids) == 4 and not g.error for g in a) and [g.token_ids for g in a] == [
        g.token_ids for g in b
    ]
    assert live.alive()


def test_end_of_turn_ends_an_action_and_the_budget_cuts_one_unfinished(live, tiny_policy, household_suite):
    """Admissible actions end with the end-of-turn id (a whole command, nothing after it); a free action
    cut at its token budget is unfinished and has exactly the budget's tokens."""
    _, _, fmt, _ = tiny_policy
    prompts, commands = _prompts(fmt, household_suite)
    tries = [TokenTrie([fmt.command(c) for c in cs], cs) for cs in commands]
    for g, cs in zip(live.generate(SampleRequest(prompts, tries, 20, 1.0, False, 3)), commands):
        assert g.finished and g.token_ids[-1] == fmt.end_id and g.token_ids in [fmt.command(c) for c in cs]
    free = live.generate(
        SampleRequest(prompts, [None] * 3, 3, 0.7, True, 0)
    )  # the tiny policy's greedy text never ends
    assert [(len(g.token_ids), g.finished) for g in free] == [(3, False)] * 3


def test_full_weights_reload_in_place_within_a_second_and_serve_the_new_policy(
    live, tiny_policy, tiny_policy_dir, household_suite, tmp_path
):
    """A moved checkpoint reaches the running server in place (same process), verified by the probe
    within 1e-4, in under 1 s; greedy actions then equal the transformers engine's on the moved weights.
    Putting the start-up weights back is in place too."""
    _, tokenizer, fmt, hf = tiny_policy
    moved, ckpt = _perturbed(tiny_policy_dir, tmp_path / "iter=1", seed=1)
    pid = live.server.proc.pid
    try:
        live.sync(str(ckpt), probe_of(moved, len(tokenizer)))
        s = live.last_sync
        assert (s.path, s.reason) == ("in_place", None) and s.seconds < 1.0 and s.probe_max_diff <= TOL
        assert live.server.proc.pid == pid
        _plays_like(live, TransformersEngine(moved, tokenizer.pad_token_id, hf.end_ids), fmt, household_suite, 6)
    finally:
        live.sync(str(tiny_policy_dir), probe_of(tiny_policy[0], len(tokenizer)))
    assert live.last_sync.path == "in_place" and live.server.proc.pid == pid


def test_a_reload_that_leaves_the_head_stale_is_caught_by_the_probe(live, tiny_policy, tiny_policy_dir, tmp_path):
    """vLLM's CPU trap, for real: a checkpoint reloaded as saved (tied head, no ``lm_head.weight``) leaves the
    server's previous head in place with no error from vLLM. The probe catches it and the sync names why
    (an engine that only reaches the server cannot restart it, so it raises). The untied copy of the same
    checkpoint reloads in place and passes."""
    model, tokenizer, _, hf = tiny_policy
    moved, ckpt = _perturbed(tiny_policy_dir, tmp_path / "iter=2", seed=2)
    as_saved = VLLMEngine(live.client, hf.end_ids, len(tokenizer), untie_head=False)
    try:
        with pytest.raises(
            VLLMError, match=r"probe log-probs off by .* after the in-place reload.* cannot be restarted"
        ):
            as_saved.sync(str(ckpt), probe_of(moved, len(tokenizer)))
        live.sync(str(ckpt), probe_of(moved, len(tokenizer)))
        assert live.last_sync.path == "in_place" and live.last_sync.probe_max_diff <= TOL
    finally:
        as_saved.close()
        live.sync(str(tiny_policy_dir), probe_of(model, len(tokenizer)))


def _moved_adapter(tiny_policy_dir, root: Path, out: Path, seed: int) -> tuple[torch.nn.Module, Path]:
    """A LoRA policy over the tiny policy with its adapters moved (peft starts B at 0: the base's function)."""
    model, tokenizer = load_policy(initial_adapter_dir(root, tiny_policy_dir, LoraConfig(rank=LORA_RANK), 0))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return model.eval(), out


def test_lora_adapters_hot_load_and_serve_the_learners_logprobs(
    live, tiny_policy, tiny_policy_dir, household_suite, tmp_path
):
    """A LoRA policy's checkpoint reaches the running server through ``/v1/load_lora_adapter`` (no restart,
    path ``adapter``), and the next update's checkpoint replaces it (the first adapter unloaded): after each
    sync, greedy admissible actions equal the transformers engine's on base + adapter and the served
    log-probs equal the learner's (peft) within 1e-4."""
    _, tokenizer, fmt, hf = tiny_policy
    prompts, commands = _prompts(fmt, household_suite)
    tries = [TokenTrie([fmt.command(c) for c in cs], cs) for cs in commands]
    pid, names = live.server.proc.pid, []
    try:
        for step in (1, 2):
            learner, ckpt = _moved_adapter(tiny_policy_dir, tmp_path, tmp_path / f"iter={step}", seed=step)
            live.sync(str(ckpt))
            assert live.last_sync.path == "adapter" and live.last_sync.seconds < 1.0
            names.append(live.model)
            with torch.no_grad():
                merged = load_policy(ckpt)[0].merge_and_unload().eval()
            learner_hf = TransformersEngine(merged, tokenizer.pad_token_id, hf.end_ids)
            gens = live.generate(SampleRequest(prompts, tries, 6, 0.7, True, 0))
            for p, v, h in zip(prompts, gens, learner_hf.generate(SampleRequest(prompts, tries, 6, 0.7, True, 0))):
                _same(v, h)
                assert v.logprobs == pytest.approx(_learner_logprobs(learner, p, v, 0.7), abs=TOL)
        assert names[0] != names[1]
        with pytest.raises(VLLMError, match="HTTP 404"):  # the first adapter was unloaded
            live.client.post("/v1/completions", completion_body(names[0], prompts[0], 1, 1.0, True, 0, 1, []))
        assert live.server.proc.pid == pid
    finally:
        if live.model != SERVED_NAME:
            live.client.post("/v1/unload_lora_adapter", {"lora_name": live.model})
        live.model, live.policy_path = SERVED_NAME, None  # the base again: what the server started on


def test_a_shard_plays_on_the_server_another_process_synced(live, tiny_policy_dir, tmp_path):
    """Ray shards of a vLLM run (``rollout.runner: ray``): the run's process syncs the server to the
    checkpoint (``Player.sync``: reload in place, probe verified; ``Player.serving``: where it is) and a
    shard's process plays on it with the tokenizer alone, never syncing (no weights loaded there): its
    records are the ones the run's process plays for the same shard. Two players in this process stand for
    the two processes (Ray's shipping of the task is ``tests/test_ray_collect.py``'s)."""
    from horizonrl.config import load_config
    from horizonrl.rollout.loop import iteration_shards
    from horizonrl.run.learner import Weights
    from horizonrl.run.owners import build_player
    from horizonrl.training.checkpoint import CheckpointRef

    cfg = load_config(
        None,
        [
            f"model.path={tiny_policy_dir}",
            "engine.name=vllm",
            f"engine.vllm.url={live.client.base_url}",
            f"data_dir={tmp_path}",
            "env.max_turns=3",
            "rollout.tasks_per_iteration=2",
            "rollout.group_size=2",
            "rollout.shards=2",
        ],
    )
    policy = CheckpointRef(str(tiny_policy_dir), 0)
    owner, shard_process = (build_player(cfg, Weights(cfg.model)) for _ in range(2))
    try:
        sync = owner.sync(policy)
        serving = owner.serving()
        assert sync.path == "in_place" and serving.url == live.client.base_url
        shard = iteration_shards(owner.task_pool("train", cfg.env.train_pool), cfg.rollout, cfg.seed, 1)[1]
        assert shard_process.sync(policy, serving) is None
        played = shard_process.play(shard)
        assert shard_process.weights.current is None  # no weights loaded there
        assert len(played) == 2 and all(r.turns for r in played)
        mine = owner.play(shard)

        def key(records):
            return [
                (r.rollout_id, r.group_id, [(t.action, t.gen.token_ids, t.gen.logprobs) for t in r.turns])
                for r in records
            ]

        assert key(played) == key(mine)
        with pytest.raises(ValueError, match="not the checkpoint to play"):
            shard_process.sync(CheckpointRef(str(tmp_path / "iter=1"), 1), serving)
    finally:
        owner.close_episodes()
        shard_process.close_episodes()
        live.policy_path = None  # the live engine's next sync reloads whatever it is asked to serve


def test_a_fixed_lag_run_plays_each_iteration_on_the_server_synced_to_its_version(
    live, prefect_harness, tiny_policy_dir, tmp_path, monkeypatch
):
    """``rollout.max_staleness: 1`` on vLLM (docs/algorithms.md §1.10): a 3-iteration run on this server
    (reached at its URL) plays iteration i with checkpoint max(i-2, 0), beside the update of i-1. The
    generator syncs the server in place at the start of each collect (iteration 3 only: 1 and 2 play
    checkpoint 0, which the evaluation before training served); the learner's updates never touch it. Every
    episode and turn row carries its version, within the bound, and its stored log-probs are that
    checkpoint's (the learner's recompute within 1e-4; the next checkpoint's are off by > 1e-3): iteration 2
    was played while update 1 wrote checkpoint 1, and no episode of it was sampled by checkpoint 1. The
    generator loads no weights: every sync is checked against the probe stored with the checkpoint."""
    from flowkit import built_owners, run_of, tiny_config

    from flows.train import train
    from horizonrl import store
    from horizonrl.config import TrainConfig
    from horizonrl.training.checkpoint import checkpoint_dir
    from horizonrl.training.sequences import attach_advantages, train_rows
    from horizonrl.training.trainer import UpdateSettings, recompute_old_logprobs
    from mlflow import MlflowClient

    cfg = tiny_config(tmp_path, f"sqlite:///{tmp_path}/mlflow.db", "vllm-k1", iterations=3)
    cfg.update(
        model={"path": str(tiny_policy_dir)},
        advantage_params={"kl_lambda": 0.5},  # a constant advantage: every update moves the weights
        engine={"name": "vllm", "vllm": {"url": live.client.base_url}},
        eval={"every": 10, "n_tasks": 2, "greedy": False},  # before training and after iteration 3
    )
    cfg["rollout"] = {**cfg["rollout"], "max_staleness": 1}
    loaded = []  # what the generator loaded: nothing, each sync is checked against the checkpoint's stored probe

    def watch(run):
        load = run.generator.weights.load
        run.generator.weights.load = lambda path: loaded.append(path) or load(path)

    built = built_owners(monkeypatch, watch)
    try:
        train(config=cfg)
    finally:
        live.policy_path = None  # the server now serves this run's last checkpoint
    assert loaded == [] and built[0].generator.weights.current is None
    run = tmp_path / "data" / "test" / "vllm-k1"
    c = MlflowClient(cfg["tracking_uri"])
    rid = run_of(c, "vllm-k1").info.run_id
    assert run_of(c, "vllm-k1").info.status == "FINISHED"
    versions = {}
    for it in (1, 2, 3):
        d = store.iteration_dir(tmp_path / "data", "test", "vllm-k1", it)
        for kind in ("episodes", "turns"):
            versions[it, kind] = set(store.read_table(d / f"{kind}.parquet", kind)["policy_version"].to_pylist())
    assert versions == {(it, kind): {max(it - 2, 0)} for it in (1, 2, 3) for kind in ("episodes", "turns")}
    assert {m.step: m.value for m in c.get_metric_history(rid, "async/staleness")} == {1: 0.0, 2: 1.0, 3: 1.0}
    assert {m.step: m.value for m in c.get_metric_history(rid, "collect/weight_sync_in_place")} == {3: 1.0}
    assert not c.get_metric_history(rid, "update/weight_sync_in_place"), "the learner synced the server"
    validated = TrainConfig.model_validate(cfg)
    s = UpdateSettings.from_config(validated, load_policy(checkpoint_dir(run, 0))[1].pad_token_id, False)
    for it, version in ((2, 0), (3, 1)):
        d = store.iteration_dir(tmp_path / "data", "test", "vllm-k1", it)
        rows = attach_advantages(
            train_rows(store.read_table(d / "turns.parquet", "turns"), validated.rollout.context),
            store.read_table(d / "advantages-loop.parquet", "advantages"),
        )
        behav = [v for r in rows for v in r.sample_logp]
        diffs = []
        for ckpt in (version, version + 1):
            by = [
                v for part in recompute_old_logprobs(load_policy(checkpoint_dir(run, ckpt))[0], rows, s) for v in part
            ]
            diffs.append(max(abs(a - b) for a, b in zip(by, behav)))
        assert diffs[0] < TOL and diffs[1] > 1e-3, (it, diffs)


def test_a_corrupted_in_place_reload_is_caught_and_the_owned_server_restarts_on_the_right_weights(
    live, tiny_policy, tiny_policy_dir, household_suite, tmp_path
):
    """The in-place reload of a server the engine owns is made to load wrong weights (the checkpoint as
    saved, with no ``lm_head.weight``: vLLM's CPU backend keeps serving its start-up head and reports
    nothing). The probe catches it, the engine restarts its server on the checkpoint's untied copy, the sync
    says ``restart`` and why, and the restarted server serves the learner's weights (probe within 1e-4,
    greedy actions equal the transformers engine's)."""
    _, tokenizer, fmt, hf = tiny_policy
    moved, ckpt = _perturbed(tiny_policy_dir, tmp_path / "iter=4", seed=4)
    pid = live.server.proc.pid
    live.untie_head = False  # the corruption: the reload reads the checkpoint as saved
    try:
        live.sync(str(ckpt), probe_of(moved, len(tokenizer)))
    finally:
        live.untie_head = True
    s = live.last_sync
    assert s.path == "restart" and live.alive() and live.server.proc.pid != pid
    assert s.reason.startswith("probe log-probs off by") and s.reason.endswith("after the in-place reload")
    assert float(s.reason.split()[4]) > TOL and s.probe_max_diff <= TOL
    prompts, commands = _prompts(fmt, household_suite)
    tries = [TokenTrie([fmt.command(c) for c in cs], cs) for cs in commands]
    moved_hf = TransformersEngine(moved, tokenizer.pad_token_id, hf.end_ids)
    for v, h in zip(
        live.generate(SampleRequest(prompts, tries, 6, 0.7, True, 0)),
        moved_hf.generate(SampleRequest(prompts, tries, 6, 0.7, True, 0)),
    ):
        _same(v, h)


def test_a_dead_server_ends_its_episodes_as_errors_and_the_next_sync_restarts_it(
    live, tiny_policy, qwen3_policy, household_suite
):
    """The server is killed (SIGKILL, its whole process group): a rollout batch still returns, every
    episode ending as an error that names the unreachable server. The next iteration's weight sync
    finds no server to reload into, restarts it on the new checkpoint, names why, and the restarted
    server serves the new policy (probe within 1e-4). The new checkpoint is the Qwen3-tokenizer policy, so
    the Qwen3 tests after this one run on the restarted server instead of paying a start of their own."""
    _, _, fmt, _ = tiny_policy
    path, model, tokenizer, _, _ = qwen3_policy
    pid, tmp = live.server.proc.pid, live.server.tmp
    files = list(tmp.iterdir())  # what vLLM leaves in a temporary folder when it is killed
    assert any(f.is_socket() for f in files) and any(f.name.startswith("vllm_dist_") for f in files)
    os.killpg(pid, signal.SIGKILL)
    live.server.proc.wait()
    assert not live.alive()
    settings = SamplingSettings("admissible", "full", 2, 5, 8, 1.0, 0)
    episodes = collect(household_suite, household_suite.tasks("train", "easy", 2), 2, live, fmt, settings)
    assert [e.status for e in episodes] == ["error"] * 4
    assert all(e.error.startswith(ENGINE_FAULT + "vLLM server unreachable") for e in episodes)
    with pytest.raises(EvaluationIncomplete, match="4 of 4 held-out episodes were ended by the sampler"):
        check_complete(episodes)  # as an evaluation: refused, not scored 0
    t0 = time.perf_counter()
    live.sync(str(path), probe_of(model, len(tokenizer)))
    s = live.last_sync
    assert s.path == "restart" and live.alive() and live.server.proc.pid != pid
    assert not tmp.exists() and live.server.tmp.is_dir(), "the killed server's temporary files went with it"
    assert s.reason.startswith("in-place reload failed") and "cannot reach" in s.reason
    assert s.probe_max_diff <= TOL and s.seconds <= time.perf_counter() - t0


@pytest.mark.parametrize("admissible", [True, False])
def test_qwen3_tokenizer_generations_equal_the_transformers_engine(live, qwen3_policy, household_suite, admissible):
    """The genuine Qwen3 tokenizer (byte-level BPE ids in and out, its own end-of-turn id): greedy tokens,
    masks, allowed sets and finished flags identical to the transformers engine's, log-probs within 1e-4
    (admissible at T = 0.7 over each allowed set; free at T = 1, where the returned log-prob is the
    sampled distribution's own), entropies equal (admissible) or the top-k lower bound (free). Served by
    the server the previous test restarted on this policy (run alone: this sync restarts it)."""
    path, model, tokenizer, fmt, hf = qwen3_policy
    live.sync(str(path), probe_of(model, len(tokenizer)))
    engine = VLLMEngine(live.client, list(fmt.stop_ids), live.top_logprobs, max_concurrency=8, one_request=True)
    prompts, commands = _prompts(fmt, household_suite)
    tries = [TokenTrie([fmt.command(c) for c in cs], cs) if admissible else None for cs in commands]
    temperature = 0.7 if admissible else 1.0
    try:
        gens = engine.generate(SampleRequest(prompts, tries, 8, temperature, True, 0))
    finally:
        engine.close()
    for v, h in zip(gens, hf.generate(SampleRequest(prompts, tries, 8, temperature, True, 0))):
        assert (v.token_ids, v.policy_mask, v.allowed, v.finished) == (
            h.token_ids,
            h.policy_mask,
            h.allowed,
            h.finished,
        )
        assert v.logprobs == pytest.approx(h.logprobs, abs=TOL)
        if admissible:
            assert v.entropy == pytest.approx(h.entropy, abs=TOL)
        else:
            assert all(a <= b + TOL for a, b in zip(v.entropy, h.entropy))
    assert any(t >= 123 for g in gens for t in g.token_ids)  # ids beyond the word tokenizer's: BPE ids served
