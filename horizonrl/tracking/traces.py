"""Episodes as MLflow traces: one trace per episode, one span per turn, the task group as the session.

The Traces tab of a run then shows what the agent did: each turn's observation and action, its reward
and, for training episodes, the advantage the method gave it. Traces are a sample, so the trace store
stays small: every evaluation episode up to ``trace.eval_episodes``, and per training iteration the best
and the worst episode of the mixed groups (groups whose returns differ: the ones that carry signal) plus
``trace.train_random`` random ones of them.

A trace is tagged with run, iteration, method, task, seed, status, return, split and rollout_id (and the
sha256 of the iteration's ``episodes.parquet`` for training episodes): the row of a trace is
(iteration, rollout_id) in the store, the trace of a row is found by searching those tags.

An episode is finished when it is logged, so its trace is written whole, straight to the tracking store:
the trace records first (one ``start_trace`` each, state IN_PROGRESS), then every span of the batch in one
``log_spans``, which sets each trace's state from its root span. MLflow's live tracer (a span object per
turn, OpenTelemetry export, a background queue whose spans raced their trace record) cost twice the
CPU for the same rows (``benchmarks/pipeline.py`` measures tracing's share of an iteration).

Logging is idempotent. A trace's id is derived from its key (run id, split, iteration, rollout id), and
only finished traces (not IN_PROGRESS) count as logged: a stage retried or resumed after a kill logs the
missing ones and writes the unfinished ones again under the same id, so no trace appears twice.
"""

from __future__ import annotations

import base64
import hashlib
import json
import time
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
from mlflow.entities import Span, SpanType, TraceInfo, TraceLocation, TraceState
from mlflow.tracing.client import TracingClient

from horizonrl import faults
from mlflow import MlflowClient

TRACE_KEY = "horizonrl.trace_key"
SESSION = "mlflow.trace.session"  # MLflow's trace metadata key for a session (here: a task group)
SOURCE_RUN = "mlflow.sourceRun"  # MLflow's trace metadata key that puts a trace in a run's Traces tab
TURN_COLUMNS = [
    "rollout_id",
    "turn",
    "observation",
    "action",
    "action_ids",
    "logprobs",
    "entropy",
    "reward",
    "done",
    "won",
    "valid",
    "gen_s",
    "env_s",
]
EPISODE_COLUMNS = [
    "rollout_id",
    "group_id",
    "task_id",
    "family",
    "task_seed",
    "kind",
    "parent_rollout",
    "branch_token",
    "n_turns",
    "episode_return",
    "won",
    "status",
    "error",
]


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


def logged_keys(c: MlflowClient, experiment_id: str, run_id: str, split: str, iteration: int) -> set[str]:
    """Keys of the finished traces of (run, split, iteration) in the store (an IN_PROGRESS trace lost its
    spans to a kill: it is written again)."""
    keys, token = set(), None
    while True:
        page = c.search_traces(
            locations=[experiment_id],
            run_id=run_id,
            include_spans=False,
            max_results=500,
            page_token=token,
            filter_string=f"tags.split = '{split}' AND tags.iteration = '{iteration}'",
        )
        keys.update(t.info.tags.get(TRACE_KEY, "") for t in page if t.info.state != TraceState.IN_PROGRESS)
        token = page.token
        if not token:
            return keys


