"""The policy's weights in a process (``Weights``) and the learner that trains them (``Learner``).

A run's owners are built once at its start (``horizonrl.run.owners``): the learner holds the policy being
trained, its optimizer, the frozen reference and the update's ranks, and keeps the model in memory between
the update and the next collect, so an update's weights reach the disk once per iteration, as its
checkpoint. Tasks pass checkpoint references; the weights load one only when the model they hold is not
already that checkpoint (after an update it is).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from horizonrl.config import MODEL_URI_PREFIXES, ModelConfig, TrainConfig
from horizonrl.envs import EnvSuite, corpus_digest, suite_corpus
from horizonrl.models import pretrained
from horizonrl.models.loading import initial_adapter_dir, load_policy, resolve_device, resolve_dtype, tiny_model_dir
from horizonrl.tracking import mlflow_runs
from horizonrl.training.checkpoint import CheckpointRef, checkpoint_dir, load_optimizer_state
from horizonrl.training.iteration import UpdatePlan, update_policy
from horizonrl.training.parallel import update_backend
from horizonrl.training.rank_group import RankGroup
from horizonrl.training.ray_ranks import RayRankGroup
from horizonrl.training.sequences import TrainRow


@dataclass
class Policy:
    """The weights of checkpoint ``ref`` in memory, with their tokenizer (and, held by a learner, optimizer)."""

    ref: CheckpointRef
    model: torch.nn.Module
    tokenizer: Any
    optimizer: torch.optim.Optimizer | None = None


class Weights:
    """At most one checkpoint's weights in this process, on ``model.device`` in ``model.dtype``: load, keep,
    hold, drop. The learner's player plays the learner's; the asynchronous generator has its own."""

    def __init__(self, model: ModelConfig) -> None:
        self.device = resolve_device(model.device)
        self.dtype = resolve_dtype(model.dtype, self.device)
        self.attn_implementation = model.attn_implementation
        self.current: Policy | None = None
        self._written: tuple[CheckpointRef, torch.nn.Module, Any] | None = None  # see keep()

    def load(self, path: str | Path) -> tuple[torch.nn.Module, Any]:
        """The policy at ``path`` (model, tokenizer) in the run's dtype and attention implementation, on the
        CPU (``get`` moves it)."""
        return load_policy(path, self.dtype, self.attn_implementation)

    def keep(self, ref: CheckpointRef, model: torch.nn.Module, tokenizer: Any) -> None:
        """``model`` and ``tokenizer``, just written as checkpoint ``ref`` (``load``ed, unchanged since): the next
        ``get`` of ``ref`` takes them instead of reading the checkpoint back, so a run's start loads its
        initial policy once (a real model's weights: seconds to minutes)."""
        self.current = None
        self._written = (ref, model, tokenizer)

    def holds(self, ref: CheckpointRef) -> bool:
        """Whether checkpoint ``ref`` is the policy in memory."""
        return self.current is not None and self.current.ref == ref

    def get(self, ref: CheckpointRef) -> Policy:
        """Checkpoint ``ref`` in memory on the run's device."""
        if self.holds(ref):
            return self.current
        torch.set_num_threads(max(1, torch.get_num_threads()))
        self.current = None  # the version held so far goes before the next one loads, not after
        written, self._written = self._written, None
        model, tokenizer = written[1:] if written is not None and written[0] == ref else self.load(ref.path)
        self.current = Policy(ref, model.to(self.device), tokenizer)
        return self.current

    def advance(self, ref: CheckpointRef) -> None:
        """The in-memory model now is checkpoint ``ref`` (just saved by the update)."""
        if self.current is not None:
            self.current.ref = ref

    def drop(self) -> None:
        """Forget the policy in memory (a failed update half-applied it): the next ``get`` reads the disk."""
        self.current = None
        self._written = None

    def __reduce__(self) -> tuple:
        raise TypeError("a policy's weights never travel: each process loads its own from a checkpoint path")


class Learner:
    """The run's policy being trained (its ``weights``, with an AdamW optimizer), the frozen reference
    (the run's checkpoint 0) and the update's ranks; ``update`` is one iteration's update as ``plan`` says."""

    def __init__(self, weights: Weights, plan: UpdatePlan, run_dir: Path) -> None:
        self.weights = weights
        self.plan = plan
        self.run_dir = run_dir
        self._reference: torch.nn.Module | None = None
        self._ranks: RankGroup | RayRankGroup | None = None

    def get(self, ref: CheckpointRef) -> Policy:
        """Checkpoint ``ref`` in memory with its optimizer state (AdamW, created when the weights load)."""
        policy = self.weights.get(ref)
        if policy.optimizer is None:
            params = policy.model.parameters()
            policy.optimizer = torch.optim.AdamW(params, lr=self.plan.lr, weight_decay=self.plan.weight_decay)
            load_optimizer_state(ref, policy.optimizer)
        return policy

    def update(
        self,
        iteration: int,
        policy: CheckpointRef,
        rows: list[TrainRow],
        stale: bool,
        seed: int,
        run_state: dict[str, Any],
        estimator_state: dict | None = None,
    ) -> tuple[CheckpointRef, dict[str, float]]:
        """Train checkpoint ``policy`` on ``rows`` (``stale``: played by an older checkpoint) and write
        checkpoint ``iteration`` (``training.iteration.update_policy``). A failure drops the half-applied
        weights and stops the ranks, so the next attempt reloads ``policy`` from disk."""
        t0 = time.perf_counter()
        try:
            loaded = self.get(policy)
            plan = self.plan.for_rows(loaded.tokenizer.pad_token_id, stale)
            ranks = self.update_ranks() if plan.world_size > 1 and rows else None
            ref_model = self.reference() if plan.settings.needs_reference and ranks is None else None
            elapsed = {"elapsed_s": run_state.get("elapsed_s", 0.0) + time.perf_counter() - t0}
            ref, stats = update_policy(
                plan, self.run_dir, iteration, policy, loaded.model, loaded.tokenizer, loaded.optimizer,
                rows, seed, {**run_state, **elapsed}, estimator_state, ref_model, ranks,
            )  # fmt: skip
        except BaseException:
            self.weights.drop()
            self.close_update_ranks()
            raise
        self.weights.advance(ref)
        return ref, stats

    def reference(self) -> torch.nn.Module:
        """The frozen initial policy of this run (its checkpoint 0) for KL-to-reference losses; loaded once."""
        if self._reference is None:
            model, _ = self.weights.load(checkpoint_dir(self.run_dir, 0))
            self._reference = model.to(self.weights.device).eval().requires_grad_(False)
        return self._reference

    def update_ranks(self) -> RankGroup | RayRankGroup:
        """The run's update ranks (``update.world_size`` > 1): started on first use, kept across iterations;
        a group that died is replaced. gloo on the CPU, nccl when the policy's device is CUDA; torchrun
        processes of this machine, or Ray actors on the run's cluster (``update.launcher``; the cluster is
        joined at the run's start, ``Cluster.join``)."""
        if self._ranks is not None and not self._ranks.alive:
            self.close_update_ranks()
        if self._ranks is None:
            backend = update_backend(self.plan.model.device)
            if self.plan.launcher == "ray":
                self._ranks = RayRankGroup(self.plan.world_size, backend)
            else:
                self._ranks = RankGroup(self.run_dir, self.plan.world_size, backend)
        return self._ranks

    def close_update_ranks(self) -> None:
        """Stop the update ranks, if any (with the run, or after a failed update)."""
        if self._ranks is not None:
            self._ranks.stop()
            self._ranks = None

    def close(self) -> None:
        """The run ended: stop the ranks and let go of the weights, the optimizer and the reference."""
        self.close_update_ranks()
        self.weights.drop()
        self._reference = None

    def __reduce__(self) -> tuple:
        raise TypeError("a learner never travels: a worker process builds its own owners")


def initial_model_dir(cfg: TrainConfig, suite: EnvSuite) -> Path:
    """The starting weights: ``model.path`` (a directory, hub id, or ``models:/<name>/<version>`` or
    ``runs:/<run id>`` from the MLflow store) or the tiny model built for ``suite``'s corpus; with
    ``model.lora``, a directory of fresh adapters over that base."""
    if cfg.model.path is not None and cfg.model.path.startswith(MODEL_URI_PREFIXES):  # a logged policy
        base = Path(policy_from_store(cfg).path)
    elif cfg.model.path is not None:  # a pretrained model's name is fetched on first use
        base = Path(pretrained.resolve(cfg.model.path, cfg.data_dir))
    else:
        corpus = functools.partial(suite_corpus, suite, cfg.env.tier)  # played only when needed
        digest = None
        if cfg.model.tokenizer == "word":
            models = Path(cfg.data_dir) / "models"
            digest = corpus_digest(cfg.env.name, cfg.env.tier, cfg.env.suite_seed, corpus, models)
        base = tiny_model_dir(cfg.data_dir, cfg.env.name, cfg.model, corpus, corpus_sha256=digest)
    if cfg.model.lora is not None:  # fresh adapters over the base; checkpoints then hold adapters only
        return initial_adapter_dir(cfg.data_dir, base, cfg.model.lora, cfg.model.init_seed)
    return base


def policy_from_store(cfg: TrainConfig) -> CheckpointRef:
    """The checkpoint of ``model.path`` = ``models:/<name>/<version>`` or ``runs:/<run id>``, downloaded
    once under ``<data_dir>/policies``."""
    c = mlflow_runs.client(mlflow_runs.tracking_uri(cfg.tracking_uri))
    _, model_uri = mlflow_runs.resolve_policy(c, cfg.model.path)
    return mlflow_runs.download_policy(model_uri, Path(cfg.data_dir) / "policies")
