"""The wire format of vLLM's OpenAI-compatible server, token ids in and out, and the HTTP client that speaks it.

Requests (``POST /v1/completions``) send the prompt as a list of token ids and ask for
``return_tokens_as_token_ids`` (tokens come back as ``"token_id:<id>"``), ``return_token_ids`` and
``logprobs=k``, so nothing is ever re-tokenised. The server is started with ``--enable-prefix-caching``
(a multi-turn context shares its prefix with the previous request, so only new tokens are prefilled) and
``--logprobs-mode processed_logprobs``: returned log-probs are those of the distribution actually sampled
from (after temperature and the ``allowed_token_ids`` whitelist), which is the engine contract of
``engines/base.py``. ``--generation-config vllm`` keeps the model's own sampling defaults (top_p,
repetition penalty) out, and every request also sets them to neutral values.

Only the standard library (``urllib``, ``json``): vLLM is never imported here (``engines/vllm.py``).
"""

from __future__ import annotations

import http.client
import json
import math
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

TOKEN_PREFIX = "token_id:"
TRIE_ARG = "horizonrl_trie"  # the request's ``vllm_xargs`` key the server-side trie processor reads


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
