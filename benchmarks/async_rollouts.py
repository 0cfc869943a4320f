"""Issue 29: what asynchronous rollouts (``rollout.max_staleness``) buy in iteration throughput.

The train flow's stages as plain library calls (collect -> advantages -> PPO update, no Prefect, MLflow or
Parquet), scheduled as the flow schedules them: a generator thread with its own copy of the weights plays
iteration j with version max(j-1-k, 0) while the learner thread updates; k = 0 is the same machinery
with no lag (the generator waits for the update before each iteration: one stage after another). The
same iterations, seeds and initial weights for both; the ratio is k=0's wall time over k=1's.

Pinning: torch runs one intra-op thread, and where the process may use two cores or more the generator
thread is pinned to the first and the learner to the second (``os.sched_setaffinity`` of the calling
thread). ``gen_latency_s`` adds idle waiting to every engine call (``benchmarks.env_pool._RemoteLatency``):
a stand-in for generation on a GPU or a vLLM server, which frees this CPU while it waits.

Thread or process: the k=1 CPU run is repeated with the generator in a worker process (its own
interpreter, pinned to the generator's core; weights sent to it per version, records sent back), to
measure which overlaps better (``async/throughput_ratio_cpu_process`` beside ``..._cpu``).

The ceiling is (generate + update) / max(generate, update) of the synchronous run: 2x when the two take
the same time, close to 1x when one dominates (the main config's update is a fraction of its collect).
"""

from __future__ import annotations

import copy
import multiprocessing as mp
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from benchmarks.env_pool import _RemoteLatency
from benchmarks.pipeline import learn
from benchmarks.report import Figure
from horizonrl.config import TrainConfig
from horizonrl.engines.hf import TransformersEngine
from horizonrl.envs import make_suite
from horizonrl.models.loading import load_policy
from horizonrl.rollout.loop import SamplingSettings, collect, sample_tasks
from horizonrl.rollout.prompting import ChatFormat
from horizonrl.run.learner import initial_model_dir
from horizonrl.seeding import derive_seed
from horizonrl.training.trainer import UpdateSettings

TARGET = 1.5  # k=1 over k=0 where the two stages take similar time (issue 29)


def _pin(core: int | None) -> None:
    """Pin the calling thread to ``core`` (Linux: pid 0 is the calling thread); None leaves it."""
    if core is not None:
        os.sched_setaffinity(0, {core})


def _serve(cfg_values: dict, core: int | None, latency_s: float, inbox: mp.Queue, outbox: mp.Queue) -> None:
    """A generator process: its own model, engine and environments; plays (iteration, weights) requests."""
    if core is not None:
        os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    cfg = TrainConfig.model_validate(cfg_values)
    suite = make_suite(cfg.env.name, cfg.env.suite_seed, cfg.env.games, cfg.data_dir)
    model, tokenizer = load_policy(initial_model_dir(cfg, suite))
    fmt = ChatFormat.for_tokenizer(tokenizer)
    engine = TransformersEngine(model, tokenizer.pad_token_id, list(fmt.stop_ids))
    engine = _RemoteLatency(engine, latency_s) if latency_s else engine
    pool = suite.tasks("train", cfg.env.tier, cfg.env.train_pool)
    outbox.put("ready")
    while (job := inbox.get()) is not None:
        j, weights = job
        model.load_state_dict(weights)
        tasks = sample_tasks(pool, cfg.rollout.tasks_per_iteration, cfg.seed, j)
        sampling = SamplingSettings.from_config(cfg, suite, derive_seed(cfg.seed, "collect", j))
        outbox.put(collect(suite, tasks, cfg.rollout.group_size, engine, fmt, sampling))


