"""The player: plays a run's episodes with one engine in this process's environments.

Built once at the run's start (``horizonrl.run.owners``) from plain values: the suite, how its environments
step, the chat style, the sampling settings, the branching settings of a method that branches, and where its
vLLM server is (none: the transformers engine). It moves in two steps: ``sync(policy)`` at a version
boundary (the engine plays ``policy`` from then on), then ``play``/``play_branches`` straight into the
rollout loop. Its engine is the transformers engine over its ``weights``' model (the learner's in a
synchronous run, where an update moves the played weights in place), a vLLM engine that owns the run's
server, or one that plays on a server another process keeps in sync (``Serving``). The asynchronous
generator is a second player with its own weights on the transformers engine; on vLLM it holds none (a
sync is checked against the checkpoint's stored probe).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from horizonrl.engines.base import Engine
from horizonrl.engines.hf import TransformersEngine
from horizonrl.engines.vllm import VLLMEngine, VLLMLaunch, WeightSync
from horizonrl.envs import EnvSuite, Task
from horizonrl.envs.batch import EpisodeBatch
from horizonrl.models import lora
from horizonrl.models.loading import policy_tokenizer
from horizonrl.models.probe import Probe, probe_of, stored_probe
from horizonrl.rollout.branching import collect_branches, plan_branches
from horizonrl.rollout.loop import SamplingSettings, Shard, collect
from horizonrl.rollout.prompting import ChatFormat, ChatStyle
from horizonrl.rollout.records import EpisodeRecord
from horizonrl.run.learner import Weights
from horizonrl.training.checkpoint import CheckpointRef
from methods.appo import BranchingParams


@dataclass(frozen=True)
class Serving:
    """A vLLM server another process keeps in sync: where shards of a vLLM run on Ray send their requests,
    under which served name (the base, or the loaded LoRA adapter), for which checkpoint."""

    url: str
    model: str
    policy: str


@dataclass(frozen=True)
class Branching:
    """A branching method's settings (APPO): branches planned per task group, and how they are picked."""

    budget: int
    params: BranchingParams


