"""Fault injection, for testing what survives what: ``HORIZONRL_FAULT=<point>:<iteration>[,...]``.

The train flow passes these named points; when the variable names one for the current iteration, the
fault happens there and nowhere else. Unset (the normal case) it costs one environment lookup.

Points where the process SIGKILLs itself (nothing after the point runs, not even ``finally`` blocks):

- ``collect``: the iteration's ``turns.parquet`` is stored, ``episodes.parquet`` is not yet
- ``advantage``: ``advantages-<method>.parquet`` is stored, nothing of it is logged yet
- ``update``: the PPO epochs are done in memory, the checkpoint is not written yet
- ``checkpoint``: inside the checkpoint write, every file is in the temporary folder, before the rename
- ``evaluate``: the held-out episodes are played, nothing of them is logged yet
- ``eval-block`` (iteration = block index): an evaluation played in blocks (``eval.block_tasks``) has stored
  that block, the next is not played yet
- ``trace``: half of the iteration's sampled training episodes are logged as MLflow traces, the rest not yet
- ``update-rank``: with ``update.world_size`` > 1, the last rank of the update's process group, on receiving
  the iteration's job (the flow's process lives on and sees the rank die)
- ``clone`` (warmstart, iteration = epoch): the epoch's checkpoint is written, its losses are not logged yet
- ``recompute`` (iteration = the stored iteration): its recomputed advantages are written, not logged yet

And one that does not kill:

- ``nan-grad``: every gradient of the iteration's update is NaN, so every optimizer step is non-finite
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager

import torch

ENV = "HORIZONRL_FAULT"
KILL_POINTS = (
    "collect",
    "advantage",
    "update",
    "checkpoint",
    "evaluate",
    "eval-block",
    "trace",
    "update-rank",
    "clone",
    "recompute",
)
POINTS = (*KILL_POINTS, "nan-grad")


def active(point: str, iteration: int) -> bool:
    """Whether ``$HORIZONRL_FAULT`` asks for ``point`` at ``iteration``; a misspelt point is an error,
    so a test that means to inject a fault cannot silently run without it."""
    spec = os.environ.get(ENV, "")
    if not spec:
        return False
    wanted = set()
    for item in spec.split(","):
        name, _, it = item.strip().partition(":")
        if name not in POINTS or not it.isdigit():
            raise ValueError(f"${ENV}: {item!r} is not <point>:<iteration> with a point in {', '.join(POINTS)}")
        wanted.add((name, int(it)))
    return (point, iteration) in wanted


def kill_point(point: str, iteration: int) -> None:
    """SIGKILL this process here if ``$HORIZONRL_FAULT`` asks for it: a crash with no clean-up at all."""
    if active(point, iteration):
        os.kill(os.getpid(), signal.SIGKILL)


@contextmanager
def nan_gradients(model: torch.nn.Module, iteration: int) -> Iterator[None]:
    """Within the block, every gradient of ``model`` is NaN if ``nan-grad:<iteration>`` is asked for."""
    hooks = []
    if active("nan-grad", iteration):
        hooks = [
            p.register_hook(lambda g: torch.full_like(g, float("nan"))) for p in model.parameters() if p.requires_grad
        ]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