def log_episodes(
    target: TraceTarget,
    split: str,
    iteration: int,
    episodes: pa.Table,
    turns: pa.Table,
    advantages: pa.Table | None = None,
    digest: str | None = None,
) -> dict[str, float]:
    """Log every episode of ``episodes`` (with its rows of ``turns`` and, if given, ``advantages``) as
    a trace of ``target``'s run, unless it is already there. Returns ``traces`` (this iteration's traces
    of ``split`` now in the store), ``logged`` (new ones), ``spans`` (new) and ``log_s`` (seconds, the
    look-up included)."""
    t0 = time.perf_counter()
    c = MlflowClient(target.tracking_uri)
    experiment_id = c.get_run(target.run_id).info.experiment_id
    done = logged_keys(c, experiment_id, target.run_id, split, iteration)
    ep = episodes.select(EPISODE_COLUMNS).to_pandas()
    ep = ep[~ep["rollout_id"].map(lambda r: trace_key(target.run_id, split, iteration, r) in done)].sort_values(
        "rollout_id"
    )
    rows = turns.select(TURN_COLUMNS).to_pandas()
    rows = rows[rows["rollout_id"].isin(ep["rollout_id"])]
    if advantages is not None:
        adv = advantages.select(["rollout_id", "turn", "adv", "keep"]).to_pandas()
        rows = rows.merge(adv, on=["rollout_id", "turn"], how="left")
    by_rollout: dict[int, list[dict]] = {}
    for row in rows.sort_values(["rollout_id", "turn"]).to_dict("records"):
        by_rollout.setdefault(int(row["rollout_id"]), []).append(row)
    built = [
        _episode_trace(target, experiment_id, split, iteration, e, by_rollout.get(int(e["rollout_id"]), []), digest)
        for e in ep.to_dict("records")
    ]
    writer = TracingClient(target.tracking_uri)
    if split == "train" and faults.active("trace", iteration):
        half = len(built) // 2
        _write(writer, experiment_id, built[:half])
        for info, _ in built[half:]:
            writer.start_trace(info)  # the rest is started, its spans never come: those traces stay IN_PROGRESS
        faults.kill_point("trace", iteration)
    _write(writer, experiment_id, built)
    return {
        "traces": float(len(done) + len(ep)),
        "logged": float(len(ep)),
        "spans": float(sum(len(spans) for _, spans in built)),
        "log_s": time.perf_counter() - t0,
    }


def _write(writer: TracingClient, experiment_id: str, built: list[tuple[TraceInfo, list[Span]]]) -> None:
    """The trace records, then all their spans in one batch (which finishes each trace)."""
    for info, _ in built:
        writer.start_trace(info)
    if built:
        writer.log_spans(experiment_id, [span for _, spans in built for span in spans])


def _id(key: str, n_bytes: int) -> int:
    """A non-zero id of ``n_bytes`` derived from ``key``: the same trace gets the same ids when written again."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:n_bytes], "big") or 1


def _b64(value: int, n_bytes: int) -> str:
    return base64.b64encode(value.to_bytes(n_bytes, "big")).decode()


def _span(
    trace_id: str,
    otel_trace: int,
    span_id: int,
    parent: int | None,
    name: str,
    span_type: str,
    start_ns: int,
    end_ns: int,
    inputs: dict,
    outputs: dict,
    attributes: dict,
    error: bool = False,
) -> Span:
    """An ended span in MLflow's stored form (attribute values JSON-encoded, ids base64 of their bytes)."""
    attrs = {
        "mlflow.traceRequestId": json.dumps(trace_id),
        "mlflow.spanType": json.dumps(span_type),
        "mlflow.spanInputs": json.dumps(inputs),
        "mlflow.spanOutputs": json.dumps(outputs),
        **{k: json.dumps(v) for k, v in attributes.items()},
    }
    return Span.from_dict(
        {
            "trace_id": _b64(otel_trace, 16),
            "span_id": _b64(span_id, 8),
            "parent_span_id": _b64(parent, 8) if parent else None,
            "name": name,
            "start_time_unix_nano": start_ns,
            "end_time_unix_nano": end_ns,
            "events": [],
            "links": [],
            "status": {"code": "STATUS_CODE_ERROR" if error else "STATUS_CODE_OK", "message": ""},
            "attributes": attrs,
        }
    )


