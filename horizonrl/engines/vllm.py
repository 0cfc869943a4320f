"""Sampling through vLLM's OpenAI-compatible server, token ids in and out (GPU rollouts).

vLLM cannot share an environment with Prefect (vLLM pins fastapi<0.137, Prefect needs >=0.139), so it runs in its own virtual
environment (``make vllm-venv``) as a server on 127.0.0.1, started here as a subprocess or reached at a
configured URL. This module only speaks HTTP (stdlib ``urllib``); it never imports vllm.

Requests (``POST /v1/completions``) send the prompt as a list of token ids and ask for
``return_tokens_as_token_ids`` (tokens come back as ``"token_id:<id>"``), ``return_token_ids`` and
``logprobs=k``, so nothing is ever re-tokenised. The server is started with ``--enable-prefix-caching``
(a multi-turn context shares its prefix with the previous request, so only new tokens are prefilled) and
``--logprobs-mode processed_logprobs``: returned log-probs are those of the distribution actually sampled
from (after temperature and the ``allowed_token_ids`` whitelist), which is the engine contract of
``engines/base.py``. ``--generation-config vllm`` keeps the model's own sampling defaults (top_p,
repetition penalty) out, and every request also sets them to neutral values.

Outputs match ``TransformersEngine`` field by field:

* ``free`` mode: one request per prompt. ``logprobs`` of the sampled token is exact. ``entropy`` is the
  **top-k truncation** ``-sum_i p_i log p_i`` over the tokens vLLM returns (the ``top_logprobs`` most likely
  tokens of the sampled distribution, plus the sampled token): a lower bound of the full-vocabulary
  entropy (the missing terms are >= 0), exact when those tokens hold all the mass. APPO picks branch
  points by this entropy, so its ranking holds while the top-k holds most of the mass; raise
  ``engine.vllm.top_logprobs`` otherwise.
* ``admissible`` mode: a per-step request per token with a choice, ``max_tokens=1`` and
  ``allowed_token_ids`` = the trie node's children; a token with a single continuation is forced without
  a request (log-prob 0, entropy 0, ``policy_mask`` False), as in the transformers engine. With
  ``logprobs = |allowed|`` the server returns the whole renormalised allowed distribution, so log-prob and
  entropy are exact (truncated only when more than ``top_logprobs`` tokens are allowed). Per-step
  requests cost one round trip per branching token; prefix caching makes each step's prefill a few tokens.
  Rejected alternative: ``structured_outputs`` ``choice`` over the command strings constrains text,
  not ids: the grammar admits other tokenisations of a command than the trie's, and forced tokens would
  still be sampled.
* greedy: vLLM's greedy path (temperature 0) returns log-probs at temperature 1; they are rescaled to the
  configured temperature and renormalised over the returned tokens (exact in admissible mode; over the
  top-k in free mode). Greedy decoding is used for evaluation, which reads no log-probs.
* seeds: each request has its own seed, derived from (seed, position in the batch, step), so K rollouts of
  one prompt differ and a seed reproduces up to the nondeterminism of batched GPU kernels.

Policy updates: a LoRA checkpoint (``adapter_config.json``) is hot-loaded with
``POST /v1/load_lora_adapter`` (the server runs with ``--enable-lora`` and
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``) and requests name the new adapter; full weights restart the
owned server on the checkpoint directory. Untested here: no GPU on the build machines (README).
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import math
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from horizonrl.config import TrainConfig
from horizonrl.engines.base import Generation, TokenTrie
from horizonrl.seeding import derive_seed

TOKEN_PREFIX = "token_id:"
SERVED_NAME = "policy"
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # values vLLM's --max-lora-rank accepts


class VLLMError(RuntimeError):
    """The server answered with an error, or with something this client cannot read."""


# ------------------------------------------------------------------------------------------------ wire
def parse_token(token: str) -> int:
    """``"token_id:123"`` -> 123 (the form ``return_tokens_as_token_ids`` gives tokens)."""
    if not token.startswith(TOKEN_PREFIX):
        raise VLLMError(
            f"token {token!r} is not of the form 'token_id:<id>' (was return_tokens_as_token_ids honoured?)"
        )
    return int(token[len(TOKEN_PREFIX) :])


@dataclass(frozen=True)
class Step:
    """One generated token: its id, its log-prob and the returned top log-probs (id -> log-prob)."""

    token: int
    logprob: float
    top: dict[int, float]


@dataclass(frozen=True)
class Completion:
    steps: list[Step]
    finish_reason: str | None


def completion_body(
    model: str,
    prompt: list[int],
    max_tokens: int,
    temperature: float,
    greedy: bool,
    seed: int,
    logprobs: int,
    stop_ids: list[int],
    allowed: list[int] | None = None,
) -> dict[str, Any]:
    """The JSON body of one ``/v1/completions`` request (vLLM's documented fields)."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0.0 if greedy else temperature,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "seed": seed,
        "logprobs": logprobs,
        "return_tokens_as_token_ids": True,
        "return_token_ids": True,
        "stop_token_ids": sorted(set(stop_ids)),
        "ignore_eos": True,  # stop on our end ids only, as the transformers engine does
        "skip_special_tokens": False,
    }
    if allowed is not None:
        body["allowed_token_ids"] = list(allowed)
    return body


