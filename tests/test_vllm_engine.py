"""VLLMEngine without a GPU: request building and response parsing against a real HTTP server on
127.0.0.1 (``http.server`` in a thread), so the engine's real client path runs.

Two kinds of server stand in for vLLM (nothing in the engine is patched):

* canned: answers with responses written by hand in vLLM's documented completion format
  (``tokens`` as ``"token_id:<id>"``, ``token_logprobs``, ``top_logprobs``, ``token_ids``, -inf as -9999.0);
* emulated: computes each answer with the tiny transformers policy the way vLLM's server does with
  ``--logprobs-mode processed_logprobs`` (log-softmax after temperature and ``allowed_token_ids``; greedy
  requests return temperature-1 log-probs). Against it the engine must produce what
  ``TransformersEngine`` produces: same tokens, masks, allowed sets, and log-probs/entropies within 1e-4.

These stay for what a real server cannot be made to do (malformed answers, a server process stand-in);
everything a real server can show is tested against one in ``test_vllm_live.py``. Last, two checks that need
no server: the untied serving copy and the config's refusal of a head_dim vLLM's CPU build cannot serve.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch

from horizonrl.config import load_config
from horizonrl.engines.base import SampleRequest, TokenTrie
from horizonrl.engines.vllm import VLLMEngine
from horizonrl.engines.vllm_server import (
    ServerSpec,
    VLLMServer,
    free_port,
    server_command,
    server_env,
    serving_copy,
    tied_embeddings,
)
from horizonrl.engines.vllm_wire import VLLMClient, VLLMError, completion_body, parse_completion

END = 3
TOL = 1e-4


class Recorder:
    """A loopback HTTP server: records each request (path, JSON body) and answers with ``answer``."""

    def __init__(self, answer: Callable[[str, Any], tuple[int, Any]]) -> None:
        self.requests: list[tuple[str, Any]] = []
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer.lock:
                    outer.requests.append((self.path, body))
                status, payload = answer(self.path, body)
                data = (payload if isinstance(payload, str) else json.dumps(payload)).encode()
                self.send_response(status)
                self.send_header("Content-Type", "text/plain" if isinstance(payload, str) else "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self.send_response(200 if self.path == "/health" else 404)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        # shutdown() waits for the serving loop's next poll: 0.5 s by default, paid by every test at close
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.02,), daemon=True)
        self.thread.start()

    def completions(self) -> list[dict]:
        return [b for p, b in self.requests if p == "/v1/completions"]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture()
def serve():
    servers: list[Recorder] = []

    def start(answer: Callable[[str, Any], tuple[int, Any]]) -> Recorder:
        servers.append(Recorder(answer))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def _choice(tokens: list[int], lps: list[float], tops: list[dict[int, float]], finish: str) -> dict:
    """A completion response in vLLM's documented shape (what ``request_output_to_completion_response``
    writes for logprobs=k, return_tokens_as_token_ids and return_token_ids)."""
    return {
        "id": "cmpl-0",
        "object": "text_completion",
        "created": 0,
        "model": "policy",
        "choices": [
            {
                "index": 0,
                "text": "",
                "logprobs": {
                    "text_offset": [0] * len(tokens),
                    "token_logprobs": lps,
                    "tokens": [f"token_id:{t}" for t in tokens],
                    "top_logprobs": [{f"token_id:{k}": v for k, v in top.items()} for top in tops],
                },
                "finish_reason": finish,
                "stop_reason": tokens[-1] if finish == "stop" else None,
                "token_ids": tokens,
                "prompt_logprobs": None,
                "prompt_token_ids": None,
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": len(tokens), "total_tokens": 3 + len(tokens)},
    }


def _h(*ps: float) -> float:
    return -sum(p * math.log(p) for p in ps)


# ------------------------------------------------------------------------------- canned responses
def test_request_body_has_vllms_documented_fields():
    body = completion_body("policy", [1, 2, 3], 4, 0.7, False, 42, 5, [END, 9, END], allowed=[5, 8])
    assert body["prompt"] == [1, 2, 3] and body["max_tokens"] == 4 and body["temperature"] == 0.7 and body["seed"] == 42
    assert body["logprobs"] == 5 and body["return_tokens_as_token_ids"] is True and body["return_token_ids"] is True
    assert body["stop_token_ids"] == [END, 9] and body["ignore_eos"] is True and body["allowed_token_ids"] == [5, 8]
    assert (body["top_p"], body["top_k"], body["min_p"], body["repetition_penalty"]) == (1.0, 0, 0.0, 1.0)
    assert completion_body("policy", [1], 1, 0.7, True, 0, 1, [END])["temperature"] == 0.0
    assert "allowed_token_ids" not in completion_body("policy", [1], 1, 0.7, False, 0, 1, [END])


def test_free_mode_parses_a_handwritten_response(serve):
    """Three tokens, the last the end id; entropy is the top-k truncation -sum p log p."""
    tops = [
        {11: math.log(0.5), 12: math.log(0.3)},
        {13: math.log(0.9), 11: math.log(0.05)},
        {END: math.log(0.6), 13: math.log(0.2)},
    ]
    canned = _choice([12, 13, END], [math.log(0.3), math.log(0.9), math.log(0.6)], tops, "stop")
    srv = serve(lambda path, body: (200, canned))
    engine = VLLMEngine(VLLMClient(srv.url), [END], top_logprobs=2)
    gens = engine.generate(SampleRequest([[1, 2, 3], [1, 2, 3]], [None, None], 8, 1.0, False, 7))
    for g in gens:
        assert g.token_ids == [12, 13, END] and g.finished
        assert g.logprobs == pytest.approx([math.log(0.3), math.log(0.9), math.log(0.6)], abs=1e-12)
        assert g.entropy == pytest.approx([_h(0.5, 0.3), _h(0.9, 0.05), _h(0.6, 0.2)], abs=1e-12)
        assert g.policy_mask == [True] * 3 and g.allowed == [[], [], []]
    reqs = srv.completions()
    assert [r["prompt"] for r in reqs] == [[1, 2, 3]] * 2 and all(
        r["logprobs"] == 2 and r["max_tokens"] == 8 for r in reqs
    )
    assert reqs[0]["seed"] != reqs[1]["seed"]  # K rollouts of one prompt must not share a seed


def test_free_mode_cut_at_the_budget_is_unfinished_and_a_missing_stop_token_is_an_error(serve):
    cut = _choice([12, 13], [math.log(0.3), math.log(0.9)], [{12: math.log(0.3)}, {13: math.log(0.9)}], "length")
    srv = serve(lambda path, body: (200, cut))
    g = VLLMEngine(VLLMClient(srv.url), [END], 1).generate(SampleRequest([[1]], [None], 2, 1.0, False, 0))[0]
    assert g.token_ids == [12, 13] and not g.finished
    lost = _choice([12], [math.log(0.3)], [{12: math.log(0.3)}], "stop")
    srv2 = serve(lambda path, body: (200, lost))
    with pytest.raises(VLLMError, match="stop token"):
        VLLMEngine(VLLMClient(srv2.url), [END], 1).generate(SampleRequest([[1]], [None], 4, 1.0, False, 0))


def test_admissible_mode_asks_only_at_branching_tokens(serve):
    """Trie {5 6 END, 5 7 END, 8 END}: the server is asked at [5, 8] and at [6, 7]; END after 7 is forced
    (no request, log-prob 0, entropy 0, policy_mask False). Allowed ids outside the set come back as
    -9999.0 (vLLM's JSON for -inf) and weigh nothing."""
    answers = {
        (5, 8): _choice([5], [math.log(0.7)], [{5: math.log(0.7), 8: math.log(0.3)}], "length"),
        (6, 7): _choice([7], [math.log(0.4)], [{6: math.log(0.6), 7: math.log(0.4), 99: -9999.0}], "length"),
    }
    srv = serve(lambda path, body: (200, answers[tuple(body["allowed_token_ids"])]))
    trie = TokenTrie([[5, 6, END], [5, 7, END], [8, END]])
    g = VLLMEngine(VLLMClient(srv.url), [END], top_logprobs=8).generate(
        SampleRequest([[1, 2]], [trie], 6, 1.0, False, 3)
    )[0]
    assert g.token_ids == [5, 7, END] and g.finished
    assert g.logprobs == pytest.approx([math.log(0.7), math.log(0.4), 0.0], abs=1e-12)
    assert g.entropy == pytest.approx([_h(0.7, 0.3), _h(0.6, 0.4), 0.0], abs=1e-12)
    assert g.policy_mask == [True, True, False] and g.allowed == [[5, 8], [6, 7], [END]]
    reqs = srv.completions()
    assert [r["prompt"] for r in reqs] == [[1, 2], [1, 2, 5]]
    assert [r["allowed_token_ids"] for r in reqs] == [[5, 8], [6, 7]] and all(
        r["max_tokens"] == 1 and r["logprobs"] == 2 for r in reqs
    )
    assert reqs[0]["seed"] != reqs[1]["seed"]


def test_server_errors_and_foreign_tokens_raise(serve):
    srv = serve(
        lambda path, body: (
            400,
            {"object": "error", "message": "max_tokens is too large", "type": "BadRequestError", "code": 400},
        )
    )
    with pytest.raises(VLLMError, match="HTTP 400.*max_tokens is too large"):
        VLLMEngine(VLLMClient(srv.url), [END], 1).generate(SampleRequest([[1]], [None], 4, 1.0, False, 0))
    plain = _choice([12], [-0.1], [{12: -0.1}], "length")
    plain["choices"][0]["logprobs"]["tokens"] = ["hello"]  # return_tokens_as_token_ids ignored
    with pytest.raises(VLLMError, match="token_id"):
        parse_completion(plain)
    outside = serve(lambda path, body: (200, _choice([9], [-0.1], [{9: -0.1}], "length")))
    with pytest.raises(VLLMError, match="outside allowed"):
        VLLMEngine(VLLMClient(outside.url), [END], 4).generate(
            SampleRequest([[1]], [TokenTrie([[5, END], [8, END]])], 4, 1.0, False, 0)
        )


def test_lora_checkpoints_are_hot_loaded_and_requests_use_the_new_adapter(serve, tmp_path):
    srv = serve(
        lambda path, body: (
            (200, "Success: LoRA adapter loaded.")
            if "lora" in path
            else (200, _choice([END], [-0.1], [{END: -0.1}], "stop"))
        )
    )
    engine = VLLMEngine(VLLMClient(srv.url), [END], 1)
    ckpts = []
    for it in (1, 2):
        d = tmp_path / "checkpoints" / f"iter={it:05d}"
        d.mkdir(parents=True)
        (d / "adapter_config.json").write_text("{}")
        ckpts.append(str(d))
    engine.sync(ckpts[0])
    engine.generate(SampleRequest([[1]], [None], 2, 1.0, False, 0))
    engine.sync(ckpts[0])  # already served: no request
    engine.sync(ckpts[1])
    engine.generate(SampleRequest([[1]], [None], 2, 1.0, False, 0))
    calls = [(p, b) for p, b in srv.requests]
    assert [p for p, _ in calls] == [
        "/v1/load_lora_adapter",
        "/v1/completions",
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
        "/v1/completions",
    ]
    first, second = calls[0][1]["lora_name"], calls[2][1]["lora_name"]
    assert calls[0][1]["lora_path"] == str(Path(ckpts[0]).resolve()) and first != second
    assert calls[1][1]["model"] == first and calls[3][1] == {"lora_name": first} and calls[4][1]["model"] == second
    with pytest.raises(VLLMError, match="no probe .* cannot be restarted"):
        engine.sync(str(tmp_path))  # no adapter: full weights, no probe to verify in place, and no owned server


# ------------------------------------------------------------------------------- emulated server
class Emulator:
    """vLLM's completion semantics with ``--logprobs-mode processed_logprobs`` over the tiny model."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    @torch.no_grad()
    def __call__(self, path: str, body: dict) -> tuple[int, dict]:
        seq, T, k = list(body["prompt"]), body["temperature"], body["logprobs"]
        gen = torch.Generator().manual_seed(body["seed"])
        tokens, lps, tops, finish = [], [], [], "length"
        for _ in range(body["max_tokens"]):
            logits = self.model(input_ids=torch.tensor([seq])).logits[0, -1].float()
            if body.get("allowed_token_ids"):
                logits = torch.full_like(logits, -math.inf).index_copy(
                    0, torch.tensor(body["allowed_token_ids"]), logits[body["allowed_token_ids"]]
                )
            lp = torch.log_softmax(logits / (T if T > 0 else 1.0), -1)  # greedy: temperature 1, as vLLM
            tok = int(lp.argmax()) if T == 0 else int(torch.multinomial(lp.exp(), 1, generator=gen))
            v, i = lp.topk(k)
            tokens.append(tok)
            lps.append(max(float(lp[tok]), -9999.0))
            tops.append({int(a): max(float(b), -9999.0) for a, b in zip(i, v)})
            seq.append(tok)
            if tok in body["stop_token_ids"]:
                finish = "stop"
                break
        return 200, _choice(tokens, lps, tops, finish)


@pytest.fixture()
def emulated(serve, tiny_policy):
    model, tokenizer, fmt, hf = tiny_policy
    srv = serve(Emulator(model))
    engine = VLLMEngine(VLLMClient(srv.url), hf.end_ids, top_logprobs=len(tokenizer), max_concurrency=4)
    yield engine, hf, fmt, srv
    engine.close()


def _prompts(fmt, suite, n: int = 3):
    prompts, commands = [], []
    for i, task in enumerate(suite.tasks("train", "easy", n)):
        env = suite.make()
        obs, info = env.reset(task)
        prompts.append(
            fmt.system(env.goal()) + (fmt.user("nothing happens .") + fmt.command("inventory")) * i + fmt.user(obs)
        )
        commands.append(info["admissible_commands"])
    return prompts, commands


def _same(a, b) -> None:
    assert (
        a.token_ids == b.token_ids
        and a.policy_mask == b.policy_mask
        and a.allowed == b.allowed
        and a.finished == b.finished
    )
    assert a.logprobs == pytest.approx(b.logprobs, abs=TOL) and a.entropy == pytest.approx(b.entropy, abs=TOL)


@pytest.mark.parametrize("admissible", [True, False])
def test_greedy_generations_equal_the_transformers_engine(emulated, household_suite, admissible):
    """Same tokens, masks, allowed sets, finished flags; log-probs and entropies at T = 0.7 within 1e-4
    (the engine rescales vLLM's temperature-1 greedy log-probs; top_logprobs = V, so nothing is cut)."""
    engine, hf, fmt, srv = emulated
    prompts, commands = _prompts(fmt, household_suite)
    tries = [TokenTrie([fmt.command(c) for c in cs], cs) if admissible else None for cs in commands]
    for v, h in zip(
        engine.generate(SampleRequest(prompts, tries, 6, 0.7, True, 0)),
        hf.generate(SampleRequest(prompts, tries, 6, 0.7, True, 0)),
    ):
        _same(v, h)
    if admissible:  # one request per branching token, never for a forced one
        assert len(srv.completions()) == sum(
            1 for g in hf.generate(SampleRequest(prompts, tries, 6, 0.7, True, 0)) for m in g.policy_mask if m
        )


def test_session_resends_whole_sequences_and_equals_the_transformers_session(emulated, household_suite):
    engine, hf, fmt, srv = emulated
    prompts, commands = _prompts(fmt, household_suite)

    def trie(cs):
        return TokenTrie([fmt.command(c) for c in cs], cs)

    vs, hs, seq = engine.session(), hf.session(), {}
    schedule = [([10, 11, 12], prompts), ([12, 10], [fmt.user("nothing happens ."), fmt.user("you see nothing .")])]
    for slots, new_ids in schedule:
        tries = [trie(commands[s - 10]) for s in slots]
        before = len(srv.completions())
        v_gens = vs.extend(slots, SampleRequest(new_ids, tries, 5, 0.7, True, 0))
        for s, ids, v, h in zip(
            slots, new_ids, v_gens, hs.extend(slots, SampleRequest(new_ids, tries, 5, 0.7, True, 0))
        ):
            _same(v, h)
            seq[s] = seq.get(s, []) + ids
            assert any(r["prompt"] == seq[s] for r in srv.completions()[before:])  # the whole history went out
            seq[s] += v.token_ids
    assert set(vs.seqs) == {10, 12}  # slot 11 finished and left


def test_sampled_entropy_is_a_top_k_lower_bound(serve, tiny_policy, household_suite):
    """With top_logprobs = 4 the free-mode entropy is the truncated sum -sum p log p over the returned tokens
    (the 4 most likely of the tempered distribution, and the sampled one): below the full entropy."""
    model, tokenizer, fmt, hf = tiny_policy
    srv = serve(Emulator(model))
    engine = VLLMEngine(VLLMClient(srv.url), hf.end_ids, top_logprobs=4)
    prompts, _ = _prompts(fmt, household_suite, 1)
    g = engine.generate(SampleRequest(prompts, [None], 1, 0.7, False, 5))[0]
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=torch.tensor(prompts)).logits[0, -1].float() / 0.7, -1)
    top = lp[sorted({*lp.topk(4).indices.tolist(), g.token_ids[0]})]
    assert g.entropy[0] == pytest.approx(float(-(top.exp() * top).sum()), abs=TOL)
    assert g.entropy[0] < float(-(lp.exp() * lp).sum())
    assert g.logprobs[0] == pytest.approx(float(lp[g.token_ids[0]]), abs=TOL)
    engine.close()


