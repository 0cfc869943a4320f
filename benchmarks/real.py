"""The ``real`` section (issue 39): the pipeline on a real pretrained model, SmolLM2-135M-Instruct (134.5 M
parameters, a 49,152-id vocabulary, 30 layers), on household easy in admissible mode, full context, episodes
of at most ``MAX_TURNS`` turns, ``update.micro_batch_tokens`` ``MICRO_BATCH_TOKENS``, one compute thread per
process.

* update: ``ppo_update`` over one iteration's rows (the transformers engine's episodes below, random
  advantages, the method's epochs: LOOP's 4, so that the pi_old check's recompute of 4 rows weighs as in a
  run's update rather than as a whole extra forward pass) against ``benchmarks.update.bare_loop`` over the
  same tokens, alternated P B B P, both in forward passes of at most ``update.micro_batch_tokens`` tokens
  (the bare loop once ran each step's rows in one pass, holding every row's (width, 49k) logits at once,
  a different memory regime from the update's). The bare loop computes the full-vocabulary logits at every
  position, the update only at policy tokens;
* step memory: the peak RSS of a process that loads the model and runs two full fine-tuning steps
  (``ppo_update``: pi_old recomputed, one minibatch, AdamW; the second with the AdamW state in memory, as
  every step of a run after its first) over 4 rows of 512 token ids, every position after the first a
  policy token: the output head's worst case (the probe that held every position's logits peaked at 8.0 GB);
* rollout: the same episodes (tasks, seeds) played by the transformers engine in this process and by a vLLM
  server (``.venv-vllm``; float32 on the CPU build);
* asynchronous loop: ``rollout.max_staleness`` k = 1 against k = 0 with the server generating beside the
  learner, as the train flow runs it: a generator thread syncs the server in place to version
  max(j-1-k, 0) (the learner's saved weights and probe) and plays iteration j while the learner (this
  process's main thread) updates on its episodes (one epoch) and saves each version. The update takes random
  advantages with every turn kept, as above: the untrained policy rarely wins, and LOOP filters out every
  row of a group without a win. The learner's peak RSS over the k = 0 iterations is the memory of a
  training iteration (the server's process tree is in the note).

The memory figures and the vLLM side run in child processes (``python -m benchmarks.real memory|loop``),
so that a process's peak RSS is that of what it measures. The model is ``$HORIZONRL_REAL_MODEL`` (a
converted folder), else ``horizonrl.models.pretrained``'s cached ``smollm2-135m-instruct`` where that module
exists; without either the section is not offered.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import psutil
import torch

from benchmarks.report import Figure
from benchmarks.update import _rows, bare_loop, random_advantage_rows
from benchmarks.vllm_server import VLLM_PYTHON, served_config
from horizonrl.config import TrainConfig
from horizonrl.engines.vllm import VLLMLaunch
from horizonrl.envs import make_suite
from horizonrl.models import pretrained
from horizonrl.models.loading import load_policy
from horizonrl.models.probe import probe_of
from horizonrl.rollout.loop import SamplingSettings, collect, sample_tasks
from horizonrl.rollout.prompting import ChatFormat
from horizonrl.seeding import derive_seed
from horizonrl.training.sequences import TrainRow
from horizonrl.training.trainer import UpdateSettings, ppo_update

MODEL_ENV = "HORIZONRL_REAL_MODEL"
MODEL_NAME = "smollm2-135m-instruct"
STEP_ROWS, STEP_LENGTH = 4, 512  # the full fine-tuning step whose memory is measured
STEP_LIMIT_MB = 5 * 1024
MICRO_BATCH_TOKENS = STEP_LENGTH  # update.micro_batch_tokens: 2,048 tokens' activations at once held 7.3 GB
ASYNC_TARGET = 1.5  # k=1 over k=0 where the two stages take similar time (issue 29, issue 39)
MAX_TURNS = 4  # short episodes (and one update epoch per iteration of the loop): the section's time


def model_dir(data_dir: str | Path) -> Path:
    """SmolLM2's converted folder: ``$HORIZONRL_REAL_MODEL``, else the project's cached copy of the known
    model (``horizonrl models fetch``; converted on first use)."""
    if os.environ.get(MODEL_ENV):
        return Path(os.environ[MODEL_ENV])
    return pretrained.fetch(MODEL_NAME, data_dir)


def available() -> bool:
    """The section runs where vLLM's environment exists (the model is fetched on first use)."""
    return VLLM_PYTHON.is_file()


