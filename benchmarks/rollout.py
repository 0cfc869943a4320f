"""Target 1: multi-turn rollout generation, measured side by side on the README's main run settings
(tiny Qwen2, household easy, admissible actions, full-history context with the KV cache carried).

* batched: ``rollout.collect`` of ``tasks x group`` episodes in lockstep (the engine, the trie and the
  environments all included);
* one at a time: the same tasks and settings, each episode its own ``collect`` call;
* bare replay: the forward calls the batched collect made (recorded by a hook on the model), replayed
  alone with the same inputs, each against a zero cache of the shape it had: what the schedule costs
  without the environment, the trie, sampling and the engine's bookkeeping (its in-place cache slab
  included; the replay appends to a dynamic cache, as transformers does by default);
* one ``generate``: transformers' ``model.generate`` over the same number of prompts, each as long as
  its episode's first prompt, producing the same number of new tokens in total (information: no turns,
  no environment, no trie, and no episode leaves early);
* prefill: the positions the engine's session computed in prefill (padding included) against the new
  tokens (observations, and each action's last token, fed with the next observation), and the naive
  total of re-reading the whole history each turn;
* decode padding: the share of decode positions fed for episodes whose action had ended;
* 150k vocabulary: the batched collect again with the same tiny sizes around the genuine Qwen3 tokenizer
  and chat template (151,669 ids; the word-level model has a few hundred), beside the word-level figure.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from benchmarks.report import Figure
from horizonrl.config import TrainConfig
from horizonrl.engines.hf import TransformersEngine
from horizonrl.envs import EnvSuite, make_suite
from horizonrl.models.loading import load_policy, tiny_model_dir
from horizonrl.rollout.loop import SamplingSettings, collect
from horizonrl.rollout.prompting import ChatFormat
from horizonrl.rollout.records import EpisodeRecord
from horizonrl.run.learner import initial_model_dir

TOKENIZER_CACHE = Path(__file__).resolve().parents[1] / "data" / "tokenizers"  # shared with the tests (npm, once)


def _new_tokens(records: list[EpisodeRecord]) -> int:
    return sum(len(t.gen.token_ids) for r in records for t in r.turns)


def _naive_prefill(records: list[EpisodeRecord]) -> int:
    """Tokens prefilled if every turn re-read its episode's whole history (no cache carried)."""
    total = 0
    for r in records:
        history = 0
        for t in r.turns:
            history += len(t.prompt_ids)
            total += history
            history += len(t.gen.token_ids)
    return total


def _record_calls(
    model: torch.nn.Module,
) -> tuple[list[tuple[dict, tuple[int, ...] | None]], torch.utils.hooks.RemovableHandle]:
    """Every forward call of ``model`` from now on, as (its arguments but the cache, the cache's key shape
    (rows, kv_heads, L, head_dim) or None), and the hook's handle."""
    calls: list[tuple[dict, tuple[int, ...] | None]] = []

    def hook(module, args, kwargs):
        cache = kwargs.get("cache")
        calls.append(
            (
                {k: v for k, v in kwargs.items() if k != "cache"},
                None if cache is None else tuple(cache.layers[0].keys.shape),
            )
        )

    return calls, model.register_forward_pre_hook(hook, with_kwargs=True)


def _replay(model: torch.nn.Module, calls: list[tuple[dict, tuple[int, ...] | None]]) -> float:
    """Seconds of ``calls`` replayed alone, each against a zero cache of its recorded shape (views of one
    buffer: nothing is copied before a call; the call's own cache append is)."""
    shapes = [s for _, s in calls if s is not None]
    buffer = (
        torch.zeros(max(s[0] for s in shapes), shapes[0][1], max(s[2] for s in shapes), shapes[0][3])
        if shapes
        else None
    )
    n_layers = model.config.num_hidden_layers
    t0 = time.perf_counter()
    with torch.no_grad():
        for kwargs, shape in calls:
            cache = None
            if shape is not None:
                cache, view = DynamicCache(), buffer[: shape[0], :, : shape[2]]
                for _ in range(n_layers):
                    layer = DynamicLayer()
                    layer.lazy_initialization(view, view)
                    layer.keys = layer.values = view
                    cache.layers.append(layer)
            model(**kwargs, cache=cache)
    return time.perf_counter() - t0


def _chat_vocab_collect(
    cfg: TrainConfig, suite: EnvSuite, tasks: list, group: int, seed: int
) -> tuple[float, int, int]:
    """(tokens/s, new tokens, vocabulary size) of the batched collect with the tiny model of ``cfg`` built
    around the genuine Qwen3 tokenizer (Qwen3 architecture)."""
    model_cfg = cfg.model.model_copy(update={"tokenizer": "qwen3"})
    model, tokenizer = load_policy(tiny_model_dir(cfg.data_dir, cfg.env.name, model_cfg, [], TOKENIZER_CACHE))
    fmt = ChatFormat.for_tokenizer(tokenizer)
    engine = TransformersEngine(model, tokenizer.pad_token_id, list(fmt.stop_ids))
    sampling = SamplingSettings.from_config(cfg, suite, seed)
    collect(suite, tasks[:1], 2, engine, fmt, sampling)  # warm-up
    t0 = time.perf_counter()
    records = collect(suite, tasks, group, engine, fmt, sampling)
    return _new_tokens(records) / (time.perf_counter() - t0), _new_tokens(records), len(tokenizer)