# ------------------------------------------------------------------------------- server process
FAKE_SERVER = """
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
open(sys.argv[0] + ".argv.json", "w").write(json.dumps(args))
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()
    def log_message(self, *a):
        pass
HTTPServer((args[args.index("--host") + 1], port), H).serve_forever()
"""


def _fake_vllm(root: Path) -> Path:
    """``root`` holding a stand-in ``vllm.entrypoints.openai.api_server`` (``FAKE_SERVER``); returns its folder."""
    pkg = root / "vllm" / "entrypoints" / "openai"
    pkg.mkdir(parents=True)
    for d in (pkg, pkg.parent, pkg.parent.parent):
        (d / "__init__.py").write_text("")
    (pkg / "api_server.py").write_text(FAKE_SERVER)
    return pkg


def test_server_command_binds_loopback_with_prefix_caching_and_lora():
    spec = ServerSpec(
        python="/venv/bin/python",
        model="/m",
        port=8011,
        gpu_memory_utilization=0.4,
        max_logprobs=64,
        max_lora_rank=12,
        dtype="bfloat16",
    )
    cmd = server_command(spec)

    def flag(f):
        return cmd[cmd.index(f) + 1]

    assert cmd[:4] == ["/venv/bin/python", "-m", "horizonrl_serve", "vllm.entrypoints.openai.api_server"]
    assert (
        flag("--host") == "127.0.0.1"
        and flag("--port") == "8011"
        and flag("--model") == "/m"
        and flag("--dtype") == "bfloat16"
    )
    assert (
        "--enable-prefix-caching" in cmd
        and flag("--logprobs-mode") == "processed_logprobs"
        and flag("--max-logprobs") == "64"
    )
    assert "--enable-lora" in cmd and flag("--max-lora-rank") == "16"  # rounded up to a rank vLLM accepts
    assert server_env(spec, {})["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    full = ServerSpec(python="p", model="/m", port=1, gpu_memory_utilization=0.4, max_logprobs=8)
    assert "--enable-lora" not in server_command(full) and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in server_env(
        full, {}
    )


def test_cpu_server_runs_its_worker_inside_the_engine_core_process():
    """The CPU build's start-up: eager, chunked prefill off, and the one worker in the engine-core process
    (``uni``, which the CPU platform honours only with VLLM_ENABLE_V1_MULTIPROCESSING=0); the GPU build keeps
    vLLM's defaults."""
    cpu = ServerSpec(python="p", model="/m", port=1, gpu_memory_utilization=0.4, max_logprobs=8, device="cpu")
    cmd = server_command(cpu)
    assert cmd[cmd.index("--distributed-executor-backend") + 1] == "uni" and "--enforce-eager" in cmd
    assert server_env(cpu, {})["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    gpu = dataclasses.replace(cpu, device="cuda")
    assert "--distributed-executor-backend" not in server_command(gpu)
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in server_env(gpu, {})


def test_owned_server_starts_restarts_on_new_weights_and_leaves_no_process(tmp_path, monkeypatch):
    """A stand-in ``vllm.entrypoints.openai.api_server`` module (a health endpoint) on PYTHONPATH: the
    engine's real start / wait-for-health / stop path runs, and full-weight sync restarts it."""
    pkg = _fake_vllm(tmp_path / "fake")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "fake"))
    spec = ServerSpec(
        python=sys.executable,
        model=str(tmp_path / "iter=0"),
        port=free_port(),
        gpu_memory_utilization=0.4,
        max_logprobs=8,
    )
    server = VLLMServer(spec, tmp_path / "server.log", startup_timeout_s=30)
    server.start()
    pid = server.proc.pid
    engine = VLLMEngine(VLLMClient(server.url), [END], 8, server=server)
    assert engine.client.healthy()
    engine.sync(spec.model)  # what it was started on: no restart
    assert engine.server.proc.pid == pid
    engine.sync(str(tmp_path / "iter=1"))
    assert engine.server.proc.pid != pid and engine.client.healthy()
    argv = json.loads((pkg / "api_server.py.argv.json").read_text())
    assert argv[argv.index("--model") + 1] == str(tmp_path / "iter=1")
    new_pid = engine.server.proc.pid
    engine.close()
    for p in (pid, new_pid):
        with pytest.raises(ProcessLookupError):
            os.kill(p, 0)


