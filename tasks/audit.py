"""The credit audit's stages (docs/algorithms.md §8), each a thin task over ``horizonrl.audit``: open the audit,
play the groups, pick the decision points, estimate the Monte Carlo truth, score every estimator, finish.

The audit's folder, ``<data_dir>/<experiment>/<name>/``:

    audit.json                                   its settings: a rerun of the name must match them (and resumes)
    episodes.parquet, turns.parquet              the groups, played as training collects an iteration
    appo-episodes.parquet, appo-turns.parquet    the same with APPO's branches, as an APPO run plays them
    points.parquet                               the decision points and their Monte Carlo truth (kind ``audit``)
    continuations/block-<b>-of-<n>-*.parquet     the continuations (episodes of kind ``audit``), block by block
    advantages-<estimator>.parquet               each estimator's advantages over the groups (the training path)
    scores.json, audit.png                       the figures (the page's source) and the figure
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import pyarrow as pa
from prefect import get_run_logger, task
from prefect.cache_policies import NONE
from prefect.client.schemas.objects import FlowRun, State

from horizonrl import store
from horizonrl.audit import page, truth
from horizonrl.audit import points as audit_points
from horizonrl.audit.policy import checkpoint_ref, is_checkpoint, training_run
from horizonrl.config import MODEL_URI_PREFIXES, AuditConfig, TrainConfig
from horizonrl.envs import EnvSuite, make_suite
from horizonrl.files import write_json
from horizonrl.rollout.loop import sample_tasks, split_shards
from horizonrl.rollout.metrics import check_complete
from horizonrl.run.learner import initial_model_dir, policy_from_store
from horizonrl.seeding import derive_seed
from horizonrl.tracking import mlflow_runs
from horizonrl.training.checkpoint import CheckpointRef
from tasks.context import RunContext, close_owners, open_owners, owners
from tasks.run import run_params
from tasks.tracking import log_stage

SETTINGS_FILE = "audit.json"
FIGURE_FILE = "audit.png"


@dataclass(frozen=True)
class AuditRef:
    """What every stage of an audit receives."""

    ctx: RunContext  # the train config it plays by (its run name the audit's), its folder, its MLflow run
    audit: AuditConfig
    policy: CheckpointRef
    source: str  # the policy as the user named it ("": the config's model)
    trained_by: str | None  # the training run whose stored batches came before the policy (BLPO warm)

    def path(self, name: str) -> str:
        return str(self.ctx.path / name)


@dataclass(frozen=True)
class GroupsRef:
    episodes: str
    turns: str
    appo_episodes: str  # the groups and APPO's branches over them
    appo_turns: str

    def tables(self, appo: bool = False) -> tuple[pa.Table, pa.Table]:
        """(episodes, turns) of the groups, or with ``appo`` of the groups and APPO's branches."""
        episodes, turns = (self.appo_episodes, self.appo_turns) if appo else (self.episodes, self.turns)
        return store.read_table(episodes, "episodes"), store.read_table(turns, "turns")


def audited_policy(cfg: TrainConfig, source: str | None) -> CheckpointRef:
    """The policy ``source`` names: a run's checkpoint folder, a logged policy (``models:/``, ``runs:/``:
    downloaded once), or (as ``model.path``, which the caller set to it) a model folder or a pretrained model's
    name; None: the config's own model (the tiny model when ``model.path`` is unset)."""
    if source is not None and is_checkpoint(source):
        return checkpoint_ref(source)
    if source is not None and source.startswith(MODEL_URI_PREFIXES):
        return policy_from_store(cfg)
    return CheckpointRef(str(initial_model_dir(cfg, _suite(cfg))), 0)


@task(name="audit-start", cache_policy=NONE)
def start_audit(cfg: TrainConfig, audit: AuditConfig, source: str | None, name: str) -> AuditRef:
    """The audit's folder and MLflow run (``name`` in ``cfg.experiment``; found again by a rerun, which must
    have the same settings), its params (the config, the audit's settings) and what it audits."""
    policy = audited_policy(cfg, source)
    folder = Path(cfg.data_dir) / cfg.experiment / name
    settings = {"policy": source or "", "policy_path": policy.path, "policy_iteration": policy.iteration,
                "config": cfg.model_dump(mode="json"), "audit": audit.model_dump()}  # fmt: skip
    check_settings(folder, settings)
    c = mlflow_runs.client(mlflow_runs.tracking_uri(cfg.tracking_uri))
    tags = {"horizonrl.kind": "audit", "horizonrl.policy_uri": source or policy.path, "env": cfg.env.name,
            "seed": str(cfg.seed), "method": "audit"}  # fmt: skip
    run_id, resumed = mlflow_runs.find_or_create_run(c, cfg.experiment, name, tags)
    if not resumed:
        audit_params = {f"audit.{k}": str(v) for k, v in audit.model_dump().items()}
        mlflow_runs.log_params(
            c, run_id, {**run_params(cfg, _suite(cfg), policy.path), **audit_params, "audit.policy": source or ""}
        )
    trained_by = training_run(policy, c)
    ctx = RunContext(cfg.model_copy(update={"run_name": name}), str(folder), c.tracking_uri, run_id)
    return AuditRef(ctx, audit, policy, source or "", str(trained_by) if trained_by else None)


