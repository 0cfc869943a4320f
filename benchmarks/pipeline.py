"""Targets 5 and 6: the orchestration overhead of a train iteration, the main run's peak memory, and its start-up.

One subprocess runs the README's main run shortened to a few iterations (``horizonrl train --config
configs/loop_household_easy.yaml --set iterations=N``, everything else as shipped, evaluation of 200
held-out tasks included), in its own data folder and MLflow store. Its peak resident memory is read
with ``getrusage(RUSAGE_CHILDREN)`` in a small launcher (the largest single process) and, sampled with
psutil, as the sum over its process tree (the flow plus Prefect's temporary API server).

Tracing's share: the CPU seconds of logging an iteration's episode traces (its share of evaluations
included), over the flow's mean iteration time.

Each iteration's time through Prefect tasks, MLflow logging and Parquet is what the flow itself logs
as ``time/iteration_s``. The same iterations are then run here as plain library calls from the same
initial weights with the same seeds (tables stay in memory; no checkpoint is written), and the two
sums are compared. Evaluation and the flow's start-up are outside both.

Start-up: ``time/startup_s``, which the flow logs when started by ``horizonrl train``: from its process's
start to its first stage (the evaluation before training). Once from the run above (Prefect's temporary
API server, which the flow starts and waits for), once from a short run against a running Prefect server
(how sweeps and deployments run): the one ``PREFECT_API_URL`` names, else one started beforehand.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pyarrow as pa
import torch

import methods
from benchmarks.report import Figure
from horizonrl import store
from horizonrl.config import TrainConfig, load_config
from horizonrl.engines.hf import TransformersEngine
from horizonrl.envs import make_suite
from horizonrl.models.loading import load_policy
from horizonrl.rollout.loop import SamplingSettings, collect, sample_tasks, turn_horizon
from horizonrl.rollout.prompting import ChatFormat
from horizonrl.rollout.records import EpisodeRecord
from horizonrl.run.learner import initial_model_dir
from horizonrl.seeding import derive_seed
from horizonrl.tracking import mlflow_runs, traces
from horizonrl.training.sequences import attach_advantages, step_batch, train_rows
from horizonrl.training.trainer import UpdateSettings, ppo_update

MEMORY_LIMIT_MB = 4096
STARTUP_LIMIT_S = 8.0
STARTUP_RUN = [
    "iterations=1",
    "env.max_turns=2",
    "rollout.tasks_per_iteration=1",
    "rollout.group_size=2",
    "eval.n_tasks=1",
    "eval.n_tasks_ends=1",  # not the main config's 1000 tasks at each end: only the run's start is read
]
# The run is started from this small launcher, whose RUSAGE_CHILDREN then covers the run alone: a child
# forked straight from the suite would count the suite's own pages (shared until exec) in its peak.
_MAXRSS = (
    "import resource, subprocess, sys; rc = subprocess.call(sys.argv[2:]); "
    "open(sys.argv[1], 'w').write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)); sys.exit(rc)"
)


def _tree_rss(launcher: psutil.Process, helper_cpu: dict[int, float]) -> int:
    """RSS summed over the launcher and its descendants; records the CPU seconds so far of every
    process the run itself started (below the train process)."""
    total, run = 0, {c.pid for c in launcher.children()}
    for p in [launcher, *launcher.children(recursive=True)]:
        try:
            total += p.memory_info().rss
            if p.pid != launcher.pid and p.pid not in run:
                times = p.cpu_times()
                helper_cpu[p.pid] = times.user + times.system
        except psutil.Error:
            pass
    return total


def _train_command(config: str, overrides: list[str]) -> list[str]:
    return [
        str(Path(sys.executable).with_name("horizonrl")),
        "train",
        "--config",
        config,
        *(a for o in overrides for a in ("--set", o)),
    ]


def train_subprocess(config: str, overrides: list[str], log: Path) -> tuple[float, float, float, float]:
    """Run ``horizonrl train`` with Prefect's temporary API server (``PREFECT_API_URL`` unset); return
    (largest process peak MB, process-tree peak MB, wall seconds, CPU seconds of its helper processes:
    Prefect's API server, which competes with torch for cores). It runs in the log's folder: one where no
    local stack is up (``horizonrl stack up`` in the repository would otherwise serve it)."""
    command = _train_command(str(Path(config).resolve()), overrides)
    cmd = [sys.executable, "-c", _MAXRSS, str(log.with_suffix(".maxrss")), *command]
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    peak, t0, helper_cpu = 0, time.perf_counter(), {}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=log.parent)
        watched = psutil.Process(proc.pid)
        done = threading.Event()

        def sample() -> None:
            nonlocal peak
            while not done.wait(0.25):
                try:
                    peak = max(peak, _tree_rss(watched, helper_cpu))
                except psutil.Error:
                    return

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        rc = proc.wait()
        done.set()
        sampler.join()
    if rc != 0:
        raise RuntimeError(f"benchmark train run failed (exit {rc}); log: {log}")
    largest = int(log.with_suffix(".maxrss").read_text()) / 1024  # KiB on Linux
    return largest, peak / 2**20, time.perf_counter() - t0, sum(helper_cpu.values())


def startup_seconds(cfg: TrainConfig) -> float:
    """``time/startup_s`` the flow logged: from its process's start to its first stage."""
    c = mlflow_runs.client(cfg.tracking_uri)
    return c.get_metric_history(mlflow_runs.find_run(c, cfg.experiment, cfg.run_name).info.run_id, "time/startup_s")[
        0
    ].value


def startup_with_running_server(config: str, overrides: list[str], out_dir: Path) -> float:
    """``time/startup_s`` of a short ``horizonrl train`` (one iteration, tiny sizes: only its start is read)
    against a running Prefect server (its start is not counted), with the MLflow store and the tiny model
    that the main run left."""
    with running_prefect_server(out_dir) as api:
        run = [*overrides, f"run_name=startup-{time.strftime('%Y%m%d-%H%M%S')}", *STARTUP_RUN]
        with open(out_dir / "startup.log", "w") as out:
            rc = subprocess.call(
                _train_command(config, run),
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PREFECT_API_URL": api},
            )
        if rc != 0:
            raise RuntimeError(f"start-up train run failed (exit {rc}); log: {out_dir / 'startup.log'}")
        return startup_seconds(load_config(config, run))


@contextlib.contextmanager
def running_prefect_server(out_dir: Path, timeout_s: float = 180) -> Iterator[str]:
    """The API URL of a running Prefect server: the one ``PREFECT_API_URL`` names (a user's stack; the
    test's session server), else ``prefect server start`` on 127.0.0.1 with its own PREFECT_HOME under
    ``out_dir``, stopped on exit."""
    if os.environ.get("PREFECT_API_URL"):
        yield os.environ["PREFECT_API_URL"]
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    api = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str((out_dir / "prefect-server").resolve())}
    with open(out_dir / "prefect-server.log", "w") as log:
        server = subprocess.Popen(
            [
                str(Path(sys.executable).with_name("prefect")),
                "server",
                "start",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                urllib.request.urlopen(f"{api}/health", timeout=2).close()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"Prefect server did not start; log: {out_dir / 'prefect-server.log'}") from None
                time.sleep(0.5)
        yield api
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)