def parse_completion(response: dict[str, Any]) -> Completion:
    """The first choice of a non-streamed completion response, as token ids with their log-probs."""
    try:
        choice = response["choices"][0]
        lp = choice["logprobs"]
        tokens = [parse_token(t) for t in lp["tokens"]]
        token_lps = lp["token_logprobs"]
        tops = lp["top_logprobs"]
    except (KeyError, IndexError, TypeError) as err:
        raise VLLMError(
            f"unexpected completion response (no choices[0].logprobs): {json.dumps(response)[:500]}"
        ) from err
    ids = choice.get("token_ids")
    if ids is not None and list(ids) != tokens:
        raise VLLMError(f"token_ids {ids} disagree with the log-prob tokens {tokens}")
    if not (len(tokens) == len(token_lps) == len(tops)):
        raise VLLMError("logprobs.tokens, token_logprobs and top_logprobs differ in length")
    steps = []
    for t, x, top in zip(tokens, token_lps, tops):
        if x is None or top is None:
            raise VLLMError(f"no log-prob returned for token {t}")
        steps.append(Step(t, float(x), {parse_token(k): float(v) for k, v in top.items()}))
    return Completion(steps, choice.get("finish_reason"))


def distribution(step: Step, returned_temperature: float, temperature: float) -> dict[int, float]:
    """Log-probs at ``temperature`` of the returned tokens of one step.

    Returned at the sampling temperature: as sent (normalised over the full allowed set). Otherwise
    (greedy: vLLM returns temperature 1) rescaled and renormalised over the returned tokens."""
    top = {**step.top, step.token: step.logprob}
    if math.isclose(returned_temperature, temperature):
        return top
    scaled = {k: v * returned_temperature / temperature for k, v in top.items()}
    z = max(scaled.values())
    log_norm = z + math.log(sum(math.exp(v - z) for v in scaled.values()))
    return {k: v - log_norm for k, v in scaled.items()}


def entropy(logprobs: dict[int, float]) -> float:
    """``-sum p log p`` over the given tokens (vLLM writes -inf as -9999, whose term is 0)."""
    return -sum(math.exp(v) * v for v in logprobs.values() if v > -9999.0)


