"""The update's ranks as seen from the flow's process: ``update.world_size`` processes started once with
torchrun, kept alive across iterations, given one job per update and stopped with the run.

torchrun (``python -m torch.distributed.run``, part of torch) rather than ``accelerate launch``: it is the
launcher accelerate itself wraps, needs no extra dependency or config file, and its elastic agent stops
every rank when one dies and reports the failed rank with its exit code or traceback (``@record``), which
is the error the update task raises. ``--max-restarts 0``: a failed update is not retried inside the
group; the task fails, the holder forgets the group, and the next attempt starts a new one from the
last checkpoint.

Jobs and results pass through a spool folder under the run (``.update-ranks/``): the rows are read once
by the flow's process (as with one process) and handed over whole, and rank 0 hands back the full
weights and AdamW state, which the flow's process loads into its own model and writes as the checkpoint.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from horizonrl.training.checkpoint import CheckpointRef
from horizonrl.training.rank_worker import UpdateJob, job_path, pid_alive, result_path, write_whole

SPOOL = ".update-ranks"
LOG_TAIL = 4_000  # characters of torchrun's log quoted in a failure


def remove_stale_spools(run_dir: Path) -> None:
    """Remove the spool folders of processes that are gone (a killed flow's ranks exit on their own, seeing
    their parent gone, but leave its folder)."""
    for folder in (run_dir / SPOOL).glob("*"):
        if folder.name.isdigit() and not pid_alive(int(folder.name)):
            shutil.rmtree(folder, ignore_errors=True)


class RankFailed(RuntimeError):
    """A rank of the update's process group died or raised; the message names the rank and its error."""


class RankGroup:
    """``world_size`` update ranks (torchrun, one machine) serving jobs from this process."""

    def __init__(self, run_dir: Path, world_size: int, backend: str) -> None:
        self.world_size = world_size
        self.backend = backend
        self.spool = Path(run_dir) / SPOOL / str(os.getpid())
        self.holds: CheckpointRef | None = None  # the checkpoint the ranks' weights and optimizer are
        self._seq = 0
        remove_stale_spools(Path(run_dir))
        shutil.rmtree(self.spool, ignore_errors=True)
        self.spool.mkdir(parents=True)
        self.log = self.spool / "torchrun.log"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nnodes=1",
            f"--nproc-per-node={world_size}",
            "--max-restarts=0",
            "--monitor-interval=0.2",
            "-m",
            "horizonrl.training.rank_worker",
            "--spool",
            str(self.spool),
            "--parent",
            str(os.getpid()),
            "--backend",
            backend,
        ]
        with self.log.open("wb") as out:  # its own session: stop() signals torchrun and its ranks only
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def rank_pids(self) -> dict[int, int]:
        """{rank: pid} of the ranks started so far (each writes its pid when it has joined the group)."""
        return {
            int(p.stem.split("-")[1]): int(p.read_text())
            for p in self.spool.glob("rank-*.pid")
            if p.read_text().strip().isdigit()
        }

    def update(self, **job: object) -> dict:
        """Run one update job (the ``UpdateJob`` fields but ``seq`` and ``load``) on every rank and return
        rank 0's result: ``model`` (state dict), ``optimizer`` (state dict), ``stats``, ``nonfinite_steps``.

        Raises:
            RankFailed: a rank died or raised (torchrun stops the others); the message names the rank.
        """
        if not self.alive:
            raise RankFailed(self._failure())
        self._seq += 1
        policy = str(job["policy"])
        load = self.holds is None or self.holds.path != policy
        self.holds = None  # from here the ranks' state is neither the old checkpoint nor yet a new one
        write_whole(job_path(self.spool, self._seq), UpdateJob(seq=self._seq, load=load, **job))
        done = result_path(self.spool, self._seq)
        while not done.exists():
            if not self.alive:
                raise RankFailed(self._failure())
            time.sleep(0.02)
        out = torch.load(done, weights_only=False)
        done.unlink()
        job_path(self.spool, self._seq).unlink(missing_ok=True)
        return out

    def advance(self, ref: CheckpointRef) -> None:
        """The ranks' state is now checkpoint ``ref`` (written from their last result)."""
        self.holds = ref

    def stop(self, timeout_s: float = 30.0) -> None:
        """Ask the ranks to exit and wait; past ``timeout_s`` (or if they do not answer) stop torchrun's
        session with SIGTERM, then SIGKILL."""
        if self.alive:
            (self.spool / "stop").touch()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                for sig in (signal.SIGTERM, signal.SIGKILL):
                    try:
                        os.killpg(self.proc.pid, sig)
                        self.proc.wait(10)
                        break
                    except (ProcessLookupError, subprocess.TimeoutExpired):
                        continue
        shutil.rmtree(self.spool, ignore_errors=True)

    def _failure(self) -> str:
        """What torchrun reported: the failed rank, its exit code or error, and the log's tail. A rank killed
        by a signal is named before torchrun's "first observed failure": when one rank dies, the others
        fail on its closed connection, and which of them torchrun observes first depends on timing. A rank
        torchrun itself signalled to stop the group ("Sending process <pid> closing signal") is not the one."""
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        start = text.find("Failures:") if "Failures:" in text else text.find("Root Cause (first observed failure):")
        blocks = re.split(r"^\s*\[\d+\]:\s*$", text[start:] if start >= 0 else "", flags=re.M)[1:]
        stopped = set(re.findall(r"Sending process (\d+) closing signal", text))
        killed = [  # one block per failed rank
            b
            for b in blocks
            if re.search(r"traceback\s*:\s*Signal \d+", b)
            and not {m.group(1) for m in re.finditer(r"\(pid: (\d+)\)", b)} & stopped
        ]
        root = killed[0] if killed else (blocks[-1] if blocks else "")  # torchrun's root cause comes last
        rank = re.search(r"rank\s*:\s*(\d+)", root)
        cause = re.search(r"(?:traceback|exitcode)\s*:\s*(.+)", root)
        who = f"rank {rank.group(1)} of {self.world_size}" if rank else f"a rank of {self.world_size}"
        what = cause.group(1).strip() if cause else f"torchrun exited with {self.proc.returncode}"
        errors = re.findall(r"^(?:\[rank\d+\]:)?\s*([\w.]+(?:Error|Exception|Interrupt)\b.*)$", text, re.M)
        if errors and not killed:  # a killed rank raised nothing: the errors are the others' closed connections
            what += f" ({errors[-1].strip()})"
        return f"update {who} failed: {what}; torchrun log {self.log}:\n{text[-LOG_TAIL:]}"
