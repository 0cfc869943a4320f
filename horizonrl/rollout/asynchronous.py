"""The asynchronous generator's schedule and figures (``rollout.max_staleness`` = k >= 1, docs/algorithms.md
§1.10), apart from what submits the collects (``tasks.collect.Collects``).

Collects are submitted ahead of the update, one after another (each waits for the one before: the generator
holds one model), iteration j played by checkpoint max(j-1-k, 0), so the schedule is fixed by k alone and a
resumed run plays what an uninterrupted one does. The figures (stage ``async``) say how stale each
iteration's rows were and how long each side waited: the learner's wait for its rows within its iteration,
and the share of an iteration's wall time the generator did not play.
"""

from __future__ import annotations

import time


class AsyncSchedule:
    """Which collects are due, and the timing windows their figures come from."""

    def __init__(self, k: int, iterations: int) -> None:
        self.k, self.iterations = k, iterations
        self.submitted: set[int] = set()
        self.played: list[tuple[float, float]] = []  # wall-clock (start, end) of every collect played here
        self.windows: dict[int, tuple[float, float, float]] = {}  # iteration -> (start, end, learner wait s)

    def due(self, iteration: int, trained: int) -> list[tuple[int, int]]:
        """The collects to submit before the rows of ``iteration`` are taken, ``trained`` being the newest
        checkpoint: (iteration j, checkpoint that plays it) for every j the bound allows now (up to
        ``trained`` + 1 + k, at most the run's last) not submitted yet."""
        last = min(trained + 1 + self.k, self.iterations)
        due = [(j, max(j - 1 - self.k, 0)) for j in range(iteration, last + 1) if j not in self.submitted]
        self.submitted.update(j for j, _ in due)
        return due

    def taken(self, iteration: int, started: float, played: tuple[float, float] | None) -> None:
        """The rows of ``iteration`` arrived; the learner asked for them at ``started`` (wall clock); the
        generator played them between ``played`` (None: stored before, reused)."""
        if played is not None:
            self.played.append(played)
        self.windows[iteration] = (started, 0.0, time.time() - started)

    def done(self, iteration: int, rows_version: int, trained: int, queued: int) -> list[tuple[int, dict[str, float]]]:
        """``iteration`` ended with checkpoint ``trained`` written from rows played by ``rows_version``, with
        ``queued`` later batches already played: its figures (every row of an iteration is played by one
        checkpoint, so its ``staleness`` is the rows'), and the generator's idle share of the iteration
        before, whose overlapping collects have ended by now. (iteration, figures) pairs."""
        start, _, wait = self.windows[iteration]
        end = time.time()
        self.windows[iteration] = (start, end, wait)
        figures = {
            "staleness": float(trained - 1 - rows_version),
            "learner_idle_fraction": wait / max(end - start, 1e-9),
            "queued_batches": float(queued),
        }
        out = [(iteration, figures)]
        if iteration - 1 in self.windows:
            out.append((iteration - 1, self._generator_idle(iteration - 1)))
        return out

    def close(self) -> list[tuple[int, dict[str, float]]]:
        """The generator's idle share of every ended iteration not yet reported (the last one)."""
        return [(it, self._generator_idle(it)) for it in sorted(self.windows) if self.windows[it][1]]

    def _generator_idle(self, iteration: int) -> dict[str, float]:
        """The share of ``iteration``'s wall time the generator was not playing."""
        start, end, _ = self.windows.pop(iteration)
        busy = sum(max(0.0, min(b, end) - max(a, start)) for a, b in self.played)
        return {"generator_idle_fraction": 1.0 - busy / max(end - start, 1e-9)}