def run(cfg: TrainConfig, tasks_n: int, group: int, seed: int = 0) -> list[Figure]:
    suite = make_suite(cfg.env.name, cfg.env.suite_seed, cfg.env.games, cfg.data_dir)
    model, tokenizer = load_policy(initial_model_dir(cfg, suite))
    fmt = ChatFormat.for_tokenizer(tokenizer)
    engine = TransformersEngine(model, tokenizer.pad_token_id, [fmt.end_id, tokenizer.eos_token_id])
    sampling = SamplingSettings.from_config(cfg, suite, seed)
    tasks = suite.tasks("train", cfg.env.tier, tasks_n)
    collect(suite, tasks[:1], 2, engine, fmt, sampling)  # warm-up: first calls allocate and compile

    engine.counts.clear()
    calls, hook = _record_calls(model)
    t0 = time.perf_counter()
    batched = collect(suite, tasks, group, engine, fmt, sampling)
    batched_s = time.perf_counter() - t0
    hook.remove()
    counts = dict(engine.counts)
    replay_s = _replay(model, calls)

    single_tokens, t0 = 0, time.perf_counter()
    for g, task in enumerate(tasks):
        for k in range(group):
            single_tokens += _new_tokens(
                collect(suite, [task], 1, engine, fmt, sampling, first_rollout_id=g * group + k)
            )
    single_s = time.perf_counter() - t0

    prompts = [r.turns[0].prompt_ids for r in batched]
    per_row = max(round(_new_tokens(batched) / len(prompts)), 1)
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), tokenizer.pad_token_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], attn[i, width - len(p) :] = torch.tensor(p), 1
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    with torch.no_grad():
        model.generate(
            input_ids=ids,
            attention_mask=attn,
            max_new_tokens=per_row,
            min_new_tokens=per_row,
            do_sample=True,
            pad_token_id=tokenizer.pad_token_id,
        )
    generate_s = time.perf_counter() - t0

    chat_tps, chat_tokens, chat_vocab = _chat_vocab_collect(cfg, suite, tasks, group, seed)

    n = len(batched)
    batched_tps = _new_tokens(batched) / batched_s
    single_tps, generate_tps = single_tokens / single_s, n * per_row / generate_s
    prefill, new, naive = counts["prefill_computed"], counts["prefill_real"], _naive_prefill(batched)
    turns = sum(len(r.turns) for r in batched)
    prefills = sum("logits_to_keep" in kwargs for kwargs, _ in calls)
    decode_padding = 1 - counts["decode_real"] / counts["decode_computed"]
    return [
        Figure(
            "rollout/batched_tokens_s",
            batched_tps,
            "tok/s",
            "",
            None,
            f"{n} episodes, {turns} turns, {_new_tokens(batched)} new tokens, {batched_s:.1f} s",
        ),
        Figure(
            "rollout/vs_bare_replay",
            replay_s / batched_s,
            "x",
            ">= 0.8",
            replay_s / batched_s >= 0.8,
            f"the same {len(calls)} forward calls alone: {replay_s:.1f} s ({prefills} prefill, "
            f"{len(calls) - prefills} decode)",
        ),
        Figure(
            "rollout/vs_one_generate",
            batched_tps / generate_tps,
            "x",
            "",
            None,
            f"one generate call: {generate_tps:,.0f} tok/s ({n} x {per_row} tokens)",
        ),
        Figure(
            "rollout/vs_one_at_a_time",
            batched_tps / single_tps,
            "x",
            ">= 10",
            batched_tps / single_tps >= 10,
            f"one at a time: {single_tps:,.0f} tok/s",
        ),
        Figure(
            "rollout/prefill_vs_new",
            prefill / new,
            "x",
            "<= 1.15",
            prefill / new <= 1.15,
            f"prefilled {prefill:,} (padding incl.), new {new:,}",
        ),
        Figure("rollout/naive_prefill_vs_new", naive / new, "x", "", None, "re-reading the whole history each turn"),
        Figure(
            "rollout/qwen3_vocab_tokens_s",
            chat_tps,
            "tok/s",
            "",
            None,
            f"{chat_vocab:,} ids (word-level: {len(tokenizer):,} ids, {batched_tps:,.0f} tok/s): "
            f"x{chat_tps / batched_tps:.2f}; {chat_tokens} new tokens",
        ),
        Figure(
            "rollout/decode_padding",
            decode_padding,
            "frac",
            "<= 0.05",
            decode_padding <= 0.05,
            f"decode positions fed for episodes whose action had ended, of {counts['decode_computed']:,}",
        ),
    ]
