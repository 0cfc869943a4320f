"""The per-process holder of heavy objects: policy model, tokenizer, optimizer, engine, env suite.

Tasks pass checkpoint references; the holder loads a checkpoint only when the model in memory is not
already that checkpoint (after an update it is), so weights move trainer -> engine in memory and to disk
once per iteration.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from horizonrl.config import MODEL_URI_PREFIXES, RayConfig, TrainConfig
from horizonrl.engines.base import Engine
from horizonrl.engines.hf import TransformersEngine
from horizonrl.envs import EnvSuite, corpus_digest, make_suite, suite_corpus, suite_ref
from horizonrl.envs.batch import EpisodeBatch, InProcess
from horizonrl.envs.pool import EnvPool
from horizonrl.models import lora
from horizonrl.models.loading import (
    initial_adapter_dir,
    load_policy,
    policy_tokenizer,
    resolve_device,
    resolve_dtype,
    tiny_model_dir,
)
from horizonrl.rollout.branching import collect_branches, plan_branches
from horizonrl.rollout.loop import SamplingSettings, Shard, collect, split_shards
from horizonrl.rollout.prompting import ChatFormat
from horizonrl.rollout.records import EpisodeRecord
from horizonrl.seeding import derive_seed
from horizonrl.tracking import mlflow_runs
from horizonrl.training.checkpoint import CheckpointRef, checkpoint_dir, load_optimizer_state, read_state
from horizonrl.training.parallel import update_backend
from horizonrl.training.rank_group import RankGroup
from horizonrl.training.ray_ranks import RayRankGroup


@dataclass
class Loaded:
    ref: CheckpointRef
    model: torch.nn.Module
    tokenizer: object
    fmt: ChatFormat
    engine: Engine
    optimizer: torch.optim.Optimizer
    cfg: TrainConfig | None = None  # the run's config (where to publish a new checkpoint: engine, MLflow)


@dataclass(frozen=True)
class Serving:
    """A vLLM server another process keeps in sync: where shards of a vLLM run on Ray send their requests,
    under which served name (the base, or the loaded LoRA adapter), for which checkpoint."""

    url: str
    model: str
    policy: str


class PolicyRuntime:
    """Holds at most one loaded policy (and its optimizer) per process."""

    def __init__(self, generator: bool = False) -> None:
        """``generator``: the holder that plays asynchronous rollouts (``rollout.max_staleness`` >= 1); in such
        a run it alone owns the vLLM server (``serves``)."""
        self.generator = generator
        self.current: Loaded | None = None
        self._suites: dict[tuple[str, int, str | None], EnvSuite] = {}
        self._pools: dict[tuple, list] = {}
        self._reference: torch.nn.Module | None = None
        self._vllm = None  # VLLMEngine: one server per process, kept across checkpoints (reloaded, not restarted)
        self._episodes: tuple[tuple, EpisodeBatch] | None = None
        self._ray: RayConfig | None = None  # the Ray cluster this process joined (rollout.runner: ray)
        self._following: tuple[str, ChatFormat, Engine] | None = None  # (url, ...): playing on a shared server
        self._written: tuple[CheckpointRef, torch.nn.Module, object] | None = None  # see keep()

    def suite(self, cfg: TrainConfig) -> EnvSuite:
        key = (cfg.env.name, cfg.env.suite_seed, cfg.env.games)
        if key not in self._suites:
            self._suites[key] = make_suite(*key, data_dir=cfg.data_dir)
        return self._suites[key]

    def episodes(self, cfg: TrainConfig) -> EpisodeBatch:
        """Where the run's episodes step: ``rollout.env_workers`` worker processes, started once and kept
        warm across iterations (JVMs, loaded games), or this process when it is 0."""
        r = cfg.rollout
        key = (cfg.env.name, cfg.env.suite_seed, cfg.env.games, r.env_workers, r.step_timeout_s)
        if self._episodes is None or self._episodes[0] != key:
            self.close_episodes()
            suite = self.suite(cfg)
            ref = suite_ref(cfg.env.name, cfg.env.games, cfg.data_dir)
            batch = (
                EnvPool(ref, cfg.env.suite_seed, r.env_workers, step_timeout_s=r.step_timeout_s)
                if r.env_workers
                else InProcess(suite)
            )
            self._episodes = (key, batch)
        return self._episodes[1]

    def close_episodes(self) -> None:
        """Stop the environment workers (and with them their JVMs or games)."""
        if self._episodes is not None:
            self._episodes[1].close()
            self._episodes = None

    def ray_cluster(self, cfg: TrainConfig) -> None:
        """Join the run's Ray cluster once and stay, like the environment workers: ``ray.address``, or a
        new local cluster bound to 127.0.0.1 (``address="local"``, so a ``RAY_ADDRESS`` in the environment
        cannot redirect it), without the dashboard's modules (its API server stays, on 127.0.0.1)."""
        if self._ray == cfg.ray:
            return
        self.close_ray()
        import ray  # the optional "ray" extra

        if cfg.ray.address is not None:
            ray.init(address=cfg.ray.address, namespace="horizonrl")
        else:
            ray.init(
                address="local",
                num_cpus=cfg.ray.num_cpus,
                object_store_memory=cfg.ray.object_store_mb * 2**20,
                include_dashboard=False,
                _node_ip_address="127.0.0.1",
                namespace="horizonrl",
            )
        self._ray = cfg.ray

    def close_ray(self) -> None:
        """Leave the Ray cluster: a local one stops with all its processes (workers, raylet, GCS); a
        cluster given by address keeps running."""
        if self._ray is not None:
            import ray

            ray.shutdown()
            self._ray = None

    def task_pool(self, cfg: TrainConfig, split: str, n: int) -> list:
        """The first ``n`` tasks of ``split`` at the configured tier (generated once per process)."""
        key = (cfg.env.name, cfg.env.suite_seed, cfg.env.games, split, cfg.env.tier, n)
        if key not in self._pools:
            self._pools[key] = self.suite(cfg).tasks(split, cfg.env.tier, n)
        return self._pools[key]

    def iteration_shards(self, cfg: TrainConfig, iteration: int) -> list[Shard]:
        """The iteration's tasks, fixed by (seed, iteration), in ``rollout.shards`` fixed shards: group and
        rollout ids and one sampling seed per shard, so the records do not depend on where shards play."""
        tasks = sample_tasks(
            self.task_pool(cfg, "train", cfg.env.train_pool), cfg.rollout.tasks_per_iteration, cfg.seed, iteration
        )
        return split_shards(tasks, cfg.rollout.shards, cfg.rollout.group_size, _collect_seed(cfg, iteration))

    def play_shard(
        self, cfg: TrainConfig, policy: CheckpointRef, shard: Shard, serving: Serving | None = None
    ) -> list[EpisodeRecord]:
        """K rollouts of the shard's tasks with this process's environments, and this process's policy or,
        given ``serving``, the vLLM server the run's process synced to ``policy`` (Ray shards share it)."""
        fmt, engine = self._follow(cfg, policy, serving) if serving is not None else self._playing(cfg, policy)
        settings = SamplingSettings.from_config(cfg, self.suite(cfg), shard.seed)
        return collect(
            self.episodes(cfg),
            shard.tasks,
            cfg.rollout.group_size,
            engine,
            fmt,
            settings,
            first_rollout_id=shard.first_rollout_id,
            first_group_id=shard.first_group_id,
        )

    def _playing(self, cfg: TrainConfig, policy: CheckpointRef) -> tuple[ChatFormat, Engine]:
        loaded = self.get(cfg, policy)
        return loaded.fmt, loaded.engine

    def serving(self, cfg: TrainConfig, policy: CheckpointRef) -> Serving:
        """This process's vLLM server synced to ``policy`` (started on first use, verified by the probe),
        and where other processes find it."""
        engine = self.get(cfg, policy).engine
        return Serving(engine.client.base_url, engine.model, policy.path)

    def _follow(self, cfg: TrainConfig, policy: CheckpointRef, serving: Serving) -> tuple[ChatFormat, Engine]:
        """The format and an engine that plays on ``serving`` and never syncs it (its owner does): the
        checkpoint's tokenizer only, no weights loaded here."""
        from horizonrl.engines.vllm import engine_from_config

        if serving.policy != policy.path:
            raise ValueError(f"the shared server serves {serving.policy}, not the checkpoint to play, {policy.path}")
        if self._following is None or self._following[0] != serving.url:
            fmt = self._chat_format(cfg, policy_tokenizer(policy.path))
            v = cfg.engine.vllm.model_copy(update={"url": serving.url})
            reached = cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"vllm": v})})
            self._following = (serving.url, fmt, engine_from_config(reached, policy.path, list(fmt.stop_ids)))
        _, fmt, engine = self._following
        engine.model, engine.policy_path = serving.model, serving.policy  # what the owner serves now
        return fmt, engine

    def _chat_format(self, cfg: TrainConfig, tokenizer: object) -> ChatFormat:
        r = cfg.rollout
        return ChatFormat.for_tokenizer(
            tokenizer,
            enable_thinking=r.enable_thinking,
            free_format=r.free_format,
            format_penalty=r.format_penalty,
            prompt=r.prompt,
        )

    def play_branches(
        self, cfg: TrainConfig, policy: CheckpointRef, records: list[EpisodeRecord], iteration: int
    ) -> tuple[list[EpisodeRecord], dict[str, float]]:
        """A branching method's branches (APPO), planned over the iteration's initial rollouts and played in
        one batch in this process; with the planner's figures."""
        loaded, envs = self.get(cfg, policy), self.episodes(cfg)
        budget = cfg.rollout.branch_budget or cfg.rollout.group_size
        starts, _, stats = plan_branches(records, budget, cfg.branching(), loaded.tokenizer)
        settings = SamplingSettings.from_config(cfg, self.suite(cfg), _collect_seed(cfg, iteration))
        return collect_branches(envs, starts, loaded.engine, loaded.fmt, settings, first_rollout_id=len(records)), stats

    def initial_model_dir(self, cfg: TrainConfig) -> Path:
        """The starting weights: ``model.path`` (a directory, hub id, or ``models:/<name>/<version>`` or
        ``runs:/<run id>`` from the MLflow store) or the tiny model built for this environment; with
        ``model.lora``, a directory of fresh adapters over that base."""
        if cfg.model.path is not None and cfg.model.path.startswith(MODEL_URI_PREFIXES):  # a logged policy
            base = Path(policy_from_store(cfg).path)
        elif cfg.model.path is not None:
            base = Path(cfg.model.path)
        else:
            corpus = functools.partial(suite_corpus, self.suite(cfg), cfg.env.tier)  # played only when needed
            digest = None
            if cfg.model.tokenizer == "word":
                models = Path(cfg.data_dir) / "models"
                digest = corpus_digest(cfg.env.name, cfg.env.tier, cfg.env.suite_seed, corpus, models)
            base = tiny_model_dir(cfg.data_dir, cfg.env.name, cfg.model, corpus, corpus_sha256=digest)
        if cfg.model.lora is not None:  # fresh adapters over the base; checkpoints then hold adapters only
            return initial_adapter_dir(cfg.data_dir, base, cfg.model.lora, cfg.model.init_seed)
        return base

    def get(self, cfg: TrainConfig, ref: CheckpointRef) -> Loaded:
        if self._vllm is not None and not self._vllm.alive():  # died (its episodes ended as errors): start again
            self._vllm.restart()
        if self.current is not None and self.current.ref == ref:
            return self.current
        torch.set_num_threads(max(1, torch.get_num_threads()))
        device = resolve_device(cfg.model.device)
        written, self._written = self._written, None
        model, tokenizer = written[1:] if written is not None and written[0] == ref else self.load(cfg, ref.path)
        model.to(device)
        fmt = self._chat_format(cfg, tokenizer)
        end_ids = list(fmt.stop_ids)
        engine = (
            self._vllm_engine(cfg, ref, end_ids, model)
            if self.serves(cfg)
            else TransformersEngine(model, tokenizer.pad_token_id, end_ids, str(device))
        )
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.update.lr, weight_decay=cfg.update.weight_decay)
        load_optimizer_state(ref, optimizer)
        self.current = Loaded(ref, model, tokenizer, fmt, engine, optimizer, cfg)
        return self.current

    def serves(self, cfg: TrainConfig) -> bool:
        """This holder plays on the run's vLLM server and syncs it. In an asynchronous run only the generator
        does, at version boundaries (before a collect plays, docs/algorithms.md §1.10), so an update never
        moves the served weights under an episode being played; the learner's holder only trains."""
        return cfg.engine.name == "vllm" and (self.generator or not cfg.rollout.max_staleness)

    def _vllm_engine(self, cfg: TrainConfig, ref: CheckpointRef, end_ids: list[int], model: torch.nn.Module):
        """The process's vLLM engine (server started on first use), serving checkpoint ``ref`` (``model``'s
        weights, which verify the sync)."""
        from horizonrl.engines.vllm import engine_from_config

        if self._vllm is None:
            self._vllm = engine_from_config(cfg, ref.path, end_ids)
        self._sync_vllm(ref, model)
        return self._vllm

    def _sync_vllm(self, ref: CheckpointRef, model: torch.nn.Module) -> None:
        """Serve ``ref`` on the vLLM server, verified against the learner ``model``'s probe log-probs."""
        from horizonrl.engines.vllm import probe_of

        if ref.path == self._vllm.policy_path or lora.is_adapter_dir(ref.path):
            self._vllm.sync(ref.path)
            return
        training = model.training
        model.eval()  # the probe is a forward pass as in sampling: dropout (if any) off
        try:
            probe = probe_of(model, model.get_input_embeddings().num_embeddings)
        finally:
            model.train(training)
        self._vllm.sync(ref.path, probe)

    @property
    def weight_sync(self):
        """How the last checkpoint reached the vLLM server (``engines.vllm.WeightSync``); None without one."""
        return None if self._vllm is None else self._vllm.last_sync

    def reference(self, cfg: TrainConfig, run_dir: Path) -> torch.nn.Module:
        """The frozen initial policy (checkpoint 0) for KL-to-reference losses; loaded once."""
        if self._reference is None:
            device = resolve_device(cfg.model.device)
            model, _ = load_policy(
                checkpoint_dir(run_dir, 0), resolve_dtype(cfg.model.dtype, device), cfg.model.attn_implementation
            )
            self._reference = model.to(device).eval().requires_grad_(False)
        return self._reference

    def advance(self, ref: CheckpointRef) -> None:
        """The in-memory model now is checkpoint ``ref`` (just saved by the update)."""
        if self.current is not None:
            self.current.ref = ref
            self._publish(ref)

    def _publish(self, ref: CheckpointRef) -> None:
        """A new checkpoint exists: a vLLM engine loads it (adapter hot-load or weight reload) and a LoRA
        run logs the adapter to MLflow. The transformers engine shares the updated model: nothing to do."""
        cfg = self.current.cfg
        if self._vllm is not None and cfg is not None and self.serves(cfg):
            self._sync_vllm(ref, self.current.model)
        if cfg is not None and lora.is_adapter_dir(ref.path):
            mlflow_runs.log_adapter(
                mlflow_runs.client(mlflow_runs.tracking_uri(cfg.tracking_uri)),
                read_state(ref)["mlflow_run_id"],
                ref.path,
                ref.iteration,
            )

    def __reduce__(self) -> tuple:
        """A holder never travels: pickled (Ray ships a task's globals with it, and Prefect's context with
        the flow's) it arrives empty, so a worker fills its own instead of receiving this process's model,
        optimizer and environments."""
        return (PolicyRuntime, ())

    def update_ranks(self, cfg: TrainConfig, run_dir: Path) -> RankGroup | RayRankGroup:
        """The run's update ranks (``update.world_size`` > 1): started on first use, kept across iterations;
        a group that died is replaced. gloo on the CPU, nccl when the policy's device is CUDA; torchrun
        processes of this machine, or Ray actors on the run's cluster (``update.launcher``)."""
        group = getattr(self, "_ranks", None)
        kind = RayRankGroup if cfg.update.launcher == "ray" else RankGroup
        if group is not None and (
            not group.alive or group.world_size != cfg.update.world_size or not isinstance(group, kind)
        ):
            self.close_update_ranks()
            group = None
        if group is None:
            backend = update_backend(cfg.model.device)
            if kind is RayRankGroup:
                self.ray_cluster(cfg)
                group = self._ranks = RayRankGroup(cfg.update.world_size, backend)
            else:
                group = self._ranks = RankGroup(run_dir, cfg.update.world_size, backend)
        return group

    def close_update_ranks(self) -> None:
        """Stop the update ranks, if any (with the run, or after a failed update)."""
        group = getattr(self, "_ranks", None)
        if group is not None:
            group.stop()
            self._ranks = None

    def load(self, cfg: TrainConfig, path: str | Path) -> tuple[torch.nn.Module, object]:
        """The policy at ``path`` (model, tokenizer) as this run holds it: ``model.dtype`` for the run's device,
        its attention implementation; on the CPU (``get`` moves it)."""
        dtype = resolve_dtype(cfg.model.dtype, resolve_device(cfg.model.device))
        return load_policy(path, dtype, cfg.model.attn_implementation)

    def keep(self, ref: CheckpointRef, model: torch.nn.Module, tokenizer: object) -> None:
        """``model`` and ``tokenizer``, just written as checkpoint ``ref`` (``load``ed, unchanged since): the next
        ``get`` of ``ref`` takes them instead of reading the checkpoint back, so a run's start loads its
        initial policy once (a real model's weights: seconds to minutes); its engine is built there, as for
        any checkpoint."""
        self.current = None
        self._written = (ref, model, tokenizer)

    def drop(self) -> None:
        self.current = None
        self._written = None


def policy_from_store(cfg: TrainConfig) -> CheckpointRef:
    """The checkpoint of ``model.path`` = ``models:/<name>/<version>`` or ``runs:/<run id>``, downloaded
    once under ``<data_dir>/policies``."""
    c = mlflow_runs.client(mlflow_runs.tracking_uri(cfg.tracking_uri))
    _, model_uri = mlflow_runs.resolve_policy(c, cfg.model.path)
    return mlflow_runs.download_policy(model_uri, Path(cfg.data_dir) / "policies")


def _collect_seed(cfg: TrainConfig, iteration: int) -> int:
    return derive_seed(cfg.seed, "collect", iteration)


def sample_tasks(pool: list, n: int, seed: int, iteration: int) -> list:
    """The iteration's tasks: ``n`` distinct tasks of ``pool``, fixed by (seed, iteration)."""
    rng = random.Random(derive_seed(seed, "tasks", iteration))
    return rng.sample(pool, min(n, len(pool)))
