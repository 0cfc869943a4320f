"""Checkpoints: the policy (safetensors, loadable as a transformers model) with its probe (full weights,
``models/probe.py``), the optimizer state, the estimator's state (BLPO memory) and the run counters, written
as one directory that appears atomically.

Each checkpoint's ``manifest.json``, written last, lists every file with its size and sha256. A resume
verifies the newest checkpoint against it: a checkpoint with a part missing or changed is named with the
file and the reason and is not used (the run falls back to the newest one that verifies), so a deleted
``optimizer.pt`` can never mean a silently fresh optimizer, nor a deleted estimator state an empty memory.

Randomness needs no saved state: every stream derives its seed from (run seed, iteration, purpose), so a
resumed run draws what an uninterrupted one would.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from horizonrl.faults import kill_point
from horizonrl.files import file_digest, folder_digest, fsync_dir
from horizonrl.models.lora import is_adapter_dir, settle_config
from horizonrl.models.probe import save_probe

STATE_FILE = "state.json"
MANIFEST = "manifest.json"


class CheckpointDamaged(RuntimeError):
    """No checkpoint of a run verifies against its manifest; the message names each one and why."""


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


def save_checkpoint(
    run_dir: Path,
    iteration: int,
    model: torch.nn.Module,
    tokenizer: Any,
    optimizer: torch.optim.Optimizer | None,
    state: dict[str, Any],
    estimator_state: dict | None = None,
    keep_last: int = 2,
) -> CheckpointRef:
    """Write checkpoint ``iteration`` atomically; older ones beyond ``keep_last`` are removed (not 0).

    A failed write (safetensors and torch raise their own error types on a full disk) removes the
    temporary folder, so it cannot fill the disk further, and raises ``CheckpointWriteError``."""
    final = checkpoint_dir(run_dir, iteration)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        model.save_pretrained(tmp, safe_serialization=True)
        if is_adapter_dir(tmp):
            settle_config(tmp)
        else:  # what a server synced to full weights is checked against (models/probe.py)
            save_probe(model, tmp)
        tokenizer.save_pretrained(tmp)
        if optimizer is not None:
            torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        if estimator_state is not None:
            (tmp / "estimator_state.json").write_text(json.dumps(estimator_state, sort_keys=True))
        (tmp / STATE_FILE).write_text(json.dumps({"iteration": iteration, **state}, indent=1, sort_keys=True))
        fsync_dir(tmp)
        (tmp / MANIFEST).write_text(json.dumps({"files": _inventory(tmp)}, indent=1, sort_keys=True))
        fsync_dir(tmp)
    except Exception as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointWriteError(
            f"could not write checkpoint {final}: {err}; earlier checkpoints are untouched"
        ) from err
    kill_point("checkpoint", iteration)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _prune(run_dir, keep_last)
    return CheckpointRef(str(final), iteration)


def checkpoints(run_dir: Path) -> list[CheckpointRef]:
    """Every checkpoint folder of the run, oldest first (a folder appears only once written whole)."""
    root = Path(run_dir) / "checkpoints"
    found = sorted(p for p in root.glob("iter=*") if p.is_dir()) if root.is_dir() else []
    return [CheckpointRef(str(p), int(p.name.split("=")[1])) for p in found]


def resume_checkpoint(run_dir: Path) -> tuple[CheckpointRef | None, list[tuple[CheckpointRef, str]]]:
    """(the newest checkpoint that verifies or None, [(newer checkpoint, what is wrong with it)])."""
    damaged = []
    for ref in reversed(checkpoints(run_dir)):
        problem = verify(ref)
        if problem is None:
            return ref, damaged
        damaged.append((ref, problem))
    return None, damaged


def verify(ref: CheckpointRef) -> str | None:
    """What is wrong with checkpoint ``ref`` (a file missing, of another size or content than its
    manifest says, or no manifest), or None if every file is as written."""
    folder = Path(ref.path)
    try:
        listed = json.loads((folder / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return f"{MANIFEST} is missing (deleted, or the checkpoint predates manifests)"
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{MANIFEST} is unreadable: {err}"
    actual = _inventory(folder, exclude=MANIFEST)
    for name, want in sorted(listed.items()):
        got = actual.get(name)
        if got is None:
            return f"{name} is missing"
        if got["size"] != want["size"]:
            return f"{name} has {got['size']} bytes, its manifest says {want['size']}"
        if got["sha256"] != want["sha256"]:
            return (
                f"{name} differs from the file written (sha256 {got['sha256'][:12]}..., "
                f"its manifest says {want['sha256'][:12]}...)"
            )
    return None


RUN_FILES = (STATE_FILE, "optimizer.pt", "estimator_state.json", "probe.pt")
"""A checkpoint's files that say where it sits in a run (or are derived from its weights), not which policy it is."""


TRAINING_ONLY = ("optimizer.pt", "estimator_state.json")
"""A checkpoint's files that only resume training (AdamW's moments, an estimator's memory): a logged policy
leaves them out (the optimizer's moments are twice the weights)."""


def copy_policy(src: str | Path, dest: Path) -> Path:
    """The policy of checkpoint (or model folder) ``src`` at ``dest``: every file but ``TRAINING_ONLY``,
    linked where the file system allows, else copied, with a manifest of what it holds where ``src`` has one."""
    dest.mkdir(parents=True)
    for f in sorted(Path(src).iterdir()):
        if f.is_file() and f.name not in (*TRAINING_ONLY, MANIFEST):
            try:
                os.link(f, dest / f.name)
            except OSError:
                shutil.copy2(f, dest / f.name)
    if (Path(src) / MANIFEST).is_file():
        (dest / MANIFEST).write_text(json.dumps({"files": _inventory(dest)}, indent=1, sort_keys=True))
    return dest


def policy_digest(ref: CheckpointRef) -> str:
    """Which policy checkpoint ``ref`` holds, from its manifest: a digest of the sha256 of every file but the
    run's own (``RUN_FILES``), so the same weights and tokenizer give the same digest in any run. A model
    folder that is no checkpoint (``horizonrl evaluate --model``: no manifest) is digested from its files."""
    if not (Path(ref.path) / MANIFEST).is_file():
        return folder_digest(ref.path)
    listed = json.loads((Path(ref.path) / MANIFEST).read_text())["files"]
    policy = {name: entry["sha256"] for name, entry in sorted(listed.items()) if name not in RUN_FILES}
    return hashlib.sha256(json.dumps(policy, sort_keys=True).encode()).hexdigest()


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
    done = [Path(ref.path) for ref in checkpoints(run_dir)]
    for p in done[1:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(p, ignore_errors=True)


def _inventory(folder: Path, exclude: str | None = None) -> dict[str, dict[str, Any]]:
    """{relative path: {size, sha256}} of every file under ``folder``."""
    return {
        str(p.relative_to(folder)): {"size": p.stat().st_size, "sha256": file_digest(p)}
        for p in sorted(folder.rglob("*"))
        if p.is_file() and str(p.relative_to(folder)) != exclude
    }
