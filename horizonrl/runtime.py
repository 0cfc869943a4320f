"""The per-process holder of heavy objects: policy model, tokenizer, optimizer, engine, env suite.

Tasks pass checkpoint references; the holder loads a checkpoint only when the model in memory is not
already that checkpoint (after an update it is), so weights move trainer -> engine in memory and to disk
once per iteration.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from horizonrl.checkpoint import CheckpointRef, checkpoint_dir, load_optimizer_state
from horizonrl.config import TrainConfig
from horizonrl.engines.hf import TransformersEngine
from horizonrl.envs import EnvSuite, make_suite
from horizonrl.models import load_policy, tiny_model_dir
from horizonrl.prompting import ChatFormat
from horizonrl.seeding import derive_seed


@dataclass
class Loaded:
    ref: CheckpointRef
    model: torch.nn.Module
    tokenizer: object
    fmt: ChatFormat
    engine: TransformersEngine
    optimizer: torch.optim.Optimizer


class PolicyRuntime:
    """Holds at most one loaded policy (and its optimizer) per process."""

    def __init__(self) -> None:
        self.current: Loaded | None = None
        self._suites: dict[tuple[str, int], EnvSuite] = {}
        self._pools: dict[tuple, list] = {}
        self._reference: torch.nn.Module | None = None

    def suite(self, cfg: TrainConfig) -> EnvSuite:
        key = (cfg.env.name, cfg.env.suite_seed)
        if key not in self._suites:
            os.environ["HORIZONRL_DATA_DIR"] = cfg.data_dir  # where suites cache generated games
            self._suites[key] = make_suite(*key)
        return self._suites[key]

    def task_pool(self, cfg: TrainConfig, split: str, n: int) -> list:
        """The first ``n`` tasks of ``split`` at the configured tier (generated once per process)."""
        key = (cfg.env.name, cfg.env.suite_seed, split, cfg.env.tier, n)
        if key not in self._pools:
            self._pools[key] = self.suite(cfg).tasks(split, cfg.env.tier, n)
        return self._pools[key]

    def sampling(self, cfg: TrainConfig, seed: int) -> dict:
        """Keyword arguments of ``rollout.collect`` from the config (shared by collect and evaluate)."""
        r = cfg.rollout
        return dict(action_mode=r.action_mode, context=r.context, history_turns=r.history_turns,
                    max_turns=cfg.env.max_turns or self.suite(cfg).max_turns(cfg.env.tier),
                    max_action_tokens=r.max_action_tokens, temperature=r.temperature, seed=seed)

    def initial_model_dir(self, cfg: TrainConfig) -> Path:
        """The starting weights: ``model.path`` or the tiny model built for this environment."""
        if cfg.model.path is not None:
            return Path(cfg.model.path)
        suite = self.suite(cfg)
        return tiny_model_dir(cfg.data_dir, cfg.env.name, cfg.model, suite.corpus())

    def get(self, cfg: TrainConfig, ref: CheckpointRef) -> Loaded:
        if self.current is not None and self.current.ref == ref:
            return self.current
        torch.set_num_threads(max(1, torch.get_num_threads()))
        model, tokenizer = load_policy(ref.path)
        fmt = ChatFormat.for_tokenizer(tokenizer)
        engine = TransformersEngine(model, tokenizer.pad_token_id, [fmt.end_id, tokenizer.eos_token_id])
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.update.lr, weight_decay=cfg.update.weight_decay)
        load_optimizer_state(ref, optimizer)
        self.current = Loaded(ref, model, tokenizer, fmt, engine, optimizer)
        return self.current

    def reference(self, cfg: TrainConfig, run_dir: Path) -> torch.nn.Module:
        """The frozen initial policy (checkpoint 0) for KL-to-reference losses; loaded once."""
        if self._reference is None:
            model, _ = load_policy(checkpoint_dir(run_dir, 0))
            self._reference = model.eval().requires_grad_(False)
        return self._reference

    def advance(self, ref: CheckpointRef) -> None:
        """The in-memory model now is checkpoint ``ref`` (just saved by the update)."""
        if self.current is not None:
            self.current.ref = ref

    def drop(self) -> None:
        self.current = None


def sample_tasks(pool: list, n: int, seed: int, iteration: int) -> list:
    """The iteration's tasks: ``n`` distinct tasks of ``pool``, fixed by (seed, iteration)."""
    rng = random.Random(derive_seed(seed, "tasks", iteration))
    return rng.sample(pool, min(n, len(pool)))