# ---------------------------------------------------------------------------------------------- client
class VLLMClient:
    """JSON over HTTP to one server; thread-safe (one connection per request, loopback)."""

    def __init__(self, base_url: str, timeout_s: float = 300.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s

    def post(self, path: str, body: dict[str, Any]) -> Any:
        req = urllib.request.Request(
            self.base_url + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                text = r.read().decode()
        except urllib.error.HTTPError as err:
            raise VLLMError(f"POST {path}: HTTP {err.code}: {err.read().decode(errors='replace')[:1000]}") from err
        except urllib.error.URLError as err:
            raise VLLMError(f"POST {path}: cannot reach {self.base_url}: {err.reason}") from err
        try:
            return json.loads(text) if text.strip() else None
        except json.JSONDecodeError:
            return text  # the adapter endpoints answer with plain text

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=5) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False


# ---------------------------------------------------------------------------------------------- server
@dataclass(frozen=True)
class ServerSpec:
    python: str  # interpreter of vLLM's own environment
    model: str  # model directory (for LoRA: the base model)
    port: int
    gpu_memory_utilization: float
    max_logprobs: int
    max_lora_rank: int | None = None  # enables runtime LoRA loading when set
    dtype: str = "auto"
    seed: int = 0


def server_command(spec: ServerSpec) -> list[str]:
    """argv of the OpenAI-compatible server, bound to loopback only."""
    cmd = [
        spec.python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        spec.model,
        "--served-model-name",
        SERVED_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(spec.port),
        "--enable-prefix-caching",
        "--logprobs-mode",
        "processed_logprobs",
        "--max-logprobs",
        str(spec.max_logprobs),
        "--generation-config",
        "vllm",
        "--gpu-memory-utilization",
        str(spec.gpu_memory_utilization),
        "--dtype",
        spec.dtype,
        "--seed",
        str(spec.seed),
    ]
    if spec.max_lora_rank is not None:
        rank = next((r for r in LORA_RANKS if r >= spec.max_lora_rank), None)
        if rank is None:
            raise ValueError(f"LoRA rank {spec.max_lora_rank} exceeds vLLM's largest --max-lora-rank {LORA_RANKS[-1]}")
        cmd += ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", "2"]
    return cmd


def server_env(spec: ServerSpec, base: dict[str, str] | None = None) -> dict[str, str]:
    """The server's environment: ours, plus runtime adapter loading when LoRA is on."""
    env = dict(os.environ if base is None else base)
    if spec.max_lora_rank is not None:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    return env


class VLLMServer:
    """A server process this engine owns: started in its own session, stopped (its whole process group:
    vLLM spawns engine-core workers) on ``stop`` or at interpreter exit."""

    def __init__(self, spec: ServerSpec, log_path: Path, startup_timeout_s: float) -> None:
        self.spec = spec
        self.log_path = log_path
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen | None = None
        self.url = f"http://127.0.0.1:{spec.port}"

    def start(self) -> None:
        if not Path(self.spec.python).is_file():
            raise VLLMError(
                f"no vLLM environment at {self.spec.python}: create it with `make vllm-venv` (needs a CUDA GPU) or set engine.vllm.url"
            )
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                server_command(self.spec),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=server_env(self.spec),
                start_new_session=True,
            )
        atexit.register(self.stop)
        client, deadline = VLLMClient(self.url), time.monotonic() + self.startup_timeout_s
        while not client.healthy():
            if self.proc.poll() is not None:
                raise VLLMError(f"vLLM server exited with {self.proc.returncode} during startup; see {self.log_path}")
            if time.monotonic() > deadline:
                self.stop()
                raise VLLMError(f"vLLM server not healthy after {self.startup_timeout_s:.0f} s; see {self.log_path}")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # the group this server leads (start_new_session)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None
        atexit.unregister(self.stop)


