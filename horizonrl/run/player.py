"""The player: plays a run's episodes with one engine in this process's environments.

A player holds the environment host and task pools, one chat format and one engine, and moves in two
steps: ``sync(cfg, policy)`` at a version boundary (the engine plays ``policy`` from then on), then
``play``/``play_branches`` straight into the rollout loop. Its engine is the transformers engine over its
``weights``' model (the learner's in a synchronous run, where an update moves the played weights in
place), a vLLM engine that owns the process's server, or one that plays on a server another process
keeps in sync (``Serving``). The asynchronous generator is a second player with its own weights on the
transformers engine; on vLLM it holds none (a sync is checked against the checkpoint's stored probe).
"""

from __future__ import annotations

from dataclasses import dataclass

from horizonrl.config import TrainConfig
from horizonrl.engines.base import Engine
from horizonrl.engines.hf import TransformersEngine
from horizonrl.engines.vllm import VLLMEngine, WeightSync, engine_from_config
from horizonrl.envs import EnvSuite, make_suite, suite_ref
from horizonrl.envs.batch import EpisodeBatch, InProcess
from horizonrl.envs.pool import EnvPool
from horizonrl.models import lora
from horizonrl.models.loading import policy_tokenizer, resolve_device
from horizonrl.models.probe import Probe, probe_of, stored_probe
from horizonrl.rollout.branching import collect_branches, plan_branches
from horizonrl.rollout.loop import SamplingSettings, Shard, collect, collect_seed
from horizonrl.rollout.prompting import ChatFormat
from horizonrl.rollout.records import EpisodeRecord
from horizonrl.run.learner import Learner
from horizonrl.training.checkpoint import CheckpointRef


@dataclass(frozen=True)
class Serving:
    """A vLLM server another process keeps in sync: where shards of a vLLM run on Ray send their requests,
    under which served name (the base, or the loaded LoRA adapter), for which checkpoint."""

    url: str
    model: str
    policy: str