def test_copies_a_killed_run_left_never_replace_the_new_serving_copy(tiny_policy_dir, tmp_path, monkeypatch):
    """A killed run left serving copies w000007 and w000008; the resumed run's engine numbered its copies from
    1 and kept "the newest two by name", so it deleted the copy it had just written and started the server on
    a missing folder (the SmolLM2 run: vLLM took the path for a hub id and the run failed). Now each copy is
    numbered after every one there, the engine keeps its own newest two and deletes the rest. The stand-in
    server module as above."""
    _fake_vllm(tmp_path / "fake")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "fake"))
    weights = tmp_path / "weights"
    for n in (7, 8):
        serving_copy(tiny_policy_dir, weights / f"w{n:06d}")
    start = serving_copy(tiny_policy_dir, weights / "w000000")
    spec = ServerSpec(
        python=sys.executable, model=str(start), port=free_port(), gpu_memory_utilization=0.4, max_logprobs=8
    )
    server = VLLMServer(spec, tmp_path / "server.log", startup_timeout_s=30)
    server.start()
    engine = VLLMEngine(VLLMClient(server.url), [END], 8, server=server, weights_dir=weights)
    try:
        served = [start.resolve()]
        for _ in range(2):
            engine.restart(tiny_policy_dir)
            served.append(Path(engine.server.spec.model))
            assert (served[-1] / "model.safetensors").is_file() and not tied_embeddings(served[-1])
            assert sorted(weights.iterdir()) == served[-2:], "this engine's newest two copies, nothing else"
        assert [p.name for p in served] == ["w000000", "w000009", "w000010"]
    finally:
        engine.close()