# ---------------------------------------------------------------------------------------------- engine
class VLLMEngine:
    """The ``Engine`` of ``engines/base.py`` over a vLLM server."""

    def __init__(
        self,
        client: VLLMClient,
        end_ids: list[int],
        top_logprobs: int,
        max_concurrency: int = 64,
        server: VLLMServer | None = None,
    ) -> None:
        self.client = client
        self.end_ids = sorted({i for i in end_ids if i is not None})  # a tokenizer may lack an eos id
        self.top_logprobs = top_logprobs
        self.server = server
        self.model = SERVED_NAME  # the base, or the name of the loaded adapter
        self.policy_path: str | None = None  # checkpoint being served (None: what the server started with)
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="vllm")

    # ---- sampling
    def session(self) -> VLLMSession:
        return VLLMSession(self)

    def generate(
        self,
        prompts: list[list[int]],
        tries: list[TokenTrie | None],
        max_new_tokens: int,
        temperature: float,
        greedy: bool,
        seed: int,
    ) -> list[Generation]:
        """One action per prompt; requests run concurrently and the server batches them."""
        jobs = [
            self._pool.submit(self._one, k, p, t, max_new_tokens, temperature, greedy, seed)
            for k, (p, t) in enumerate(zip(prompts, tries))
        ]
        return [j.result() for j in jobs]

    def _one(
        self,
        k: int,
        prompt: list[int],
        trie: TokenTrie | None,
        max_new_tokens: int,
        temperature: float,
        greedy: bool,
        seed: int,
    ) -> Generation:
        if trie is None:
            return self._free(k, prompt, max_new_tokens, temperature, greedy, seed)
        return self._admissible(k, prompt, trie, max_new_tokens, temperature, greedy, seed)

    def _free(
        self, k: int, prompt: list[int], max_new_tokens: int, temperature: float, greedy: bool, seed: int
    ) -> Generation:
        body = completion_body(
            self.model,
            prompt,
            max_new_tokens,
            temperature,
            greedy,
            derive_seed(seed, "vllm", k),
            self.top_logprobs,
            self.end_ids,
        )
        comp = parse_completion(self.client.post("/v1/completions", body))
        if comp.finish_reason == "stop" and (not comp.steps or comp.steps[-1].token not in self.end_ids):
            raise VLLMError("the server stopped without returning the stop token; the action would lose its end id")
        g = Generation([], [], [], [], [])
        for step in comp.steps:
            dist = distribution(step, 1.0 if greedy else temperature, temperature)
            g.token_ids.append(step.token)
            g.logprobs.append(dist[step.token])
            g.entropy.append(entropy(dist))
            g.policy_mask.append(True)
            g.allowed.append([])
        g.finished = bool(g.token_ids) and g.token_ids[-1] in self.end_ids
        return g

    def _admissible(
        self,
        k: int,
        prompt: list[int],
        trie: TokenTrie,
        max_new_tokens: int,
        temperature: float,
        greedy: bool,
        seed: int,
    ) -> Generation:
        g, node, seq = Generation([], [], [], [], []), trie.root, list(prompt)
        for j in range(max_new_tokens):
            allowed = sorted(node.keys())
            if len(allowed) == 1:  # forced: no choice, nothing to ask the model
                tok, lp, ent = allowed[0], 0.0, 0.0
            else:
                body = completion_body(
                    self.model,
                    seq,
                    1,
                    temperature,
                    greedy,
                    derive_seed(seed, "vllm", k, j),
                    min(len(allowed), self.top_logprobs),
                    self.end_ids,
                    allowed,
                )
                step = parse_completion(self.client.post("/v1/completions", body)).steps[0]
                if step.token not in node:
                    raise VLLMError(f"server sampled {step.token}, outside allowed_token_ids {allowed}")
                dist = {
                    t: v
                    for t, v in distribution(step, 1.0 if greedy else temperature, temperature).items()
                    if t in node
                }
                tok, lp, ent = step.token, dist[step.token], entropy(dist)
            g.token_ids.append(tok)
            g.logprobs.append(lp)
            g.entropy.append(ent)
            g.policy_mask.append(len(allowed) != 1)
            g.allowed.append(allowed)
            seq.append(tok)
            node = node[tok]
            if tok in self.end_ids or not node:
                break
        g.finished = bool(g.token_ids) and (g.token_ids[-1] in self.end_ids or not node)
        return g

    # ---- policy updates
    def sync(self, checkpoint: str) -> None:
        """Serve ``checkpoint``: hot-load its adapter (LoRA) or reload its full weights."""
        if checkpoint == self.policy_path:
            return
        if (Path(checkpoint) / "adapter_config.json").is_file():
            self.load_adapter(checkpoint)
        else:
            self.load_weights(checkpoint)
        self.policy_path = checkpoint

    def load_adapter(self, path: str) -> None:
        """Load a LoRA adapter at runtime under a new name, route requests to it, drop the previous one."""
        name = f"{SERVED_NAME}-{Path(path).name.replace('=', '')}-{time.monotonic_ns()}"
        self.client.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(Path(path).resolve())})
        previous, self.model = self.model, name
        if previous != SERVED_NAME:
            self.client.post("/v1/unload_lora_adapter", {"lora_name": previous})

    def load_weights(self, path: str) -> None:
        """Full weights: restart the owned server on ``path`` (a reached server cannot be reloaded)."""
        if self.policy_path is None and self.server is not None and self.server.spec.model == str(path):
            return  # just started on these weights
        if self.server is None:
            raise VLLMError(
                "full-weight reload needs a server this engine started (engine.vllm.url is set); use LoRA to hot-load adapters"
            )
        self.server.stop()
        self.server = VLLMServer(
            dataclasses.replace(self.server.spec, model=str(path)), self.server.log_path, self.server.startup_timeout_s
        )
        self.server.start()
        self.model = SERVED_NAME

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        if self.server is not None:
            self.server.stop()


