"""Episodes as MLflow traces: one trace per episode, one span per turn, the task group as the session.

The Traces tab of a run then shows what the agent did: each turn's observation and action, its reward
and, for training episodes, the advantage the method gave it. Traces are a sample, so the trace store
stays small: every evaluation episode up to ``trace.eval_episodes``, and per training iteration the best
and the worst episode of the mixed groups (groups whose returns differ: the ones that carry signal) plus
``trace.train_random`` random ones of them.

A trace is tagged with run, iteration, method, task, seed, status, return, split and rollout_id (and the
sha256 of the iteration's ``episodes.parquet`` for training episodes): the row of a trace is
(iteration, rollout_id) in the store, the trace of a row is found by searching those tags. Logging is
idempotent: each trace carries a key (run id, split, iteration, rollout id), the keys already in the
store are looked up first and only the missing traces are logged, so a resumed or retried stage logs no
trace twice.

MLflow writes spans from a background queue (``MLFLOW_ENABLE_ASYNC_TRACE_LOGGING``, on by default), so
logging returns at once and the database writes overlap the next stage. Two of its defaults are changed
here (a user's own setting wins): spans go to the store in batches of up to 1024 instead of 5 (one
database session per batch, not one per five spans), and one writer thread instead of ten, so a trace's
spans are stored before its trace record and SQLite sees one writer (with ten, a trace record could come
first, and its spans were then also uploaded as an artifact file). Together they cut tracing's CPU
several-fold (``benchmarks/pipeline.py`` measures it). The queue is drained at the end of a run
(``flush``) and at process exit; traces still queued when a process is killed are not in the store, so
its successor logs them.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import mlflow
import numpy as np
import pyarrow as pa
from mlflow import MlflowClient
from mlflow.entities import SpanType

from horizonrl import faults

# Read by MLflow when its tracer starts (the first span), so set before any trace is logged.
os.environ.setdefault("MLFLOW_ASYNC_TRACE_LOGGING_MAX_SPAN_BATCH_SIZE", "1024")
os.environ.setdefault("MLFLOW_ASYNC_TRACE_LOGGING_MAX_WORKERS", "1")

TRACE_KEY = "horizonrl.trace_key"
SESSION = "mlflow.trace.session"  # MLflow's trace metadata key for a session (here: a task group)
SOURCE_RUN = "mlflow.sourceRun"  # MLflow's trace metadata key that puts a trace in a run's Traces tab
TURN_COLUMNS = ["rollout_id", "turn", "observation", "action", "action_ids", "logprobs", "entropy", "reward", "done", "won",
                "valid", "gen_s", "env_s"]
EPISODE_COLUMNS = ["rollout_id", "group_id", "task_id", "kind", "parent_rollout", "branch_token", "n_turns", "episode_return",
                   "won", "status", "error"]


@dataclass(frozen=True)
class TraceTarget:
    """The MLflow run that traces belong to, and the figures every trace of it is tagged with."""

    tracking_uri: str
    run_id: str
    run_name: str
    method: str
    seed: int


def training_sample(episodes: pa.Table, n_random: int, seed: int) -> list[int]:
    """Rollout ids to trace of one training iteration: the best and the worst episode of the mixed
    groups (ties go to the lower rollout id) and ``n_random`` others of them drawn with ``seed``. With
    no mixed group (nothing to learn from this iteration) the same is drawn from all episodes, so the
    reader still sees what the agent did."""
    df = episodes.select(["rollout_id", "group_id", "episode_return"]).to_pandas()
    mixed = df[df.groupby("group_id")["episode_return"].transform("nunique") > 1]
    pool = (mixed if len(mixed) else df).sort_values(["episode_return", "rollout_id"], ascending=[False, True])
    if pool.empty:
        return []
    best = int(pool["rollout_id"].iloc[0])
    worst = int(pool.sort_values(["episode_return", "rollout_id"])["rollout_id"].iloc[0])
    rest = pool.loc[~pool["rollout_id"].isin([best, worst]), "rollout_id"].to_numpy()
    drawn = np.random.default_rng(seed).choice(rest, size=min(n_random, len(rest)), replace=False) if len(rest) else []
    return sorted({best, worst, *(int(r) for r in drawn)})


def trace_key(run_id: str, split: str, iteration: int, rollout_id: int) -> str:
    return f"{run_id}/{split}/{iteration}/{rollout_id}"


_queued: dict[tuple[str, str, int], set[str]] = {}  # (run id, split, iteration) -> keys this process has queued


def logged_keys(c: MlflowClient, experiment_id: str, run_id: str, split: str, iteration: int) -> set[str]:
    """Keys of the traces of (run, split, iteration) in the store: written by any process, or queued
    by this one. (No drain first: draining stops MLflow's writer thread, which waits up to a second.)"""
    keys, token = set(_queued.get((run_id, split, iteration), ())), None
    while True:
        page = c.search_traces(locations=[experiment_id], run_id=run_id, include_spans=False, max_results=500, page_token=token,
                               filter_string=f"tags.split = '{split}' AND tags.iteration = '{iteration}'")
        keys.update(t.info.tags.get(TRACE_KEY, "") for t in page)
        token = page.token
        if not token:
            return keys


def flush() -> None:
    """Wait until every queued trace is in the store (the end of a run; MLflow also drains at exit)."""
    mlflow.flush_trace_async_logging()


def log_episodes(target: TraceTarget, split: str, iteration: int, episodes: pa.Table, turns: pa.Table,
                 advantages: pa.Table | None = None, digest: str | None = None) -> dict[str, float]:
    """Log every episode of ``episodes`` (with its rows of ``turns`` and, if given, ``advantages``) as
    a trace of ``target``'s run, unless it is already there. Returns ``traces`` (this iteration's traces
    of ``split`` now in the store or queued), ``logged`` (new ones), ``spans`` (new) and ``log_s``
    (seconds spent here, the database look-up included; the writes themselves run on MLflow's thread)."""
    t0 = time.perf_counter()
    if mlflow.get_tracking_uri() != target.tracking_uri:
        flush()  # spans queued for the previous store go there first
        mlflow.set_tracking_uri(target.tracking_uri)
    c = MlflowClient(target.tracking_uri)
    experiment_id = c.get_run(target.run_id).info.experiment_id
    done = logged_keys(c, experiment_id, target.run_id, split, iteration)
    ep = episodes.select(EPISODE_COLUMNS).to_pandas()
    ep = ep[~ep["rollout_id"].map(lambda r: trace_key(target.run_id, split, iteration, r) in done)].sort_values("rollout_id")
    rows = turns.select(TURN_COLUMNS).to_pandas()
    rows = rows[rows["rollout_id"].isin(ep["rollout_id"])]
    if advantages is not None:
        adv = advantages.select(["rollout_id", "turn", "adv", "keep"]).to_pandas()
        rows = rows.merge(adv, on=["rollout_id", "turn"], how="left")
    by_rollout: dict[int, list[dict]] = {}
    for row in rows.sort_values(["rollout_id", "turn"]).to_dict("records"):
        by_rollout.setdefault(int(row["rollout_id"]), []).append(row)
    spans = 0
    for i, e in enumerate(ep.to_dict("records")):
        if split == "train" and i == len(ep) // 2 and faults.active("trace", iteration):
            flush()  # half of the traces are in the store when the kill comes
            faults.kill_point("trace", iteration)
        spans += _log_episode(target, experiment_id, split, iteration, e, by_rollout.get(int(e["rollout_id"]), []), digest)
        _queued.setdefault((target.run_id, split, iteration), set()).add(trace_key(target.run_id, split, iteration, int(e["rollout_id"])))
    return {"traces": float(len(done) + len(ep)), "logged": float(len(ep)), "spans": float(spans), "log_s": time.perf_counter() - t0}


def _log_episode(target: TraceTarget, experiment_id: str, split: str, iteration: int, e: dict, turns: list[dict],
                 digest: str | None) -> int:
    """One trace: a root span for the episode, a child span per turn laid out by its generation and
    environment seconds (so the timeline shows where an episode's time went). Returns its span count."""
    rollout_id = int(e["rollout_id"])
    durations = [int((float(row["gen_s"]) + float(row["env_s"])) * 1e9) for row in turns]
    start = time.time_ns() - sum(durations)
    tags = {"run": target.run_name, "iteration": str(iteration), "method": target.method, "task": str(e["task_id"]),
            "seed": str(target.seed), "status": str(e["status"]), "return": f"{float(e['episode_return']):g}", "split": split,
            "rollout_id": str(rollout_id), "won": str(bool(e["won"])).lower(), TRACE_KEY: trace_key(target.run_id, split, iteration, rollout_id)}
    if digest:
        tags["episodes_digest"] = digest
    root = mlflow.start_span_no_context(
        f"episode {rollout_id}", span_type=SpanType.AGENT, experiment_id=experiment_id, start_time_ns=start, tags=tags,
        metadata={SOURCE_RUN: target.run_id, SESSION: f"{target.run_name}/{split}/iter={iteration}/group={int(e['group_id'])}"},
        inputs={"task": str(e["task_id"]), "goal": str(turns[0]["observation"]) if turns else ""},
        attributes={"rollout_id": rollout_id, "group_id": int(e["group_id"]), "kind": str(e["kind"]),
                    "parent_rollout": int(e["parent_rollout"]), "branch_token": int(e["branch_token"]), "iteration": iteration})
    t = start
    for row, duration in zip(turns, durations):
        attributes = {"turn": int(row["turn"]), "action_tokens": len(row["action_ids"]), "reward": float(row["reward"]),
                      "done": bool(row["done"]), "won": bool(row["won"]), "valid": bool(row["valid"]),
                      "logprob_sum": float(np.sum(row["logprobs"])), "entropy_mean": float(np.mean(row["entropy"])) if len(row["entropy"]) else 0.0}
        if "adv" in row and row["adv"] == row["adv"]:  # NaN: no advantage row for this turn
            attributes.update(advantage=float(row["adv"]), keep=bool(row["keep"]))
        span = mlflow.start_span_no_context(f"turn {int(row['turn'])}", span_type=SpanType.LLM, parent_span=root, start_time_ns=t,
                                            inputs={"observation": row["observation"]}, attributes=attributes)
        t += duration
        span.set_outputs({"action": row["action"], **{k: attributes[k] for k in ("reward", "advantage") if k in attributes}})
        span.end(end_time_ns=t)
    root.set_outputs({"return": float(e["episode_return"]), "won": bool(e["won"]), "turns": int(e["n_turns"]), "status": str(e["status"])})
    root.end(status="ERROR" if e["status"] == "error" else "OK", end_time_ns=max(t, start + 1))
    return 1 + len(turns)
