"""Sampling through vLLM's OpenAI-compatible server, token ids in and out (CPU or GPU rollouts).

vLLM cannot share an environment with Prefect (vLLM pins fastapi<0.137, Prefect needs >=0.139), so it runs in its own
virtual environment (``make vllm-venv``) as a server on 127.0.0.1, started here as a subprocess or reached at a
configured URL. Three modules, imported one way: ``vllm_wire`` (request and response bodies, the HTTP client),
``vllm_server`` (the server process and the serving copy of a checkpoint) and this one (the ``Engine``, weight
syncs, the engine a config asks for). None of them imports vllm.

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
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from horizonrl.config import TrainConfig, VLLMConfig
from horizonrl.engines import vllm_cache
from horizonrl.engines.base import Generation, SampleRequest, TokenTrie
from horizonrl.engines.vllm_server import (
    SERVED_NAME,
    TRIE_PROCESSOR,
    ServerSpec,
    VLLMServer,
    max_positions,
    serving_copy,
)
from horizonrl.engines.vllm_wire import (
    TRIE_ARG,
    VLLMClient,
    VLLMError,
    VLLMUnreachable,
    completion_body,
    distribution,
    entropy,
    parse_completion,
    trie_paths,
)
from horizonrl.models.probe import Probe
from horizonrl.seeding import derive_seed

# ---------------------------------------------------------------------------------------------- engine
SYNC_TOLERANCE = 1e-4  # float32 sampler vs learner; measured 1e-6 on CPU
PROBE_TOP = 20  # probe tokens compared per weight sync


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
        self._copies: list[Path] = [Path(server.spec.model).resolve()] if server is not None else []  # newest last
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="vllm")

    # ---- sampling
    def session(self) -> VLLMSession:
        return VLLMSession(self)

    def generate(self, request: SampleRequest) -> list[Generation]:
        """One action per prompt; requests run concurrently and the server batches them."""
        jobs = [
            self._pool.submit(self._one, k, p, t, request)
            for k, (p, t) in enumerate(zip(request.prompts, request.tries))
        ]
        return [j.result() for j in jobs]

    def _one(self, k: int, prompt: list[int], trie: TokenTrie | None, request: SampleRequest) -> Generation:
        """Prompt ``k`` of ``request`` (its ``prompts[k]`` and ``tries[k]``, or a session's whole sequence)."""
        try:
            if trie is None:
                return self._free(k, prompt, request)
            if self.one_request:
                return self._admissible_one(k, prompt, trie, request)
            return self._admissible(k, prompt, trie, request)
        except VLLMUnreachable as err:  # the server died: this episode ends as an error, the batch goes on
            return Generation([], [], [], [], [], finished=False, error=f"vLLM server unreachable: {err}")

    def _action_body(self, k: int, prompt: list[int], request: SampleRequest, top_logprobs: int) -> dict:
        """The request for prompt ``k``'s whole action (up to ``max_new_tokens``), seeded by its place in the
        batch, with ``top_logprobs`` log-probs a token (free mode, and admissible mode in one request)."""
        seed = derive_seed(request.seed, "vllm", k)
        return completion_body(
            self.model, prompt, request.max_new_tokens, request.temperature, request.greedy, seed, top_logprobs,
            self.end_ids,
        )  # fmt: skip

    def _free(self, k: int, prompt: list[int], request: SampleRequest) -> Generation:
        comp = parse_completion(
            self.client.post("/v1/completions", self._action_body(k, prompt, request, self.top_logprobs))
        )
        if comp.finish_reason == "stop" and (not comp.steps or comp.steps[-1].token not in self.end_ids):
            raise VLLMError("the server stopped without returning the stop token; the action would lose its end id")
        g = Generation([], [], [], [], [])
        for step in comp.steps:
            dist = distribution(step, 1.0 if request.greedy else request.temperature, request.temperature)
            g.token_ids.append(step.token)
            g.logprobs.append(dist[step.token])
            g.entropy.append(entropy(dist))
            g.policy_mask.append(True)
            g.allowed.append([])
        g.finished = bool(g.token_ids) and g.token_ids[-1] in self.end_ids
        return g

    def _admissible(self, k: int, prompt: list[int], trie: TokenTrie, request: SampleRequest) -> Generation:
        g, node, seq = Generation([], [], [], [], []), trie.root, list(prompt)
        for j in range(request.max_new_tokens):
            allowed = sorted(node.keys())
            if len(allowed) == 1:  # forced: no choice, nothing to ask the model
                tok, lp, ent = allowed[0], 0.0, 0.0
            else:
                body = completion_body(
                    self.model,
                    seq,
                    1,
                    request.temperature,
                    request.greedy,
                    derive_seed(request.seed, "vllm", k, j),
                    min(len(allowed), self.top_logprobs),
                    self.end_ids,
                    allowed,
                )
                step = parse_completion(self.client.post("/v1/completions", body)).steps[0]
                if step.token not in node:
                    raise VLLMError(f"server sampled {step.token}, outside allowed_token_ids {allowed}")
                dist = {
                    t: v
                    for t, v in distribution(
                        step, 1.0 if request.greedy else request.temperature, request.temperature
                    ).items()
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

    def _admissible_one(self, k: int, prompt: list[int], trie: TokenTrie, request: SampleRequest) -> Generation:
        """The whole action in one request: the server's trie processor masks each step to the trie node's
        children (``vllm_server_side/horizonrl_trie.py``); log-probs and entropies are read per step over
        those children as in ``_admissible``, and a token with one continuation counts as forced (log-prob
        0, entropy 0, ``policy_mask`` False). Sampling draws from the same distributions as the per-step
        path with one seed per action instead of one per step."""
        flat, width = trie_paths(trie.root)
        body = self._action_body(k, prompt, request, max(1, min(width, self.top_logprobs)))
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
                    for t, v in distribution(
                        step, 1.0 if request.greedy else request.temperature, request.temperature
                    ).items()
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
        """The directory the server loads for ``checkpoint``: its untied serving copy, numbered after every
        copy in ``weights_dir``. This engine's newest two copies are kept and every other one is deleted:
        copies that a killed run left behind are never kept in place of the new one."""
        if not untie or self.weights_dir is None:
            return Path(checkpoint).resolve()
        numbers = [int(p.name[1:]) for p in self.weights_dir.glob("w[0-9]*") if p.name[1:].isdigit()]
        out = serving_copy(checkpoint, self.weights_dir / f"w{max(numbers, default=0) + 1:06d}").resolve()
        self._copies = [*self._copies[-1:], out]
        for old in self.weights_dir.glob("w[0-9]*"):
            if old.resolve() not in self._copies:
                shutil.rmtree(old, ignore_errors=True)
        return out

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

    def extend(self, slots: list[int], request: SampleRequest) -> list[Generation]:
        self.seqs = {s: self.seqs.get(s, []) + list(ids) for s, ids in zip(slots, request.prompts)}  # absent: done
        gens = self.e.generate(dataclasses.replace(request, prompts=[self.seqs[s] for s in slots]))
        for s, g in zip(slots, gens):
            self.seqs[s] += g.token_ids  # sampled tokens are part of the context, as in the KV cache
        return gens


@dataclass(frozen=True)
class VLLMLaunch:
    """How a run reaches its vLLM server (``vllm.url``) or starts one: the ``engine.vllm`` section and the
    run's values a server needs (the vLLM build's device, the sampler's dtype, the seed, the data folder
    its weight copies live under, the LoRA rank). Built once at the run's start."""

    vllm: VLLMConfig
    device: str  # the vLLM build: cpu | cuda
    dtype: str  # the sampler's dtype, the trainer's: float32 on the CPU build
    seed: int
    data_dir: str
    lora_rank: int | None

    @classmethod
    def from_config(cls, cfg: TrainConfig) -> VLLMLaunch:
        from horizonrl.models.loading import resolve_device, resolve_dtype

        device = cfg.vllm_device()
        dtype = "float32" if device == "cpu" else str(resolve_dtype(cfg.model.dtype, resolve_device(cfg.model.device)))
        rank = cfg.model.lora.rank if cfg.model.lora is not None else None
        return cls(cfg.engine.vllm, device, dtype.removeprefix("torch."), cfg.seed, cfg.data_dir, rank)

    def reaching(self, url: str) -> VLLMLaunch:
        """The same settings for a server another process started, at ``url``."""
        return dataclasses.replace(self, vllm=self.vllm.model_copy(update={"url": url}))

    def engine(self, policy_path: str, end_ids: list[int]) -> VLLMEngine:
        """An engine that reaches ``vllm.url``, or starts a server serving ``policy_path`` (for a LoRA policy:
        its base model, with runtime adapter loading on; for full weights: its untied serving copy, so later
        checkpoints reload in place) in the trainer's dtype, so sampler and learner run the same precision
        (float32 on the CPU build)."""
        v = self.vllm
        tolerance = SYNC_TOLERANCE if v.sync_tolerance is None else v.sync_tolerance
        root = Path(self.data_dir) / "vllm"
        common = dict(
            weights_dir=root / f"weights-{v.port}",
            tolerance=tolerance,
            reload_in_place=v.reload_in_place,
            one_request=v.one_request_per_action,
        )
        if v.url is not None:
            client = VLLMClient(v.url, v.request_timeout_s)
            return VLLMEngine(client, end_ids, v.top_logprobs, v.max_concurrency, **common)
        log = root / f"server-{v.port}.log"
        source = self._source(policy_path)
        server = VLLMServer(self._spec(policy_path, source), log, v.startup_timeout_s, source=source)
        server.start()
        client = VLLMClient(server.url, v.request_timeout_s)
        return VLLMEngine(client, end_ids, v.top_logprobs, v.max_concurrency, server, **common)

    def _source(self, policy_path: str) -> str:
        """What the server loads: a LoRA policy's base model, or the full weights themselves."""
        from horizonrl.models import lora

        return lora.base_model_path(policy_path) if lora.is_adapter_dir(policy_path) else str(policy_path)

    def _spec(self, policy_path: str, source: str) -> ServerSpec:
        """The server's command line; ``source`` is ``_source(policy_path)``."""
        from horizonrl.models import lora

        v, is_lora = self.vllm, lora.is_adapter_dir(policy_path)
        root = Path(self.data_dir) / "vllm"
        model_dir = source if is_lora else str(serving_copy(source, root / f"weights-{v.port}" / "w000000").resolve())
        return ServerSpec(
            python=str(v.interpreter()),
            model=model_dir,
            port=v.port,
            gpu_memory_utilization=v.gpu_memory_utilization,
            max_logprobs=v.top_logprobs,
            max_lora_rank=self.lora_rank if is_lora else None,
            dtype=self.dtype,
            seed=self.seed,
            device=self.device,
            cache_root=str(vllm_cache.cache_root()),
            cpu_kvcache_gib=v.cpu_kvcache_gib,
            dev_mode=v.reload_in_place and not is_lora,
            max_model_len=max_positions(source),
            trie_processor=v.one_request_per_action,
        )