def flow_iteration_seconds(cfg: TrainConfig) -> list[float]:
    """``time/iteration_s`` of every iteration the flow logged, in order."""
    c = mlflow_runs.client(cfg.tracking_uri)
    run = mlflow_runs.find_run(c, cfg.experiment, cfg.run_name)
    return [m.value for m in sorted(c.get_metric_history(run.info.run_id, "time/iteration_s"), key=lambda m: m.step)]


def plain_iterations(cfg: TrainConfig) -> list[float]:
    """The flow's collect -> advantages -> update as plain calls (no Prefect, MLflow or Parquet)."""
    suite = make_suite(cfg.env.name, cfg.env.suite_seed, cfg.env.games, cfg.data_dir)
    model, tokenizer = load_policy(initial_model_dir(cfg, suite))
    fmt = ChatFormat.for_tokenizer(tokenizer)
    engine = TransformersEngine(model, tokenizer.pad_token_id, [fmt.end_id, tokenizer.eos_token_id])
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.update.lr, weight_decay=cfg.update.weight_decay)
    name, params = cfg.advantage_spec()
    s = UpdateSettings.from_config(cfg, tokenizer.pad_token_id, sampled_here=True, horizon=turn_horizon(cfg.env, suite))
    collect(
        suite, suite.tasks("test", cfg.env.tier, 1), 1, engine, fmt, SamplingSettings.from_config(cfg, suite, 0)
    )  # warm-up, as the flow's first evaluation is
    state, times, pool = None, [], None
    for it in range(1, cfg.iterations + 1):
        t0 = time.perf_counter()
        if pool is None:  # built on first use, as in the flow's first collect
            pool = suite.tasks("train", cfg.env.tier, cfg.env.train_pool)
        tasks = sample_tasks(pool, cfg.rollout.tasks_per_iteration, cfg.seed, it)
        records = collect(
            suite,
            tasks,
            cfg.rollout.group_size,
            engine,
            fmt,
            SamplingSettings.from_config(cfg, suite, derive_seed(cfg.seed, "collect", it)),
        )
        state = learn(records, cfg, it, it - 1, (name, params, state), model, optimizer, s)
        times.append(time.perf_counter() - t0)
    return times


