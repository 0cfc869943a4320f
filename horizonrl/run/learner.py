"""The learner: the policy being trained, its tokenizer and optimizer, the frozen reference and the update's
ranks. One per process (``tasks.context.LEARNER``), kept between stages, so an update's weights stay in
memory for the next collect and reach the disk once per iteration, as its checkpoint.

Tasks pass checkpoint references; the learner loads one only when the model it holds is not already that
checkpoint (after an update it is).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from horizonrl.config import MODEL_URI_PREFIXES, TrainConfig
from horizonrl.envs import EnvSuite, corpus_digest, suite_corpus
from horizonrl.models import pretrained
from horizonrl.models.loading import initial_adapter_dir, load_policy, resolve_device, resolve_dtype, tiny_model_dir
from horizonrl.tracking import mlflow_runs
from horizonrl.training.checkpoint import CheckpointRef, checkpoint_dir, load_optimizer_state, policy_digest
from horizonrl.training.parallel import update_backend
from horizonrl.training.rank_group import RankGroup
from horizonrl.training.ray_ranks import RayRankGroup


@dataclass
class Policy:
    """The weights of checkpoint ``ref`` in memory, with their tokenizer and optimizer (a learner that trains)."""

    ref: CheckpointRef
    model: torch.nn.Module
    tokenizer: object
    optimizer: torch.optim.Optimizer | None


class Learner:
    """Holds at most one policy per process: load, keep, advance, drop; and what the update uses beside it.
    ``trains`` False: weights that only play (the asynchronous generator's), held without an optimizer,
    whose state costs twice the weights."""

    def __init__(self, trains: bool = True) -> None:
        self.trains = trains
        self.current: Policy | None = None
        self._written: tuple[CheckpointRef, torch.nn.Module, object] | None = None  # see keep()
        self._reference: tuple[str, torch.nn.Module] | None = None  # (policy digest of checkpoint 0, its model)
        self._ranks: RankGroup | RayRankGroup | None = None

    def load(self, cfg: TrainConfig, path: str | Path) -> tuple[torch.nn.Module, object]:
        """The policy at ``path`` (model, tokenizer) as this run holds it: ``model.dtype`` for the run's device,
        its attention implementation; on the CPU (``get`` moves it)."""
        dtype = resolve_dtype(cfg.model.dtype, resolve_device(cfg.model.device))
        return load_policy(path, dtype, cfg.model.attn_implementation)

    def keep(self, ref: CheckpointRef, model: torch.nn.Module, tokenizer: object) -> None:
        """``model`` and ``tokenizer``, just written as checkpoint ``ref`` (``load``ed, unchanged since): the next
        ``get`` of ``ref`` takes them instead of reading the checkpoint back, so a run's start loads its
        initial policy once (a real model's weights: seconds to minutes)."""
        self.current = None
        self._written = (ref, model, tokenizer)

    def holds(self, ref: CheckpointRef) -> bool:
        """Whether checkpoint ``ref`` is the policy in memory."""
        return self.current is not None and self.current.ref == ref

    def get(self, cfg: TrainConfig, ref: CheckpointRef) -> Policy:
        """Checkpoint ``ref`` in memory on the run's device, with its optimizer state if this learner trains."""
        if self.holds(ref):
            return self.current
        torch.set_num_threads(max(1, torch.get_num_threads()))
        self.current = None  # the version held so far goes before the next one loads, not after
        written, self._written = self._written, None
        model, tokenizer = written[1:] if written is not None and written[0] == ref else self.load(cfg, ref.path)
        model.to(resolve_device(cfg.model.device))
        optimizer = None
        if self.trains:
            optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.update.lr, weight_decay=cfg.update.weight_decay)
            load_optimizer_state(ref, optimizer)
        self.current = Policy(ref, model, tokenizer, optimizer)
        return self.current

    def advance(self, ref: CheckpointRef) -> None:
        """The in-memory model now is checkpoint ``ref`` (just saved by the update)."""
        if self.current is not None:
            self.current.ref = ref

    def drop(self) -> None:
        """Forget the policy in memory (a failed update half-applied it): the next ``get`` reads the disk."""
        self.current = None
        self._written = None

    def reference(self, cfg: TrainConfig, run_dir: Path) -> torch.nn.Module:
        """The frozen initial policy of the run in ``run_dir`` (its checkpoint 0) for KL-to-reference losses;
        loaded once per starting policy, so the cells of an in-process sweep each get their own start's (and
        cells that share a warm start, one copy)."""
        start = CheckpointRef(str(checkpoint_dir(run_dir, 0)), 0)
        digest = policy_digest(start)
        if self._reference is None or self._reference[0] != digest:
            self._reference = None  # the previous run's reference goes before this one loads
            model, _ = self.load(cfg, start.path)
            self._reference = (digest, model.to(resolve_device(cfg.model.device)).eval().requires_grad_(False))
        return self._reference[1]

    def update_ranks(self, cfg: TrainConfig, run_dir: Path) -> RankGroup | RayRankGroup:
        """The run's update ranks (``update.world_size`` > 1): started on first use, kept across iterations;
        a group that died is replaced. gloo on the CPU, nccl when the policy's device is CUDA; torchrun
        processes of this machine, or Ray actors on the run's cluster (``update.launcher``; the cluster is
        joined at the run's start, ``Cluster.join``)."""
        kind = RayRankGroup if cfg.update.launcher == "ray" else RankGroup
        group = self._ranks
        if group is not None and (
            not group.alive or group.world_size != cfg.update.world_size or not isinstance(group, kind)
        ):
            self.close_update_ranks()
            group = None
        if group is None:
            backend = update_backend(cfg.model.device)
            if kind is RayRankGroup:
                group = self._ranks = RayRankGroup(cfg.update.world_size, backend)
            else:
                group = self._ranks = RankGroup(run_dir, cfg.update.world_size, backend)
        return group

    def close_update_ranks(self) -> None:
        """Stop the update ranks, if any (with the run, or after a failed update)."""
        if self._ranks is not None:
            self._ranks.stop()
            self._ranks = None

    def __reduce__(self) -> tuple:
        """A learner never travels: pickled (Ray ships a task's globals with it, and Prefect's context with
        the flow's) it arrives empty, so a worker fills its own instead of receiving this process's model
        and optimizer."""
        return (Learner, ())


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