class Player:
    """Plays the episodes of one run in this process; ``weights`` holds the model its transformers engine
    plays and the vLLM server's weights are verified against."""

    def __init__(
        self,
        weights: Weights,
        suite: EnvSuite,
        tier: str,
        environments: Callable[[], EpisodeBatch],
        chat: ChatStyle,
        sampling: SamplingSettings,
        branching: Branching | None = None,
        server: VLLMLaunch | None = None,
    ) -> None:
        """``environments`` starts where the episodes step (``rollout.env_workers`` worker processes, or this
        process), at the first episode; ``sampling``: the run's settings, each play with its own seed;
        ``server``: where the run's vLLM server is (None: the transformers engine plays)."""
        self.weights = weights
        self.suite = suite
        self.tier = tier
        self.sampling = sampling
        self._environments = environments
        self._chat = chat
        self._branching = branching
        self._launch = server
        self.fmt: ChatFormat | None = None  # read off the first checkpoint synced: a run's share one tokenizer
        self.engine: Engine | None = None  # what plays now, set by sync
        self._server: VLLMEngine | None = None  # owns the run's vLLM server: kept across checkpoints
        self._followed: tuple[str, VLLMEngine] | None = None  # (url, engine) of another process's server
        self._pools: dict[tuple[str, int], list[Task]] = {}
        self._episodes: EpisodeBatch | None = None

    @property
    def serves_vllm(self) -> bool:
        """Whether this player plays on a vLLM server (else the transformers engine)."""
        return self._launch is not None

    def task_pool(self, split: str, n: int) -> list[Task]:
        """The first ``n`` tasks of ``split`` at the run's tier (generated once per run)."""
        if (split, n) not in self._pools:
            self._pools[split, n] = self.suite.tasks(split, self.tier, n)
        return self._pools[split, n]

    def episodes(self) -> EpisodeBatch:
        """Where the run's episodes step: started at the first episode and kept warm until ``close`` (JVMs,
        loaded games)."""
        if self._episodes is None:
            self._episodes = self._environments()
        return self._episodes

    def close_episodes(self) -> None:
        """Stop the environment workers (and with them their JVMs or games)."""
        if self._episodes is not None:
            self._episodes.close()
            self._episodes = None

    def close(self) -> None:
        """The run ended: stop the environments and the vLLM server this player owns (a server another
        process owns goes on)."""
        self.close_episodes()
        for engine in (self._server, self._followed[1] if self._followed else None):
            if engine is not None:
                engine.close()
        self._server, self._followed, self.engine = None, None, None

    def chat_format(self, policy: CheckpointRef) -> ChatFormat:
        """The run's chat format, read off ``policy``'s tokenizer the first time (every checkpoint of a run has
        the same tokenizer)."""
        if self.fmt is None:
            self.fmt = self._chat.format(policy_tokenizer(policy.path))
        return self.fmt

    def sync(self, policy: CheckpointRef, serving: Serving | None = None) -> WeightSync | None:
        """From now on play ``policy`` (a version boundary: no episode is in flight): the transformers engine
        over the weights of ``policy``, the owned vLLM server synced to it, or, given ``serving``, the
        server another process synced. Returns how the owned server's weights moved
        (``engines.vllm.WeightSync``), None when they did not."""
        fmt = self.chat_format(policy)
        if serving is not None:
            self.engine = self._follow(policy, serving)
            return None
        if self._launch is not None:
            return self._serve(policy)
        if isinstance(self.engine, TransformersEngine) and not self.weights.holds(policy):
            self.engine = None  # it holds the version played so far: let that go before the next one loads
        model = self.weights.get(policy).model
        if not isinstance(self.engine, TransformersEngine) or self.engine.model is not model:
            device = str(self.weights.device)
            self.engine = TransformersEngine(model, fmt.tokenizer.pad_token_id, list(fmt.stop_ids), device)
        return None

    def serving(self) -> Serving:
        """Where other processes find the server this player owns and synced, and what it serves."""
        return Serving(self.engine.client.base_url, self.engine.model, self.engine.policy_path)

    def play(self, shard: Shard, greedy: bool = False) -> list[EpisodeRecord]:
        """``shard.group_size`` episodes of each of the shard's tasks, numbered from the shard's first ids and
        sampled with its seed."""
        settings = replace(self.sampling, seed=shard.seed, greedy=greedy)
        return collect(
            self.episodes(),
            shard.tasks,
            shard.group_size,
            self.engine,
            self.fmt,
            settings,
            first_rollout_id=shard.first_rollout_id,
            first_group_id=shard.first_group_id,
        )

    def play_branches(self, records: list[EpisodeRecord], seed: int) -> tuple[list[EpisodeRecord], dict[str, float]]:
        """A branching method's branches (APPO), planned over the iteration's initial rollouts and played in
        one batch, sampled with ``seed`` (the iteration's); with the planner's figures."""
        b = self._branching
        starts, _, stats = plan_branches(records, b.budget, b.params, self.fmt.tokenizer)
        settings = replace(self.sampling, seed=seed)
        first = len(records)
        return collect_branches(self.episodes(), starts, self.engine, self.fmt, settings, first_rollout_id=first), stats

    def _serve(self, policy: CheckpointRef) -> WeightSync | None:
        """The owned vLLM server (started on first use; started again if it died), synced to ``policy`` and
        verified against its weights' probe log-probs."""
        if self._server is None:
            self._server = self._launch.engine(policy.path, list(self.fmt.stop_ids))
        engine = self.engine = self._server
        if not engine.alive():  # died (its episodes ended as errors): start again
            engine.restart()
        before = engine.last_sync
        if policy.path == engine.policy_path or lora.is_adapter_dir(policy.path):
            engine.sync(policy.path)
        else:
            engine.sync(policy.path, self._probe(policy))
        return engine.last_sync if engine.last_sync is not before else None

    def _probe(self, policy: CheckpointRef) -> Probe:
        """The probe ``policy``'s weights were written with; for a folder without one (a model folder, an older
        checkpoint), computed from the weights held here when they are ``policy``'s, else from a copy loaded
        for the call and dropped: a player that only serves keeps no model in memory."""
        stored = stored_probe(policy.path)
        if stored is not None:
            return stored
        if self.weights.holds(policy):
            model = self.weights.current.model
        else:
            model = self.weights.load(policy.path)[0].to(self.weights.device)
        return probe_of(model, model.get_input_embeddings().num_embeddings)

    def _follow(self, policy: CheckpointRef, serving: Serving) -> VLLMEngine:
        """An engine that plays on ``serving`` and never syncs it (its owner does): no weights loaded here."""
        if serving.policy != policy.path:
            raise ValueError(f"the shared server serves {serving.policy}, not the checkpoint to play, {policy.path}")
        if self._followed is None or self._followed[0] != serving.url:
            reached = self._launch.reaching(serving.url).engine(policy.path, list(self.fmt.stop_ids))
            self._followed = (serving.url, reached)
        engine = self._followed[1]
        engine.model, engine.policy_path = serving.model, serving.policy  # what the owner serves now
        return engine

    def __reduce__(self) -> tuple:
        raise TypeError("a player never travels: a worker process builds its own (tasks.context.shard_player)")