def learn(
    records: list[EpisodeRecord],
    cfg: TrainConfig,
    iteration: int,
    version: int,
    estimator: tuple[str, object, object],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    s: UpdateSettings,
) -> object:
    """The flow's advantage and update stages over played ``records`` as plain calls (no Prefect, MLflow or
    Parquet): ``estimator`` is (name, params, state); returns the estimator's next state."""
    name, params, state = estimator
    turns, episodes = store.turns_table(records), store.episodes_table(records, cfg.run_name, iteration, version)
    batch = step_batch(episodes, turns, iteration - 1)
    result = methods.ADVANTAGES.get(name).fn(batch, params, state)
    adv = store.advantages_table(batch.traj_id, batch.turn, result.adv, result.keep, result.adv_tokens, batch.n_tokens)
    rows = attach_advantages(train_rows(turns, cfg.rollout.context), adv)
    if rows:
        ppo_update(model, optimizer, rows, s, derive_seed(cfg.seed, "update", iteration))
    return result.state


def tracing_figures(config: str, cfg: TrainConfig, iteration_s: list[float], out_dir: Path) -> list[Figure]:
    """Tracing's share of a main-config iteration, counted in CPU seconds of every thread (the database
    writes included): the run's iteration-1 training sample is logged again here through
    ``traces.log_episodes`` into a fresh store, and so are ``trace.eval_episodes`` of its episodes as one
    evaluation's traces; the main config evaluates ``iterations // eval.every + 1`` times in
    ``iterations``, so an iteration carries that share of an evaluation's cost. The sum, over the flow's
    mean iteration time. Also the flow's own seconds in tracing (``trace/*/log_s``) and the trace store's
    size (its spans' JSON) per iteration of the run above."""
    c = mlflow_runs.client(cfg.tracking_uri)
    run = mlflow_runs.find_run(c, cfg.experiment, cfg.run_name)
    found = c.search_traces(locations=[run.info.experiment_id], run_id=run.info.run_id, max_results=1000)
    size_kb = sum(len(json.dumps(span.to_dict())) for t in found for span in t.data.spans) / 1024
    blocking_s = sum(
        m.value for split in ("train", "eval") for m in c.get_metric_history(run.info.run_id, f"trace/{split}/log_s")
    )

    it_dir = store.iteration_dir(Path(cfg.data_dir), cfg.experiment, cfg.run_name, 1)
    episodes, turns = (
        store.read_table(it_dir / "episodes.parquet", "episodes"),
        store.read_table(it_dir / "turns.parquet", "turns"),
    )
    advantages = store.read_table(it_dir / f"advantages-{cfg.method}.parquet", "advantages")
    chosen = traces.training_sample(episodes, cfg.trace.train_random, derive_seed(cfg.seed, "trace", 1))
    uri = f"sqlite:///{(out_dir / 'tracing.db').resolve()}"
    (out_dir / "tracing.db").unlink(missing_ok=True)
    fresh = mlflow_runs.client(uri)
    experiment = fresh.create_experiment(
        "tracing", artifact_location=(out_dir / "tracing-artifacts").resolve().as_uri()
    )
    target = traces.TraceTarget(uri, fresh.create_run(experiment).info.run_id, cfg.run_name, cfg.method, cfg.seed)
    traces.log_episodes(
        target, "eval", 0, episodes.slice(0, 1), turns
    )  # the store's first writes set it up, as in the run

    def cpu_s(split: str, rollout_ids: list[int], adv: pa.Table | None) -> float:
        t0 = time.process_time()  # every thread of this process
        traces.log_episodes(target, split, 1, store.select_rollouts(episodes, rollout_ids), turns, adv)
        return time.process_time() - t0

    train_s = cpu_s("train", chosen, advantages)
    eval_ids = sorted(episodes["rollout_id"].to_pylist())[: cfg.trace.eval_episodes]
    eval_s = cpu_s("eval", eval_ids, None)
    fresh.set_terminated(target.run_id)  # the measuring run ends like any other
    main = load_config(config)
    evals_per_iteration = (main.iterations // main.eval.every + 1) / main.iterations
    per_iteration_s = train_s + eval_s * evals_per_iteration
    mean_iteration_s = sum(iteration_s) / len(iteration_s)
    share = per_iteration_s / mean_iteration_s
    per_iteration_kb = size_kb / len(iteration_s)
    ten_minutes_mb = per_iteration_kb * 600 / mean_iteration_s / 1024
    return [
        Figure(
            "tracing/share_of_iteration",
            share,
            "x",
            "<= 0.03",
            share <= 0.03,
            f"CPU {per_iteration_s:.2f} s per iteration (writes incl.): {len(chosen)} training traces {train_s:.2f} s, "
            f"{len(eval_ids)} evaluation traces {eval_s:.2f} s x {evals_per_iteration:.3f} evaluations per iteration; "
            f"iteration {mean_iteration_s:.1f} s",
        ),
        Figure(
            "tracing/flow_wait_share",
            blocking_s / sum(iteration_s),
            "x",
            "",
            None,
            f"the flow's own seconds in tracing in the run above: {blocking_s:.2f} s over {sum(iteration_s):.1f} s "
            "(its 2 evaluations' traces incl.)",
        ),
        Figure(
            "tracing/store_kb_per_iteration",
            per_iteration_kb,
            "kB",
            "",
            None,
            f"{size_kb:.0f} kB of traces (spans' JSON) in all; a 10-minute run at this pace: {ten_minutes_mb:.1f} MB",
        ),
    ]


def run(config: str, overrides: list[str], out_dir: Path) -> list[Figure]:
    out_dir = out_dir.resolve()  # the temporary-server run works in a folder of its own (train_subprocess)
    out_dir.mkdir(parents=True, exist_ok=True)
    overrides = [
        *overrides,
        f"run_name=bench-{time.strftime('%Y%m%d-%H%M%S')}",
        "experiment=benchmarks-pipeline",
        f"data_dir={out_dir / 'data'}",
        f"tracking_uri=sqlite:///{(out_dir / 'mlflow.db').resolve()}",
    ]
    cfg = load_config(config, overrides)
    largest, tree, wall, helper_cpu = train_subprocess(config, overrides, out_dir / "train.log")
    flow = flow_iteration_seconds(cfg)
    startup_temporary, startup_running = startup_seconds(cfg), startup_with_running_server(config, overrides, out_dir)
    tracing = tracing_figures(config, cfg, flow, out_dir)
    plain = plain_iterations(cfg)
    ratio = sum(flow) / sum(plain)
    return [
        *tracing,
        Figure(
            "pipeline/flow_vs_plain",
            ratio,
            "x",
            "<= 1.05",
            ratio <= 1.05,
            f"{len(flow)} iterations: flow {' + '.join(f'{t:.1f}' for t in flow)} s, plain "
            f"{' + '.join(f'{t:.1f}' for t in plain)} s",
        ),
        Figure(
            "pipeline/helper_cpu_s",
            helper_cpu,
            "s",
            "",
            None,
            f"CPU used by the run's helper processes (Prefect API server) over its {wall:.0f} s",
        ),
        Figure(
            "startup/temporary_server_s",
            startup_temporary,
            "s",
            "",
            None,
            "`horizonrl train` to its first stage (the evaluation before training): imports, Prefect's temporary API "
            "server, opening the run",
        ),
        Figure(
            "startup/running_server_s",
            startup_running,
            "s",
            f"<= {STARTUP_LIMIT_S:g}",
            startup_running <= STARTUP_LIMIT_S,
            "the same with PREFECT_API_URL at a running Prefect server (and the MLflow store, tiny model already "
            "there)",
        ),
        Figure(
            "memory/peak_rss_mb",
            largest,
            "MB",
            f"<= {MEMORY_LIMIT_MB}",
            largest <= MEMORY_LIMIT_MB,
            f"largest process of the main run, {cfg.iterations} iterations ({wall:.0f} s incl. evaluation and "
            "start-up)",
        ),
        Figure(
            "memory/peak_tree_rss_mb",
            tree,
            "MB",
            f"<= {MEMORY_LIMIT_MB}",
            tree <= MEMORY_LIMIT_MB,
            "sum over its process tree (Prefect API server incl.), sampled every 0.25 s",
        ),
    ]