def test_a_server_whose_starter_was_killed_stops_itself(tmp_path):
    """SIGKILL of the process that started the server (no atexit, no ``stop``): the server, in a session of its
    own, notices that its parent is gone (``horizonrl_serve``) and stops its process group, instead of holding
    its port and memory for good. The stand-in server module as above."""
    import signal
    import subprocess
    import time

    _fake_vllm(tmp_path / "fake")
    starter = tmp_path / "starter.py"
    starter.write_text(
        "import os, signal, sys\n"
        "from pathlib import Path\n"
        "from horizonrl.engines.vllm_server import ServerSpec, VLLMServer\n"
        f"spec = ServerSpec(python=sys.executable, model='m', port={free_port()}, gpu_memory_utilization=0.4, "
        "max_logprobs=8)\n"
        "server = VLLMServer(spec, Path(sys.argv[1]) / 'server.log', startup_timeout_s=30)\n"
        "server.start()\n"
        "(Path(sys.argv[1]) / 'pid').write_text(str(server.proc.pid))\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "fake"), str(root)])}
    done = subprocess.run([sys.executable, str(starter), str(tmp_path)], env=env, capture_output=True, text=True)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    pid = int((tmp_path / "pid").read_text())

    def running() -> bool:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return False
        return state != "Z"  # a zombie has stopped; only its exit status waits to be reaped

    deadline = time.monotonic() + 30
    while running() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not running(), "the server outlived the process that started it"


def test_a_port_another_process_listens_on_is_refused(tmp_path):
    """Another run's server on the configured port answered the health check for ours, and the run reloaded its
    weights into it (the other run's engine died on the vocabulary's shape): refused before anything starts."""
    import socket

    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        spec = ServerSpec(python=sys.executable, model="m", port=port, gpu_memory_utilization=0.4, max_logprobs=8)
        with pytest.raises(VLLMError, match=f"127.0.0.1:{port} is taken .* set engine.vllm.port to a free port"):
            VLLMServer(spec, tmp_path / "log", 30).start()
    assert not (tmp_path / "log").exists(), "nothing started"


def test_missing_vllm_environment_says_how_to_create_it(tmp_path):
    spec = ServerSpec(
        python=str(tmp_path / "nope" / "python"), model="m", port=1, gpu_memory_utilization=0.4, max_logprobs=8
    )
    with pytest.raises(VLLMError, match="make vllm-venv"):
        VLLMServer(spec, tmp_path / "log", 1).start()


# ------------------------------------------------------------------------------- weights and config
def test_serving_copy_unties_the_head_and_leaves_the_checkpoint_alone(tiny_policy_dir, tmp_path):
    """The copy declares untied embeddings and stores the head (= the embedding) in its own file; the
    checkpoint's files, hard-linked into the copy, still say tied."""
    from safetensors.torch import load_file

    out = serving_copy(tiny_policy_dir, tmp_path / "w1")
    assert tied_embeddings(tiny_policy_dir) and not tied_embeddings(out)
    head = load_file(out / "lm_head.safetensors")["lm_head.weight"]
    assert torch.equal(head, load_file(out / "model.safetensors")["model.embed_tokens.weight"])
    assert json.loads((Path(tiny_policy_dir) / "config.json").read_text())["tie_word_embeddings"] is True


@pytest.mark.parametrize(
    ("overrides", "error"),
    [
        (
            ["model.tiny.hidden_size=64", "model.tiny.num_heads=4"],
            "config: model.tiny.hidden_size / model.tiny.num_heads gives head_dim 16, which vLLM's CPU build",
        ),
        (["model.tiny.hidden_size=120", "model.tiny.num_heads=3"], "head_dim 40, .*allowed head_dim: 32, 64, 80"),
        (["model.tiny.hidden_size=64", "model.tiny.num_heads=2"], None),
    ],
)
def test_config_refuses_a_head_dim_the_cpu_build_cannot_serve(overrides, error):
    """vLLM's CPU kernel serves some head sizes only; a model with another would start and die at its first
    request, so the config check names the field and the allowed values before any work."""
    args = ["engine.name=vllm", "engine.vllm.device=cpu", *overrides]
    if error is None:
        assert load_config(None, args).engine.vllm.device == "cpu"
        return
    with pytest.raises(ValueError, match=error):
        load_config(None, args)
    assert load_config(None, [*overrides, "engine.vllm.device=cuda", "engine.name=vllm"]).model.tiny.num_heads


def test_the_machines_vllm_cache_is_shared_and_filled_once(tmp_path, monkeypatch):
    """Every server's VLLM_CACHE_ROOT is the machine's cache (``$XDG_CACHE_HOME/horizonrl/vllm``), not a
    data folder's, and ``warm`` runs vLLM only while an architecture lacks its model information: here a
    stand-in interpreter (a shell that records its call, named as such) writes the files vLLM would."""
    from horizonrl.engines import vllm_cache

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    root = tmp_path / "cache" / "horizonrl" / "vllm"
    assert vllm_cache.cache_root() == root
    calls = tmp_path / "calls"
    fake = tmp_path / "python"  # a stand-in for .venv-vllm's python: vLLM's own inspection is the live tests'
    fake.write_text(
        f'#!/bin/sh\necho "$VLLM_CACHE_ROOT" >> {calls}\nmkdir -p "$VLLM_CACHE_ROOT/modelinfos"\n'
        'shift 2\nfor a in "$@"; do touch "$VLLM_CACHE_ROOT/modelinfos/vllm-model_executor-models-x-$a.json"; done\n'
    )
    fake.chmod(0o755)
    vllm_cache.warm(fake, ("Qwen2ForCausalLM", "LlamaForCausalLM"))
    vllm_cache.warm(fake, ("Qwen2ForCausalLM", "LlamaForCausalLM"))  # filled: vLLM not started again
    vllm_cache.warm(fake, ("Qwen2ForCausalLM", "Gemma3ForCausalLM"))  # one missing: started
    assert calls.read_text().split() == [str(root), str(root)]
    spec = ServerSpec(str(fake), str(tmp_path), 1, 0.2, 8, cache_root=str(root), device="cpu")
    env = server_env(spec, {})
    assert env["VLLM_CACHE_ROOT"] == str(root) and env["TORCHDYNAMO_DISABLE"] == "1"
