"""The update's ranks as a Ray actor group (``update.launcher: ray``): ``update.world_size`` actors on the
run's Ray cluster (section ``ray``), placed by Ray on any of its nodes, one CPU (gloo) or one GPU (nccl)
each, kept alive across iterations and stopped with the run.

The same rank code as under torchrun (``rank_worker.run_job``, ``parallel.Ranks``): an actor joins the
process group through ``init_process_group`` with rank 0's node address and a free port it picked there
(``env://``), and a job is a method call on every actor, so jobs and results travel through Ray, not a
spool folder, and no filesystem need be shared for them (checkpoints are still loaded by path: ``data_dir``
on a filesystem every node mounts, as for Ray collect). A rank that dies or raises fails the update with
``RankFailed`` naming it; the others are killed (they would wait in a collective), and the next attempt
starts a new group.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import torch
import torch.distributed as dist

from horizonrl import faults
from horizonrl.training.checkpoint import CheckpointRef
from horizonrl.training.parallel import Ranks, rank_device
from horizonrl.training.rank_group import RankFailed
from horizonrl.training.rank_worker import Held, UpdateJob, run_job


class RankActor:
    """One rank (a Ray actor): joins the group, then runs one job per call."""

    def endpoint(self) -> tuple[str, int]:
        """This node's address and a port free on it, for rank 0 to offer the group's rendezvous on."""
        import ray

        address = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((address, 0))
            return address, s.getsockname()[1]

    def join(self, rank: int, world_size: int, address: str, port: int, backend: str) -> int:
        """Join the process group as ``rank``; returns this actor's pid."""
        os.environ.update(MASTER_ADDR=address, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
        self.device = rank_device(backend, 0)  # Ray shows the actor its one GPU as device 0
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        else:
            torch.set_num_threads(1)  # one CPU per actor, as torchrun gives each rank one thread
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        self.ranks, self.held = Ranks.current(), Held()
        return os.getpid()

    def run(self, job: UpdateJob) -> dict | None:
        if self.ranks.rank == self.ranks.world_size - 1:
            faults.kill_point("update-rank", job.iteration)
        return run_job(job, self.held, self.device, self.ranks)


class RayRankGroup:
    """``world_size`` update ranks as Ray actors; the same interface as ``RankGroup`` (``update``,
    ``advance``, ``stop``, ``alive``, ``rank_pids``). Ray must be initialised (``Cluster.join``)."""

    def __init__(self, world_size: int, backend: str) -> None:
        import ray

        self.world_size = world_size
        self.holds: CheckpointRef | None = None
        self._seq = 0
        actor = ray.remote(RankActor).options(num_cpus=0 if backend == "nccl" else 1, num_gpus=int(backend == "nccl"))
        self.actors = [actor.remote() for _ in range(world_size)]
        address, port = ray.get(self.actors[0].endpoint.remote())
        joins = [a.join.remote(r, world_size, address, port, backend) for r, a in enumerate(self.actors)]
        self._pids = dict(enumerate(self._all(joins, "joining")))

    @property
    def alive(self) -> bool:
        return bool(self.actors)

    def rank_pids(self) -> dict[int, int]:
        return dict(self._pids)

    def update(self, **job: Any) -> dict:
        """Run one update job (the ``UpdateJob`` fields but ``seq`` and ``load``) on every actor and return
        rank 0's result, as ``RankGroup.update``.

        Raises:
            RankFailed: an actor died or raised (the others are killed); the message names the rank.
        """
        if not self.alive:
            raise RankFailed(f"update ranks of {self.world_size} (Ray actors) already stopped after a failure")
        self._seq += 1
        policy = str(job["policy"])
        load = self.holds is None or self.holds.path != policy
        self.holds = None
        spec = UpdateJob(seq=self._seq, load=load, **job)
        return self._all([a.run.remote(spec) for a in self.actors], f"update {self._seq}")[0]

    def advance(self, ref: CheckpointRef) -> None:
        """The ranks' state is now checkpoint ``ref`` (written from their last result)."""
        self.holds = ref

    def stop(self) -> None:
        """Kill the actors (a job in flight is abandoned); a no-op once Ray is shut down (it took them)."""
        import ray

        if ray.is_initialized():
            for a in self.actors:
                ray.kill(a)
        self.actors = []

    def _all(self, refs: list, what: str) -> list:
        """Every rank's answer, in rank order; on the first rank that fails, kill all and raise ``RankFailed``
        naming it (the others would wait in a collective for it)."""
        import ray

        index = {ref: r for r, ref in enumerate(refs)}
        pending, out = list(refs), {}
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            rank = index[done[0]]
            try:
                out[rank] = ray.get(done[0])
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:
                self.stop()
                cause = str(e).strip().splitlines()
                raise RankFailed(
                    f"update rank {rank} of {self.world_size} failed ({what}, Ray actor): {cause[-1] if cause else e}"
                ) from e
        return [out[r] for r in range(len(refs))]
