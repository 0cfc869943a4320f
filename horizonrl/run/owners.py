"""The construction point: a run's owners, built once from its config at its start.

This is the one place below the flows and tasks that reads the whole config (besides the preflight and the
config history). It builds, from each owner's own section or plain values:

- the learner (``Learner``: the policy being trained, its optimizer, the frozen reference, the update's plan);
- the player (``Player``: the suite, its task pools, where the episodes step, the chat style, the sampling
  and branching settings, the engine or the vLLM server), which plays the learner's weights;
- the generator, where rollouts are asynchronous (``rollout.max_staleness`` >= 1): a second player with its
  own weights, which plays the collects beside the update (docs/algorithms.md §1.10);
- the cluster (``Cluster``), where the run uses Ray.

From then on the owners take no config: ``player.sync(policy)``, ``player.play(shard)``,
``learner.update(...)``. An evaluation builds a player of its own (``build_evaluation``), a Ray worker the
player of its shards (``build_player``); neither builds a learner.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from horizonrl.config import TrainConfig, run_dir
from horizonrl.engines.vllm import VLLMLaunch
from horizonrl.envs import EnvSuite, make_suite, suite_ref
from horizonrl.envs.batch import InProcess
from horizonrl.envs.pool import EnvPool
from horizonrl.rollout.loop import SamplingSettings, turn_horizon
from horizonrl.rollout.prompting import ChatStyle
from horizonrl.run.cluster import Cluster
from horizonrl.run.learner import Learner, Weights
from horizonrl.run.player import Branching, Player
from horizonrl.training.iteration import UpdatePlan


@dataclass
class Owners:
    """One run's owners in this process. ``learner`` is None for an evaluation, ``generator`` for a run
    whose rollouts are synchronous, ``cluster`` for a run without Ray."""

    player: Player  # plays the learner's weights
    learner: Learner | None = None
    generator: Player | None = None
    cluster: Cluster | None = None

    @property
    def suite(self) -> EnvSuite:
        return self.player.suite

    @property
    def collector(self) -> Player:
        """Who plays the training rollouts: the learner's player, or with asynchronous rollouts the generator."""
        return self.generator or self.player

    @property
    def evaluator(self) -> Player:
        """Who plays the evaluations: the learner's player, or in an asynchronous vLLM run the generator,
        which owns the run's one server (the train flow lets the collects in flight end first)."""
        owns_server = self.generator is not None and self.generator.serves_vllm
        return self.generator if owns_server else self.player

    def close(self) -> None:
        """The run ended: stop the environment workers, the vLLM server, the update ranks and the Ray
        cluster's membership, and let go of the weights."""
        for player in (self.player, self.generator):
            if player is not None:
                player.close()
                player.weights.drop()
        if self.learner is not None:
            self.learner.close()
        if self.cluster is not None:
            self.cluster.leave()


def build_run(cfg: TrainConfig) -> Owners:
    """A train or warm-start run's owners (the cluster not yet joined: ``Cluster.join``)."""
    player = build_player(cfg, Weights(cfg.model))
    plan = UpdatePlan.from_config(cfg, turn_horizon(cfg.env, player.suite))
    learner = Learner(player.weights, plan, run_dir(cfg))
    generator = build_player(cfg, Weights(cfg.model)) if cfg.rollout.max_staleness else None
    uses_ray = cfg.rollout.runner == "ray" or (cfg.update.launcher == "ray" and cfg.update.world_size > 1)
    return Owners(player, learner, generator, Cluster(cfg.ray) if uses_ray else None)


def build_evaluation(cfg: TrainConfig) -> Owners:
    """An evaluation's owners: a player with weights of its own; nothing trains."""
    return Owners(build_player(cfg, Weights(cfg.model)))


def build_player(cfg: TrainConfig, weights: Weights) -> Player:
    """A player of ``weights`` on a suite of its own (``env``), stepping where ``rollout.env_workers`` says,
    in the run's chat style, sampling and branching settings, on its engine (``engine``)."""
    env, r = cfg.env, cfg.rollout
    suite = make_suite(env.name, env.suite_seed, env.games, data_dir=cfg.data_dir)
    if r.env_workers:
        ref = suite_ref(env.name, env.games, cfg.data_dir)
        environments = functools.partial(EnvPool, ref, env.suite_seed, r.env_workers, step_timeout_s=r.step_timeout_s)
    else:
        environments = functools.partial(InProcess, suite)
    chat = ChatStyle(r.enable_thinking, r.free_format, r.format_penalty, r.prompt)
    params = cfg.branching()
    branching = Branching(r.branch_budget or r.group_size, params) if params is not None else None
    server = VLLMLaunch.from_config(cfg) if cfg.engine.name == "vllm" else None
    sampling = SamplingSettings.from_config(cfg, suite, seed=0)
    return Player(weights, suite, env.tier, environments, chat, sampling, branching, server)