def _episode_trace(
    target: TraceTarget, experiment_id: str, split: str, iteration: int, e: dict, turns: list[dict], digest: str | None
) -> tuple[TraceInfo, list[Span]]:
    """One trace: a root span for the episode, a child span per turn laid out by its generation and
    environment seconds (so the timeline shows where an episode's time went)."""
    rollout_id = int(e["rollout_id"])
    key = trace_key(target.run_id, split, iteration, rollout_id)
    otel_trace = _id(key, 16)
    trace_id, root_id = f"tr-{otel_trace:032x}", _id(f"{key}/episode", 8)
    durations = [int((float(row["gen_s"]) + float(row["env_s"])) * 1e9) for row in turns]
    start = time.time_ns() - sum(durations)
    spans, t = [], start
    for row, duration in zip(turns, durations):
        attributes = {
            "turn": int(row["turn"]),
            "action_tokens": len(row["action_ids"]),
            "reward": float(row["reward"]),
            "done": bool(row["done"]),
            "won": bool(row["won"]),
            "valid": bool(row["valid"]),
            "logprob_sum": float(np.sum(row["logprobs"])),
            "entropy_mean": float(np.mean(row["entropy"])) if len(row["entropy"]) else 0.0,
        }
        if "adv" in row and row["adv"] == row["adv"]:  # NaN: no advantage row for this turn
            attributes.update(advantage=float(row["adv"]), keep=bool(row["keep"]))
        outputs = {"action": row["action"], **{k: attributes[k] for k in ("reward", "advantage") if k in attributes}}
        spans.append(
            _span(
                trace_id,
                otel_trace,
                _id(f"{key}/{int(row['turn'])}", 8),
                root_id,
                f"turn {int(row['turn'])}",
                SpanType.LLM,
                t,
                t + duration,
                {"observation": row["observation"]},
                outputs,
                attributes,
            )
        )
        t += duration
    end = max(t, start + 1)
    # the game (a user's game file under env.games, else the task family) and its seed: a task index alone
    # does not say which game was played when the games change between runs
    inputs = {
        "task": str(e["task_id"]),
        "game": str(e["family"]),
        "task_seed": int(e["task_seed"]),
        "goal": str(turns[0]["observation"]) if turns else "",
    }
    outputs = {
        "return": float(e["episode_return"]),
        "won": bool(e["won"]),
        "turns": int(e["n_turns"]),
        "status": str(e["status"]),
    }
    name = f"episode {rollout_id}"
    spans.insert(
        0,
        _span(
            trace_id,
            otel_trace,
            root_id,
            None,
            name,
            SpanType.AGENT,
            start,
            end,
            inputs,
            outputs,
            {
                "rollout_id": rollout_id,
                "group_id": int(e["group_id"]),
                "kind": str(e["kind"]),
                "parent_rollout": int(e["parent_rollout"]),
                "branch_token": int(e["branch_token"]),
                "iteration": iteration,
            },
            error=e["status"] == "error",
        ),
    )
    tags = {
        "run": target.run_name,
        "iteration": str(iteration),
        "method": target.method,
        "task": str(e["task_id"]),
        "game": str(e["family"]),
        "task_seed": str(int(e["task_seed"])),
        "seed": str(target.seed),
        "status": str(e["status"]),
        "return": f"{float(e['episode_return']):g}",
        "split": split,
        "rollout_id": str(rollout_id),
        "won": str(bool(e["won"])).lower(),
        TRACE_KEY: key,
        "mlflow.traceName": name,
        "mlflow.trace.spansLocation": "TRACKING_STORE",
    }
    if digest:
        tags["episodes_digest"] = digest
    info = TraceInfo(
        trace_id=trace_id,
        trace_location=TraceLocation.from_experiment_id(experiment_id),
        request_time=start // 1_000_000,
        state=TraceState.IN_PROGRESS,
        execution_duration=(end - start) // 1_000_000,
        request_preview=json.dumps(inputs)[:1000],
        response_preview=json.dumps(outputs),
        trace_metadata={
            SOURCE_RUN: target.run_id,
            SESSION: f"{target.run_name}/{split}/iter={iteration}/group={int(e['group_id'])}",
            "mlflow.trace_schema.version": "3",
        },
        tags=tags,
    )
    return info, spans
