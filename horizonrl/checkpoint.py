"""Checkpoints: the policy (safetensors, loadable as a transformers model), the optimizer state, the
estimator's state (BLPO memory) and the run counters, written as one directory that appears atomically.

Randomness needs no saved state: every stream derives its seed from (run seed, iteration, purpose), so a
resumed run draws what an uninterrupted one would.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from horizonrl.faults import kill_point

STATE_FILE = "state.json"


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (e.g. the disk is full); the message names its folder. The
    temporary folder is removed and earlier checkpoints are untouched."""


@dataclass(frozen=True)
class CheckpointRef:
    """A reference tasks pass around instead of a model."""

    path: str
    iteration: int  # iterations completed by this policy (0 = initial weights)


def checkpoint_dir(run_dir: Path, iteration: int) -> Path:
    return run_dir / "checkpoints" / f"iter={iteration:05d}"


def save_checkpoint(run_dir: Path, iteration: int, model: torch.nn.Module, tokenizer: Any, optimizer: torch.optim.Optimizer | None, state: dict[str, Any], estimator_state: dict | None = None, keep_last: int = 2) -> CheckpointRef:
    """Write checkpoint ``iteration`` atomically; older ones beyond ``keep_last`` are removed (not 0).

    A failed write (safetensors and torch raise their own error types on a full disk) removes the
    temporary folder, so it cannot fill the disk further, and raises ``CheckpointWriteError``."""
    final = checkpoint_dir(run_dir, iteration)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if optimizer is not None:
            torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        if estimator_state is not None:
            (tmp / "estimator_state.json").write_text(json.dumps(estimator_state, sort_keys=True))
        (tmp / STATE_FILE).write_text(json.dumps({"iteration": iteration, **state}, indent=1, sort_keys=True))
        _fsync_dir(tmp)
    except Exception as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointWriteError(f"could not write checkpoint {final}: {err}; earlier checkpoints are untouched") from err
    kill_point("checkpoint", iteration)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _prune(run_dir, keep_last)
    return CheckpointRef(str(final), iteration)


def latest_checkpoint(run_dir: Path) -> CheckpointRef | None:
    """The newest complete checkpoint (its state file present), or None."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return None
    done = sorted(p for p in root.glob("iter=*") if (p / STATE_FILE).is_file())
    if not done:
        return None
    return CheckpointRef(str(done[-1]), int(done[-1].name.split("=")[1]))


def read_state(ref: CheckpointRef) -> dict[str, Any]:
    return json.loads((Path(ref.path) / STATE_FILE).read_text())


def read_estimator_state(ref: CheckpointRef) -> dict | None:
    p = Path(ref.path) / "estimator_state.json"
    return json.loads(p.read_text()) if p.is_file() else None


def load_optimizer_state(ref: CheckpointRef, optimizer: torch.optim.Optimizer) -> bool:
    p = Path(ref.path) / "optimizer.pt"
    if not p.is_file():
        return False
    optimizer.load_state_dict(torch.load(p, weights_only=True))
    return True


def _prune(run_dir: Path, keep_last: int) -> None:
    done = sorted(p for p in (run_dir / "checkpoints").glob("iter=*") if (p / STATE_FILE).is_file())
    for p in done[1:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(p, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    for f in path.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