def check_settings(folder: Path, settings: dict) -> None:
    """Write the audit's settings into its folder, or, where an audit of this name stored other settings,
    refuse, naming the first that differs (a rerun resumes the same audit; another one needs another name)."""
    path = folder / SETTINGS_FILE
    if path.is_file():
        before = json.loads(path.read_text())
        changed = [k for k in settings if before.get(k) != json.loads(json.dumps(settings[k]))]
        if changed:
            raise ValueError(
                f"audit folder {folder} holds an audit with other settings ({changed[0]}: {before.get(changed[0])!r});"
                " give --name for a new audit, or move that folder away"
            )
        return
    write_json(settings, path)


@task(name="audit-play", retries=1, retry_delay_seconds=1, cache_policy=NONE)
def play_groups(ref: AuditRef) -> GroupsRef:
    """Step 1: ``audit.tasks`` tasks of the split, a group of ``rollout.group_size`` episodes each, played as
    training collects an iteration (the config's prompt, action mode, context and engine), then APPO's branches
    over them as an APPO run plays them. Stored once; a rerun reads them."""
    groups = GroupsRef(*(ref.path(f) for f in ("episodes.parquet", "turns.parquet", "appo-episodes.parquet",
                                                 "appo-turns.parquet")))  # fmt: skip
    if Path(groups.appo_episodes).is_file():
        return groups
    cfg, t0, cpu0 = ref.ctx.cfg, time.perf_counter(), time.process_time()
    player = owners(ref.ctx).player
    player.sync(ref.policy)
    size = cfg.env.train_pool if ref.audit.split == "train" else ref.audit.tasks
    tasks = sample_tasks(player.task_pool(ref.audit.split, size), ref.audit.tasks, derive_seed(cfg.seed, "audit"), 0)
    shard = split_shards(tasks, 1, cfg.rollout.group_size, derive_seed(cfg.seed, "audit", "play"))[0]
    records = player.play(shard)
    branches, _ = player.play_branches(records, derive_seed(cfg.seed, "audit", "branches"))
    check_complete(records + branches, "audit episodes")
    for rows, episodes, turns in ((records, groups.episodes, groups.turns),
                                  (records + branches, groups.appo_episodes, groups.appo_turns)):  # fmt: skip
        store.write_table(store.turns_table(rows, ref.policy.iteration), turns, "turns")
        store.write_table(store.episodes_table(rows, cfg.run_name, 0, ref.policy.iteration), episodes, "episodes")
    spent = {"play_s": time.perf_counter() - t0, "play_cpu_s": time.process_time() - cpu0}
    log_stage(ref.ctx, "time", spent, ref.policy.iteration)
    return groups


def open_audit_player(ref: AuditRef) -> None:
    """The audit's player, built as an evaluation's (``tasks.context.open_owners``), with APPO's branching
    settings (its preset and ``per_method.appo``): it plays the groups, APPO's branches over them and the
    continuations."""
    appo = {"method": "appo", "advantage_params": {}, "loss_params": {}}
    open_owners(ref.ctx.cfg.model_copy(update=appo), evaluation=True)


def _suite(cfg: TrainConfig) -> EnvSuite:
    """The suite ``cfg`` plays (the suite factory: what a run's params need, without a player)."""
    return make_suite(cfg.env.name, cfg.env.suite_seed, cfg.env.games, cfg.data_dir)


@task(name="audit-points", cache_policy=NONE)
def pick_points(ref: AuditRef, groups: GroupsRef) -> str:
    """Step 2: the decision points (``horizonrl.audit.points``), stored with their truth still empty."""
    path = ref.path("points.parquet")
    if not Path(path).is_file():
        frame = audit_points.candidates(
            store.read_table(groups.episodes, "episodes"), store.read_table(groups.turns, "turns")
        )
        seed = derive_seed(ref.ctx.cfg.seed, "audit", "points")
        picked = audit_points.pick_points(frame, ref.audit.points, ref.audit.anchor_share, seed)
        store.write_table(store.audit_table(truth.empty_truth(picked)), path, "audit")
    return path