class VLLMSession:
    """Full-history context: the server keeps no per-episode state, so the session keeps each slot's
    token sequence and resends it whole; the prefix cache makes the shared prefix free."""

    def __init__(self, engine: VLLMEngine) -> None:
        self.e = engine
        self.seqs: dict[int, list[int]] = {}

    def extend(
        self,
        slots: list[int],
        new_ids: list[list[int]],
        tries: list[TokenTrie | None],
        max_new_tokens: int,
        temperature: float,
        greedy: bool,
        seed: int,
    ) -> list[Generation]:
        self.seqs = {s: self.seqs.get(s, []) + list(ids) for s, ids in zip(slots, new_ids)}  # absent slots are done
        gens = self.e.generate([self.seqs[s] for s in slots], tries, max_new_tokens, temperature, greedy, seed)
        for s, g in zip(slots, gens):
            self.seqs[s] += g.token_ids  # sampled tokens are part of the context, as in the KV cache
        return gens


def engine_from_config(cfg: TrainConfig, policy_path: str, end_ids: list[int]) -> VLLMEngine:
    """An engine for ``cfg.engine.vllm``: reach ``url``, or start a server serving ``policy_path``
    (for a LoRA policy: its base model, with runtime adapter loading on) in the trainer's dtype, so
    sampler and learner run the same precision."""
    from horizonrl.models import lora
    from horizonrl.models.loading import resolve_device, resolve_dtype

    v = cfg.engine.vllm
    if v.url is not None:
        return VLLMEngine(VLLMClient(v.url, v.request_timeout_s), end_ids, v.top_logprobs, v.max_concurrency)
    is_lora = lora.is_adapter_dir(policy_path)
    spec = ServerSpec(
        python=v.python,
        model=lora.base_model_path(policy_path) if is_lora else str(policy_path),
        port=v.port,
        gpu_memory_utilization=v.gpu_memory_utilization,
        max_logprobs=v.top_logprobs,
        max_lora_rank=cfg.model.lora.rank if is_lora and cfg.model.lora is not None else None,
        dtype=str(resolve_dtype(cfg.model.dtype, resolve_device(cfg.model.device))).removeprefix("torch."),
        seed=cfg.seed,
    )
    server = VLLMServer(spec, Path(cfg.data_dir) / "vllm" / f"server-{v.port}.log", v.startup_timeout_s)
    server.start()
    return VLLMEngine(VLLMClient(server.url, v.request_timeout_s), end_ids, v.top_logprobs, v.max_concurrency, server)