def lagged_run(cfg: TrainConfig, k: int, gen_latency_s: float = 0.0, process: bool = False) -> dict[str, float]:
    """Wall seconds of ``cfg.iterations`` iterations at lag ``k``, and the seconds each side was busy.
    ``process``: the generator is a worker process (started before the clock) instead of a thread; the
    thread then only hands it each iteration's weights and takes its records back."""
    suite = make_suite(cfg.env.name, cfg.env.suite_seed, cfg.env.games, cfg.data_dir)
    model, tokenizer = load_policy(initial_model_dir(cfg, suite))
    fmt = ChatFormat.for_tokenizer(tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.update.lr, weight_decay=cfg.update.weight_decay)
    gen_model = copy.deepcopy(model)
    engine = TransformersEngine(gen_model, tokenizer.pad_token_id, list(fmt.stop_ids))
    engine = _RemoteLatency(engine, gen_latency_s) if gen_latency_s else engine
    name, params = cfg.advantage_spec()
    s = UpdateSettings.from_config(cfg, tokenizer.pad_token_id, sampled_here=k == 0, decoupled=k > 0)
    pool = suite.tasks("train", cfg.env.tier, cfg.env.train_pool)
    cores = sorted(os.sched_getaffinity(0))
    gen_core, learn_core = (cores[0], cores[1]) if len(cores) >= 2 else (None, None)
    versions = {0: copy.deepcopy(model.state_dict())}  # version -> weights, published by the learner
    published = threading.Condition()
    busy = {"generate_s": 0.0, "update_s": 0.0}
    worker = None
    if process:
        spawn = mp.get_context("spawn")
        inbox, outbox = spawn.Queue(), spawn.Queue()
        worker = spawn.Process(target=_serve, args=(cfg.model_dump(), gen_core, gen_latency_s, inbox, outbox))
        worker.start()
        assert outbox.get(timeout=600) == "ready"

    def play(j: int) -> tuple:
        _pin(gen_core)
        v = max(j - 1 - k, 0)
        with published:
            published.wait_for(lambda: v in versions)
            weights = versions[v]
        t0 = time.perf_counter()
        if worker is not None:
            inbox.put((j, weights))
            records = outbox.get()
        else:
            gen_model.load_state_dict(weights)
            tasks = sample_tasks(pool, cfg.rollout.tasks_per_iteration, cfg.seed, j)
            sampling = SamplingSettings.from_config(cfg, suite, derive_seed(cfg.seed, "collect", j))
            records = collect(suite, tasks, cfg.rollout.group_size, engine, fmt, sampling)
        busy["generate_s"] += time.perf_counter() - t0
        return records, v

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    state = None
    try:
        with ThreadPoolExecutor(max_workers=1) as generator:
            t_start = time.perf_counter()
            futures = {j: generator.submit(play, j) for j in range(1, cfg.iterations + 1)}  # run in order
            _pin(learn_core)
            for it in range(1, cfg.iterations + 1):
                records, v = futures[it].result()
                t0 = time.perf_counter()
                state = learn(records, cfg, it, v, (name, params, state), model, optimizer, s)
                with published:
                    versions[it] = copy.deepcopy(model.state_dict())
                    published.notify_all()
                busy["update_s"] += time.perf_counter() - t0
            wall = time.perf_counter() - t_start
    finally:
        torch.set_num_threads(threads)
        os.sched_setaffinity(0, cores)
        if worker is not None:
            inbox.put(None)
            worker.join(timeout=60)
    return {"wall_s": wall, **busy}


def run(cfg: TrainConfig, iterations: int, tasks: int, group: int, gen_latency_ms: float) -> list[Figure]:
    """k=0 against k=1 on ``cfg`` with ``tasks`` x ``group`` rollouts per iteration for ``iterations``
    iterations, on the CPU as is and with ``gen_latency_ms`` of idle waiting per engine call standing in
    for a GPU generator."""
    rollout = cfg.rollout.model_copy(update={"tasks_per_iteration": tasks, "group_size": group})
    cfg = cfg.model_copy(update={"iterations": iterations, "rollout": rollout})
    cores = len(os.sched_getaffinity(0))
    figures, walls = [], {}
    for label, latency in (("cpu", 0.0), ("gen_latency", gen_latency_ms / 1000)):
        sync = lagged_run(cfg, 0, latency)
        lag = lagged_run(cfg, 1, latency)
        walls[label] = sync["wall_s"]
        ratio = sync["wall_s"] / lag["wall_s"]
        ceiling = (sync["generate_s"] + sync["update_s"]) / max(sync["generate_s"], sync["update_s"])
        where = f"{cores} cores, {iterations} iterations of {tasks} x {group} rollouts" + (
            f", +{gen_latency_ms:g} ms per engine call" if latency else ""
        )
        figures += [
            Figure(
                f"async/throughput_ratio_{label}",
                ratio,
                "x",
                f">= {TARGET}" if ceiling >= TARGET else "",
                ratio >= TARGET if ceiling >= TARGET else None,
                f"k=1 over k=0 iterations per second ({where}); ceiling (gen+update)/max = {ceiling:.2f}",
            ),
            Figure(f"async/generate_s_{label}", sync["generate_s"] / iterations, "s", "", None, "per iteration, k=0"),
            Figure(f"async/update_s_{label}", sync["update_s"] / iterations, "s", "", None, "per iteration, k=0"),
        ]
    process = lagged_run(cfg, 1, 0.0, process=True)
    note = "k=1 over k=0 as throughput_ratio_cpu, the generator a worker process instead of a thread"
    figures.append(Figure("async/throughput_ratio_cpu_process", walls["cpu"] / process["wall_s"], "x", "", None, note))
    return figures