@task(name="audit-truth", retries=1, retry_delay_seconds=1, cache_policy=NONE)
def monte_carlo_truth(ref: AuditRef, groups: GroupsRef, points_path: str) -> str:
    """Step 3: the continuations of every point, block by block (a block stored by an earlier try is read,
    not played again), and A_MC, its standard error and its two halves into the points table. Logs the seconds
    per point played (``audit/seconds_per_point``: the continuations' play, replays included)."""
    points = store.read_table(points_path, "audit").to_pandas()
    if len(points) and all(len(r) for r in points["v_returns"]):
        return points_path
    m, size = ref.audit.continuations, ref.audit.block_points
    parents = {r.rollout_id: r for r in store.records(*groups.tables())}
    blocks = [points.iloc[i : i + size] for i in range(0, len(points), size)]
    q, v, first, played, cost = [], [], 0, 0, Counter()
    for b, block in enumerate(blocks):
        plan = truth.plan(block, parents, m)
        episodes, block_cost = _block(ref, parents, plan, b, len(blocks), first)
        played, cost = played + len(block) * bool(block_cost), cost + block_cost
        q_b, v_b = truth.returns(block, parents, plan, episodes, m)
        q.append(q_b), v.append(v_b)
        first += len(plan)
    store.write_table(store.audit_table(truth.with_truth(points, q, v)), points_path, "audit")
    if played:  # what the continuations cost, per point played (the engine's token counts, where it keeps them)
        kinds = ("seconds", "cpu_seconds", "prefill_real", "decode_real")
        figures = {f"{k}_per_point": cost[k] / played for k in kinds if k in cost}
        log_stage(ref.ctx, "audit", {**figures, "continuations": float(first)}, ref.policy.iteration)
        log_stage(ref.ctx, "time", {"continuations_s": cost["seconds"]}, ref.policy.iteration)
    return points_path


def _block(ref: AuditRef, parents: dict, plan: list, b: int, n: int, first: int) -> tuple[pa.Table, Counter]:
    """A block's continuations' episodes table: stored by an earlier try (if it holds exactly these), else
    played now and stored (turns first: the episodes file marks the block complete); and what playing it cost
    (wall and this process's CPU seconds; the transformers engine's prefilled and decoded tokens; empty: read)."""
    cfg, t0, cpu0 = ref.ctx.cfg, time.perf_counter(), time.process_time()
    paths = [ref.ctx.path / "continuations" / f"block-{b:04d}-of-{n:04d}-{t}.parquet" for t in ("turns", "episodes")]
    if paths[1].is_file():
        stored = store.read_table(paths[1], "episodes")
        if truth.matches(stored, plan, parents, first):
            return stored, Counter()
    player = owners(ref.ctx).player
    player.sync(ref.policy)
    before = Counter(getattr(player.engine, "counts", {}))
    settings = replace(player.sampling, seed=derive_seed(cfg.seed, "audit", "block", b))
    records = truth.play_block(player.episodes(), parents, plan, player.engine, player.fmt, settings, first)
    check_complete(records, "continuations")  # a dead server's: never stored as returns; the retry restarts it
    store.write_table(store.turns_table(records, ref.policy.iteration), paths[0], "turns")
    table = store.episodes_table(records, cfg.run_name, 0, ref.policy.iteration)
    store.write_table(table, paths[1], "episodes")
    get_run_logger().info("audit block %d of %d: %d continuations played", b + 1, n, len(records))
    spent = Counter(seconds=time.perf_counter() - t0, cpu_seconds=time.process_time() - cpu0)
    return table, Counter(getattr(player.engine, "counts", {})) - before + spent


@task(name="audit-finish", cache_policy=NONE)
def finish_audit(ref: AuditRef, scores_path: str) -> dict:
    """Log the figures (``audit/<estimator>/<metric>`` with ``_low``, ``_high``, ``_n``; ``audit/noise_ceiling``),
    the scores and the figure as artifacts, and close the MLflow run FINISHED. Returns the scores."""
    summary = json.loads(Path(scores_path).read_text())
    ceiling = summary["noise_ceiling"]
    figures = {f"noise_ceiling{end}": ceiling[key] for end, key in _ENDS[:3]}
    figures.update(max_correlation=summary["max_correlation"], points=float(summary["points"]))
    for label, by_metric in summary["estimators"].items():
        for metric, e in by_metric.items():
            figures.update({f"{label}/{metric}{end}": e[key] for end, key in _ENDS})
    log_stage(ref.ctx, "audit", figures, ref.policy.iteration)
    c, picture = ref.ctx.mlflow(), page.figure(summary, ref.ctx.path / FIGURE_FILE)
    for path in (scores_path, picture):
        c.log_artifact(ref.ctx.mlflow_run_id, str(path), "audit")
    c.set_terminated(ref.ctx.mlflow_run_id, "FINISHED")
    return summary


_ENDS = (("", "value"), ("_low", "low"), ("_high", "high"), ("_n", "n"))


def end_failed_audit(flow: object, flow_run: FlowRun, state: State) -> None:
    """Audit flow hook (failure, crash): the environment workers stopped, and the audit's MLflow run marked
    FAILED with the cause (tag ``horizonrl.failure``); the same command resumes it."""
    params = flow_run.parameters
    try:
        cfg = TrainConfig.model_validate(params["config"], context={"read_files": False})
    except (ValueError, KeyError):
        return
    close_owners(Path(cfg.data_dir) / cfg.experiment / (params.get("name") or ""))
    c = mlflow_runs.client(mlflow_runs.tracking_uri(cfg.tracking_uri))
    run = mlflow_runs.find_run(c, cfg.experiment, params.get("name") or "")
    if run is not None and run.info.status == "RUNNING":
        mlflow_runs.set_tags(c, run.info.run_id, {mlflow_runs.FAILURE_TAG: (state.message or "")[:4000]})
        c.set_terminated(run.info.run_id, "FAILED")