def _child(args: list[str], env: dict[str, str]) -> dict:
    """Run ``python -m benchmarks.real ARGS`` (one compute thread) and return the JSON of its last line."""
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.real", *args],
        env={**env, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"benchmarks.real {args[0]} failed ({done.returncode}): {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _peak_rss_mb(pid: int | str = "self") -> float:
    """A process's peak RSS (VmHWM). Not ``getrusage``'s ``ru_maxrss``: Linux carries that over ``exec`` from
    the forked parent, so a child started by a large process reports at least the parent's size."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:  # the process has gone
        return 0.0
    return next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")), 0) / 1024


def step_memory(cfg_file: str, path: str) -> dict:
    """Two full fine-tuning steps over ``STEP_ROWS`` x ``STEP_LENGTH`` tokens in this (fresh) process, with the
    run's update settings but one epoch of one minibatch each: their seconds and this process's peak RSS
    after loading, after the first step and after the second."""
    torch.set_num_threads(1)
    cfg = TrainConfig.model_validate_json(Path(cfg_file).read_text())
    model, tokenizer = load_policy(path)
    gen = torch.Generator().manual_seed(0)
    vocab = model.get_output_embeddings().weight.shape[0]
    n = STEP_LENGTH - 1
    rows = [
        TrainRow(
            i,
            -1,
            torch.randint(3, vocab, (STEP_LENGTH,), generator=gen).tolist(),
            list(range(1, STEP_LENGTH)),
            [[] for _ in range(n)],
            [0.0] * n,
            [0] * n,
            list(range(n)),
            torch.randn(n, generator=gen).tolist(),
        )
        for i in range(STEP_ROWS)
    ]
    s = replace(
        UpdateSettings.from_config(cfg, tokenizer.pad_token_id, sampled_here=False), epochs=1, minibatch_size=STEP_ROWS
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.update.lr, weight_decay=cfg.update.weight_decay)
    loaded = _peak_rss_mb()
    t0 = time.perf_counter()
    ppo_update(model, optimizer, rows, s, seed=0)  # the first step creates the AdamW state
    first = _peak_rss_mb()
    ppo_update(model, optimizer, rows, s, seed=1)
    return {"seconds": time.perf_counter() - t0, "loaded_mb": loaded, "first_mb": first, "peak_rss_mb": _peak_rss_mb()}


def _tree_peak_mb(pid: int) -> float:
    """The sum of the peak RSS (VmHWM) over ``pid`` and its descendants."""
    proc = psutil.Process(pid)
    return sum(_peak_rss_mb(p.pid) for p in [proc, *proc.children(recursive=True)])


def lagged_run(cfg: TrainConfig, k: int, path: Path, engine, out: Path) -> dict[str, float]:
    """``cfg.iterations`` iterations at lag ``k`` with ``engine`` (a vLLM server) generating: wall seconds,
    the seconds each side was busy and the learner's sampled-vs-recomputed figures."""
    suite = make_suite(cfg.env.name, cfg.env.suite_seed, cfg.env.games, cfg.data_dir)
    model, tokenizer = load_policy(path)
    fmt = ChatFormat.for_tokenizer(tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.update.lr, weight_decay=cfg.update.weight_decay)
    s = UpdateSettings.from_config(cfg, tokenizer.pad_token_id, sampled_here=k == 0, decoupled=k > 0)
    pool = suite.tasks("train", cfg.env.tier, cfg.env.train_pool)
    vocab = len(tokenizer)
    versions = {0: (str(path), probe_of(model.eval(), vocab))}  # version -> (weights folder, probe)
    engine.sync(*versions[0])
    published = threading.Condition()
    busy = {"generate_s": 0.0, "update_s": 0.0, "sync_s": 0.0, "ppo_s": 0.0, "save_s": 0.0}

    def play(j: int) -> tuple:
        v = max(j - 1 - k, 0)
        with published:
            published.wait_for(lambda: v in versions)
            weights, probe = versions[v]
        t0 = time.perf_counter()
        engine.sync(weights, probe)
        busy["sync_s"] += time.perf_counter() - t0
        tasks = sample_tasks(pool, cfg.rollout.tasks_per_iteration, cfg.seed, j)
        sampling = SamplingSettings.from_config(cfg, suite, derive_seed(cfg.seed, "collect", j))
        records = collect(suite, tasks, cfg.rollout.group_size, engine, fmt, sampling)
        busy["generate_s"] += time.perf_counter() - t0
        return records, v

    with ThreadPoolExecutor(max_workers=1) as generator:
        t_start = time.perf_counter()
        futures = {j: generator.submit(play, j) for j in range(1, cfg.iterations + 1)}  # run in order
        for it in range(1, cfg.iterations + 1):
            records, v = futures[it].result()
            t0 = time.perf_counter()
            ppo_update(model, optimizer, random_advantage_rows(records, cfg.rollout.context), s, seed=it)
            busy["ppo_s"] += time.perf_counter() - t0
            saved = out / f"k{k}-v{it}"
            model.save_pretrained(saved, safe_serialization=True)  # the flow's update writes its checkpoint
            busy["save_s"] += time.perf_counter() - t0
            probe = probe_of(model.eval(), vocab)
            model.train()
            with published:
                versions[it] = (str(saved), probe)
                published.notify_all()
            busy["update_s"] += time.perf_counter() - t0
        wall = time.perf_counter() - t_start
    for it in range(1, cfg.iterations):  # the server may still serve the last one
        shutil.rmtree(out / f"k{k}-v{it}", ignore_errors=True)
    busy["save_s"] -= busy["ppo_s"]
    return {"wall_s": wall, **busy}


def vllm_loop(cfg_file: str, path: str, out_dir: str) -> dict:
    """The vLLM side in this (fresh) process: the rollout of the update's episodes, then k = 0 and k = 1."""
    torch.set_num_threads(1)
    cfg = TrainConfig.model_validate_json(Path(cfg_file).read_text())
    out = Path(out_dir)
    suite = make_suite(cfg.env.name, cfg.env.suite_seed, cfg.env.games, cfg.data_dir)
    model, tokenizer = load_policy(path)
    fmt = ChatFormat.for_tokenizer(tokenizer)
    vcfg = served_config(cfg, out)
    t0 = time.perf_counter()
    engine = VLLMLaunch.from_config(vcfg).engine(path, list(fmt.stop_ids))
    startup_s = time.perf_counter() - t0
    del model
    try:
        sampling = SamplingSettings.from_config(cfg, suite, 0)
        tasks = suite.tasks("train", cfg.env.tier, cfg.rollout.tasks_per_iteration)
        collect(suite, tasks[:1], 1, engine, fmt, sampling)  # warm-up: the first requests initialise lazily
        t0 = time.perf_counter()
        played = collect(suite, tasks, cfg.rollout.group_size, engine, fmt, sampling)
        rollout_s = time.perf_counter() - t0
        sync = lagged_run(vcfg, 0, Path(path), engine, out)
        learner_mb, server_mb = _peak_rss_mb(), _tree_peak_mb(engine.server.proc.pid)
        lag = lagged_run(vcfg, 1, Path(path), engine, out)
        in_place = engine.last_sync
    finally:
        engine.close()
    return {
        "startup_s": startup_s,
        "rollout_s": rollout_s,
        "rollout_tokens": sum(sum(t.gen.policy_mask) for r in played for t in r.turns),
        "sync": sync,
        "lag": lag,
        "learner_peak_mb": learner_mb,
        "server_peak_mb": server_mb,
        "last_sync": f"{in_place.path} {in_place.seconds:.2f} s, probe max diff {in_place.probe_max_diff:.1e}"
        if in_place is not None
        else "none",
    }


def run(cfg: TrainConfig, tasks_n: int, group: int, iterations: int, out: Path) -> list[Figure]:
    """Every figure of the section (module docstring) for ``tasks_n`` x ``group`` episodes per iteration and
    ``iterations`` iterations of the asynchronous loop."""
    out.mkdir(parents=True, exist_ok=True)
    path = model_dir(cfg.data_dir)
    cfg = cfg.model_copy(
        update={
            "iterations": iterations,
            "rollout": cfg.rollout.model_copy(update={"tasks_per_iteration": tasks_n, "group_size": group}),
            "model": cfg.model.model_copy(update={"path": str(path)}),
            "env": cfg.env.model_copy(update={"max_turns": MAX_TURNS}),
            "update": cfg.update.model_copy(update={"micro_batch_tokens": MICRO_BATCH_TOKENS}),
        }
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        initial, tokenizer = load_policy(path)
        _rows(cfg, initial, tokenizer, 1, 1)  # warm-up
        t0 = time.perf_counter()
        rows = _rows(cfg, initial, tokenizer, tasks_n, group)
        hf_s = time.perf_counter() - t0
        s = UpdateSettings.from_config(cfg, tokenizer.pad_token_id, sampled_here=True)
        s = replace(s, minibatch_size=len(rows))
        real = sum(r.positions[-1] + 1 for r in rows)
        ppo_s = bare_s = 0.0
        bare_tokens = 0
        for turn in "PBBP":
            model = copy.deepcopy(initial)
            if turn == "P":
                optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.update.lr)
                t0 = time.perf_counter()
                ppo_update(model, optimizer, rows, s, seed=0)
                ppo_s += time.perf_counter() - t0
            else:
                tokens, seconds = bare_loop(
                    model, rows, s.epochs, 1, cfg.update.lr, s.grad_clip, cfg.update.micro_batch_tokens
                )
                bare_tokens, bare_s = bare_tokens + tokens, bare_s + seconds
            del model
        del initial
    finally:
        torch.set_num_threads(threads)
    ppo_tps, bare_tps = 2 * s.epochs * real / ppo_s, bare_tokens / bare_s
    policy_tokens = sum(len(r.positions) for r in rows)

    env = dict(os.environ)
    cfg_file = out / "config.json"  # the children's: one update epoch per iteration (time)
    cfg_file.write_text(
        cfg.model_copy(update={"update": cfg.update.model_copy(update={"epochs": 1})}).model_dump_json()
    )
    memory = _child(["memory", str(cfg_file), str(path)], env)
    v = _child(["loop", str(cfg_file), str(path), str(out)], env)
    sync, lag = v["sync"], v["lag"]
    ratio = sync["wall_s"] / lag["wall_s"]
    ceiling = (sync["generate_s"] + sync["update_s"]) / max(sync["generate_s"], sync["update_s"])
    hf_tokens = sum(len(r.positions) for r in rows)
    where = f"{iterations} iterations of {tasks_n} x {group} episodes, {cfg.env.max_turns} turns"
    return [
        Figure(
            "real/update_tokens_s",
            ppo_tps,
            "tok/s",
            "",
            None,
            f"SmolLM2-135M, {len(rows)} rows, {real:,} tokens ({policy_tokens} policy tokens) x {s.epochs} epochs x 2, "
            f"{ppo_s:.1f} s",
        ),
        Figure(
            "real/update_vs_bare_loop",
            ppo_tps / bare_tps,
            "x",
            ">= 0.95",
            ppo_tps / bare_tps >= 0.95,
            f"bare forward+backward (full-vocabulary logits at every position, the same micro-batches): "
            f"{bare_tps:,.1f} tok/s",
        ),
        Figure(
            "real/step_peak_rss_mb",
            memory["peak_rss_mb"],
            "MB",
            f"<= {STEP_LIMIT_MB}",
            memory["peak_rss_mb"] <= STEP_LIMIT_MB,
            f"a full fine-tuning step (AdamW state held) over {STEP_ROWS} x {STEP_LENGTH} tokens, every position a "
            f"policy token, micro-batches of {MICRO_BATCH_TOKENS}, in its own process: loaded "
            f"{memory['loaded_mb']:,.0f} MB, first step {memory['first_mb']:,.0f} MB; "
            f"2 steps {memory['seconds']:.0f} s",
        ),
        Figure(
            "real/rollout_hf_vs_vllm",
            (hf_tokens / hf_s) / (v["rollout_tokens"] / v["rollout_s"]),
            "x",
            "",
            None,
            f"transformers {hf_tokens / hf_s:.1f} / vLLM {v['rollout_tokens'] / v['rollout_s']:.1f} policy tokens/s "
            f"({hf_s:.0f} s / {v['rollout_s']:.0f} s), {tasks_n} x {group} episodes of the same tasks and seeds; "
            f"server start {v['startup_s']:.0f} s",
        ),
        Figure(
            "real/iteration_peak_rss_mb",
            v["learner_peak_mb"],
            "MB",
            "",
            None,
            f"the learner's process over the k=0 iterations (update, checkpoint, probe); the vLLM "
            f"server's process tree: {v['server_peak_mb']:,.0f} MB",
        ),
        Figure(
            "real/async_throughput_ratio",
            ratio,
            "x",
            f">= {ASYNC_TARGET}" if ceiling >= ASYNC_TARGET else "",
            ratio >= ASYNC_TARGET if ceiling >= ASYNC_TARGET else None,
            f"k=1 over k=0, vLLM generating beside the learner ({where}); ceiling (gen+update)/max = {ceiling:.2f}",
        ),
        Figure(
            "real/async_generate_s",
            sync["generate_s"] / iterations,
            "s",
            "",
            None,
            f"per iteration, k=0 (in-place syncs incl.: {sync['sync_s'] / iterations:.1f} s; last {v['last_sync']})",
        ),
        Figure(
            "real/async_update_s",
            sync["update_s"] / iterations,
            "s",
            "",
            None,
            f"per iteration, k=0: ppo_update {sync['ppo_s'] / iterations:.1f} s (pi_old recomputed), checkpoint "
            f"{sync['save_s'] / iterations:.1f} s, the rest the probe; k=1: generate "
            f"{lag['generate_s'] / iterations:.1f} s, update {lag['update_s'] / iterations:.1f} s",
        ),
    ]


def main(argv: list[str]) -> int:
    """The child processes: ``memory CONFIG_JSON MODEL_DIR`` or ``loop CONFIG_JSON MODEL_DIR OUT_DIR``; one JSON
    line out."""
    if argv[0] == "memory":
        result = step_memory(argv[1], argv[2])
    else:
        result = vllm_loop(argv[1], argv[2], argv[3])
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
