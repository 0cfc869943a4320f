"""One rank of the update's process group: started by torchrun (``horizonrl.training.rank_group``), alive
across iterations, it runs each update job it finds in the spool folder and rank 0 writes the result.

A job (``job-<seq>.pt``, written whole by the flow's process) holds the iteration's rows, the update
settings, the seed and learning rate, and whether to load the policy from its checkpoint (first job,
a resume, after a failure) or to continue from the weights and AdamW state the ranks hold. Under ddp
every rank keeps a full replica, so rank 0's weights and optimizer state are the whole, rank-independent
state; under fsdp each rank holds a shard and the ranks gather the whole state for rank 0
(``Ranks.full_state``). Either way the flow's process loads it and writes the checkpoint as with one
process, so a checkpoint reads the same whatever strategy or world size wrote it.

A rank exits when the spool holds ``stop``, when the flow's process is gone, or on an error; torchrun
then stops the other ranks and reports which rank failed and why (``@record`` writes the traceback).
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from horizonrl import faults
from horizonrl.config import ModelConfig
from horizonrl.models.loading import load_policy, resolve_dtype
from horizonrl.training.checkpoint import CheckpointRef, load_optimizer_state
from horizonrl.training.parallel import Ranks, local, rank_device
from horizonrl.training.sequences import TrainRow
from horizonrl.training.trainer import UpdateSettings, ppo_update

POLL_S = 0.05  # how often an idle rank looks for the next job


@dataclass(frozen=True)
class UpdateJob:
    """One iteration's update, the same for every rank."""

    seq: int
    policy: str  # checkpoint folder the job starts from
    load: bool  # load ``policy`` (else the ranks' weights and optimizer already are it)
    rows: list[TrainRow]
    settings: UpdateSettings
    seed: int
    lr: float
    weight_decay: float
    iteration: int  # for fault injection (``HORIZONRL_FAULT=nan-grad:<n>``)
    model: ModelConfig
    reference: str | None = None  # checkpoint 0's folder, for losses with a KL to the initial policy
    strategy: str = "ddp"  # update.strategy: ddp (a full replica per rank) or fsdp (sharded)


def job_path(spool: Path, seq: int) -> Path:
    return spool / f"job-{seq:06d}.pt"


def result_path(spool: Path, seq: int) -> Path:
    return spool / f"result-{seq:06d}.pt"


def write_whole(path: Path, obj: object) -> None:
    """``torch.save`` to a temporary name, then rename: a reader sees the whole file or none."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)


class Held:
    """What a rank keeps between jobs: the policy, its optimizer, the reference policy."""

    def __init__(self) -> None:
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.reference: tuple[str, torch.nn.Module] | None = None
        self.strategy = "ddp"  # how ``model`` is held


def run_job(job: UpdateJob, held: Held, device: torch.device, ranks: Ranks) -> dict | None:
    """Run ``job`` on this rank; rank 0 returns the result (weights, optimizer state, figures)."""
    dtype = resolve_dtype(job.model.dtype, device)
    if job.load or held.model is None or held.strategy != job.strategy:
        model, _ = load_policy(job.policy, dtype, job.model.attn_implementation)
        held.model, held.strategy = model.to(device), job.strategy
        held.optimizer = torch.optim.AdamW(held.model.parameters(), lr=job.lr, weight_decay=job.weight_decay)
        load_optimizer_state(CheckpointRef(job.policy, -1), held.optimizer)
        ranks.root, ranks.units = None, []
        if job.strategy == "fsdp":
            whole = held.optimizer.state_dict()
            ranks.shard(held.model)
            held.optimizer = torch.optim.AdamW(held.model.parameters(), lr=job.lr, weight_decay=job.weight_decay)
            held.optimizer.load_state_dict(ranks.shard_state(whole, held.model))
    ref_model = None
    if job.reference is not None:
        if held.reference is None or held.reference[0] != job.reference:
            ref, _ = load_policy(job.reference, dtype, job.model.attn_implementation)
            held.reference = (job.reference, ref.to(device).eval().requires_grad_(False))
        ref_model = held.reference[1]
    for group in held.optimizer.param_groups:
        group["lr"] = job.lr
    ranks.comm_s, ranks.steps = 0.0, 0
    with faults.nan_gradients(held.model, job.iteration):
        result = ppo_update(held.model, held.optimizer, job.rows, job.settings, job.seed, ref_model, ranks)
    if ranks.root is not None:
        weights, optimizer = ranks.full_state(held.model, held.optimizer)  # every rank takes part
    held_numel = ranks.gather(sum(local(p).numel() for p in held.model.parameters()))
    if ranks.rank != 0:
        return None
    if ranks.root is None:
        weights = {k: v.detach().cpu() for k, v in held.model.state_dict().items()}
        optimizer = held.optimizer.state_dict()
    return {
        "model": weights,
        "optimizer": optimizer,
        "stats": result.stats,
        "nonfinite_steps": result.nonfinite_steps,
        "held_numel": held_numel,  # parameter elements each rank holds between jobs (fsdp: its shard)
    }


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@record
def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--spool", type=Path, required=True)
    p.add_argument("--parent", type=int, required=True, help="the flow's process: the ranks exit when it is gone")
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    args = p.parse_args(argv)
    device = rank_device(args.backend, int(os.environ.get("LOCAL_RANK", "0")))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend)
    ranks = Ranks.current()
    (args.spool / f"rank-{ranks.rank}.pid").write_text(str(os.getpid()))
    held, seq = Held(), 1
    try:
        while True:
            path = job_path(args.spool, seq)
            while not path.exists():
                if (args.spool / "stop").exists() or not pid_alive(args.parent):
                    return
                time.sleep(POLL_S)
            job: UpdateJob = torch.load(path, weights_only=False)  # written by the flow's process of this run
            if ranks.rank == ranks.world_size - 1:
                faults.kill_point("update-rank", job.iteration)
            out = run_job(job, held, device, ranks)
            if out is not None:
                write_whole(result_path(args.spool, seq), out)
            seq += 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
