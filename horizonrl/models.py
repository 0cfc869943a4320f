"""Policy models: a tiny Qwen2 built from a config with a word-level tokenizer trained on the
environment's own text, or any causal LM from a local path or hub id.

The tiny model is saved once under ``<data_dir>/models/<key>/`` (safetensors) and reused, so every run
with the same environment, architecture and seed starts from the same weights.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

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


def tiny_model(vocab_size: int, cfg: ModelConfig, pad_id: int, eos_id: int) -> Qwen2ForCausalLM:
    """A Qwen2-architecture model from ``cfg.tiny``; weights fixed by ``cfg.init_seed``."""
    t = cfg.tiny
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size,
        num_hidden_layers=t.num_layers,
        num_attention_heads=t.num_heads,
        num_key_value_heads=t.num_kv_heads,
        max_position_embeddings=t.max_positions,
        tie_word_embeddings=True,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        bos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.init_seed)
        return Qwen2ForCausalLM(config)


def tiny_model_dir(data_dir: str | Path, env_key: str, cfg: ModelConfig, corpus: list[str]) -> Path:
    """Build (once) and return the directory of the tiny model for this environment and config."""
    spec = {"env": env_key, "tiny": cfg.tiny.model_dump(), "seed": cfg.init_seed, "corpus": hashlib.sha256("\n".join(corpus).encode()).hexdigest()}
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    out = Path(data_dir) / "models" / f"tiny-qwen2-{env_key}-{key}"
    if (out / "model.safetensors").is_file():
        return out
    tokenizer = train_word_tokenizer(corpus)
    model = tiny_model(len(tokenizer), cfg, tokenizer.pad_token_id, tokenizer.eos_token_id)
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