class Player:
    """Plays episodes for the runs of this process; ``weights`` holds the model its transformers engine plays
    and the vLLM server's weights are verified against."""

    def __init__(self, weights: Learner) -> None:
        self.weights = weights
        self.fmt: ChatFormat | None = None
        self.engine: Engine | None = None  # what plays now, set by sync
        self._format_for: str | None = None  # the config digest fmt was built for
        self._server: VLLMEngine | None = None  # owns the process's vLLM server: kept across checkpoints and runs
        self._followed: tuple[str, VLLMEngine] | None = None  # (url, engine) of another process's server
        self._suites: dict[tuple[str, int, str | None], EnvSuite] = {}
        self._pools: dict[tuple, list] = {}
        self._episodes: tuple[tuple, EpisodeBatch] | None = None

    def suite(self, cfg: TrainConfig) -> EnvSuite:
        key = (cfg.env.name, cfg.env.suite_seed, cfg.env.games)
        if key not in self._suites:
            self._suites[key] = make_suite(*key, data_dir=cfg.data_dir)
        return self._suites[key]

    def task_pool(self, cfg: TrainConfig, split: str, n: int) -> list:
        """The first ``n`` tasks of ``split`` at the configured tier (generated once per process)."""
        key = (cfg.env.name, cfg.env.suite_seed, cfg.env.games, split, cfg.env.tier, n)
        if key not in self._pools:
            self._pools[key] = self.suite(cfg).tasks(split, cfg.env.tier, n)
        return self._pools[key]

    def episodes(self, cfg: TrainConfig) -> EpisodeBatch:
        """Where the run's episodes step: ``rollout.env_workers`` worker processes, started once and kept
        warm across iterations (JVMs, loaded games), or this process when it is 0."""
        r = cfg.rollout
        key = (cfg.env.name, cfg.env.suite_seed, cfg.env.games, r.env_workers, r.step_timeout_s)
        if self._episodes is None or self._episodes[0] != key:
            self.close_episodes()
            ref = suite_ref(cfg.env.name, cfg.env.games, cfg.data_dir)
            batch = (
                EnvPool(ref, cfg.env.suite_seed, r.env_workers, step_timeout_s=r.step_timeout_s)
                if r.env_workers
                else InProcess(self.suite(cfg))
            )
            self._episodes = (key, batch)
        return self._episodes[1]

    def close_episodes(self) -> None:
        """Stop the environment workers (and with them their JVMs or games)."""
        if self._episodes is not None:
            self._episodes[1].close()
            self._episodes = None

    def sync(self, cfg: TrainConfig, policy: CheckpointRef, serving: Serving | None = None) -> WeightSync | None:
        """From now on play ``policy`` (a version boundary: no episode is in flight): the transformers engine
        over the weights of ``policy``, the owned vLLM server synced to it, or, given ``serving``, the
        server another process synced. Returns how the owned server's weights moved
        (``engines.vllm.WeightSync``), None when they did not."""
        self.format(cfg, policy)
        if serving is not None:
            self.engine = self._follow(cfg, policy, serving)
            return None
        if cfg.engine.name == "vllm":
            return self._serve(cfg, policy)
        if isinstance(self.engine, TransformersEngine) and not self.weights.holds(policy):
            self.engine = None  # it holds the version played so far: let that go before the next one loads
        model = self.weights.get(cfg, policy).model
        if not isinstance(self.engine, TransformersEngine) or self.engine.model is not model:
            device = str(resolve_device(cfg.model.device))
            self.engine = TransformersEngine(model, self.fmt.tokenizer.pad_token_id, list(self.fmt.stop_ids), device)
        return None

    def format(self, cfg: TrainConfig, policy: CheckpointRef) -> ChatFormat:
        """The run's chat format, read off ``policy``'s tokenizer once per config (every checkpoint of a run
        has the same tokenizer)."""
        if self.fmt is None or self._format_for != cfg.digest():
            r = cfg.rollout
            self.fmt = ChatFormat.for_tokenizer(
                policy_tokenizer(policy.path),
                enable_thinking=r.enable_thinking,
                free_format=r.free_format,
                format_penalty=r.format_penalty,
                prompt=r.prompt,
            )
            self._format_for, self.engine = cfg.digest(), None  # the engine stops on the format's ids
        return self.fmt

    def serving(self) -> Serving:
        """Where other processes find the server this player owns and synced, and what it serves."""
        return Serving(self.engine.client.base_url, self.engine.model, self.engine.policy_path)

    def play(self, cfg: TrainConfig, shard: Shard, group_size: int, greedy: bool = False) -> list[EpisodeRecord]:
        """``group_size`` episodes of each of the shard's tasks, numbered from the shard's first ids and
        sampled with its seed."""
        settings = SamplingSettings.from_config(cfg, self.suite(cfg), shard.seed, greedy)
        return collect(
            self.episodes(cfg),
            shard.tasks,
            group_size,
            self.engine,
            self.fmt,
            settings,
            first_rollout_id=shard.first_rollout_id,
            first_group_id=shard.first_group_id,
        )

    def play_branches(
        self, cfg: TrainConfig, records: list[EpisodeRecord], iteration: int
    ) -> tuple[list[EpisodeRecord], dict[str, float]]:
        """A branching method's branches (APPO), planned over the iteration's initial rollouts and played in
        one batch; with the planner's figures."""
        budget = cfg.rollout.branch_budget or cfg.rollout.group_size
        starts, _, stats = plan_branches(records, budget, cfg.branching(), self.fmt.tokenizer)
        settings = SamplingSettings.from_config(cfg, self.suite(cfg), collect_seed(cfg, iteration))
        envs = self.episodes(cfg)
        return collect_branches(envs, starts, self.engine, self.fmt, settings, first_rollout_id=len(records)), stats

    def _serve(self, cfg: TrainConfig, policy: CheckpointRef) -> WeightSync | None:
        """The owned vLLM server (started on first use; started again if it died), synced to ``policy`` and
        verified against its weights' probe log-probs."""
        if self._server is None:
            self._server = engine_from_config(cfg, policy.path, list(self.fmt.stop_ids))
        engine = self.engine = self._server
        if not engine.alive():  # died (its episodes ended as errors): start again
            engine.restart()
        before = engine.last_sync
        if policy.path == engine.policy_path or lora.is_adapter_dir(policy.path):
            engine.sync(policy.path)
        else:
            engine.sync(policy.path, self._probe(cfg, policy))
        return engine.last_sync if engine.last_sync is not before else None

    def _probe(self, cfg: TrainConfig, policy: CheckpointRef) -> Probe:
        """The probe ``policy``'s weights were written with; for a folder without one (a model folder, an older
        checkpoint), computed from the weights held here when they are ``policy``'s, else from a copy loaded
        for the call and dropped: a player that only serves keeps no model in memory."""
        stored = stored_probe(policy.path)
        if stored is not None:
            return stored
        if self.weights.holds(policy):
            model = self.weights.current.model
        else:
            model = self.weights.load(cfg, policy.path)[0].to(resolve_device(cfg.model.device))
        return probe_of(model, model.get_input_embeddings().num_embeddings)

    def _follow(self, cfg: TrainConfig, policy: CheckpointRef, serving: Serving) -> VLLMEngine:
        """An engine that plays on ``serving`` and never syncs it (its owner does): no weights loaded here."""
        if serving.policy != policy.path:
            raise ValueError(f"the shared server serves {serving.policy}, not the checkpoint to play, {policy.path}")
        if self._followed is None or self._followed[0] != serving.url:
            v = cfg.engine.vllm.model_copy(update={"url": serving.url})
            reached = cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"vllm": v})})
            self._followed = (serving.url, engine_from_config(reached, policy.path, list(self.fmt.stop_ids)))
        engine = self._followed[1]
        engine.model, engine.policy_path = serving.model, serving.policy  # what the owner serves now
        return engine

    def __reduce__(self) -> tuple:
        """A player never travels: pickled it arrives empty (with an empty learner), so a Ray worker plays
        with its own engine and environments."""
        return (Player, (Learner(),))
