"""Episodes stepped in worker processes, so a batch waits on its slowest worker, not on the sum.

``EnvPool(suite, seed, n_workers)`` starts ``n_workers`` processes (``spawn``: a fresh interpreter, no
fork of a parent that holds torch or JVM threads, and no helper process left behind). Each builds the
suite once (``make_suite(name, seed)``, or ``factory(seed)`` for a picklable factory) and keeps its
environments between batches, so JVMs and loaded games stay warm.

Episode slot ``i`` (the i-th task of ``reset_many``) lives on worker ``i % n_workers``. A worker plays
its share of a batch one episode after another and streams each result back as soon as it has it; the
parent waits on all workers at once. ``step_start`` sends the shares and returns, ``step_finish`` does
that waiting (with the failure handling below), so the parent can generate the next actions of other
episodes while the workers step; ``step_many`` is the two in a row. Results queue in the pipes
meanwhile; a worker's timeout runs from the send, so a step that hangs while the parent generates is
caught as soon as the parent gathers.

Failures end one episode, not the batch:

* an environment that raises: that episode ends (``done=True``, ``info["error"]`` set);
* an environment that crashes its worker or runs past the timeout: that episode ends as an error, the
  worker is killed and restarted, and the worker's other episodes are rebuilt on the new worker by
  replaying their tasks and actions (environments replay deterministically);
* a worker that dies before it starts on an episode (killed between batches, even if it still looks
  alive when the batch is sent): restarted, all its episodes rebuilt, no episode lost. The worker
  announces each slot before it touches the environment, so only the episode it was playing is blamed.

Not thread-safe: one caller at a time, and at most one step in flight (nothing else runs meanwhile).

``close()`` stops every worker (killing any that does not exit), and with it their environments'
JVMs or games.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from horizonrl.envs.base import EnvSuite, Task
from horizonrl.envs.batch import StepResult, check_step_order, close_quietly, error_info, reset_episode, step_episode

SuiteRef = str | Callable[[int], EnvSuite]


@dataclass
class _Episode:
    """The parent's record of one slot: enough to rebuild it by replay, and its last info."""

    task: Task
    actions: list[str] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)
    error: str = ""


@dataclass
class _Worker:
    process: Any
    conn: Connection


@dataclass
class _Sent:
    """An op sent to the workers and not yet gathered: per worker, the slots it owes, in playing order."""

    op: str
    items: Mapping[int, Any]
    timeout_s: float
    queues: dict[int, deque]
    deadline: float  # for each worker's first result


class EnvPool:
    """Parallel episodes of one suite, addressed by slot (the index of their task in ``reset_many``)."""

    def __init__(
        self,
        suite: SuiteRef,
        seed: int = 0,
        n_workers: int = 2,
        *,
        step_timeout_s: float = 60.0,
        reset_timeout_s: float = 600.0,
        start_method: str = "spawn",
    ) -> None:
        self.suite, self.seed = suite, seed
        self.step_timeout_s, self.reset_timeout_s = step_timeout_s, reset_timeout_s
        self._context = multiprocessing.get_context(start_method)
        self._workers = [self._start() for _ in range(n_workers)]
        self._episodes: dict[int, _Episode] = {}
        self._step: tuple[list[int], _Sent] | None = None  # the step in flight: slots asked, results owed
        self.restarts = 0

    def reset_many(self, tasks: Sequence[Task]) -> list[tuple[str, dict[str, Any]]]:
        """End every running episode and start one per task; slot i plays tasks[i]."""
        check_step_order("reset_many", self._step is not None)
        self._episodes = {slot: _Episode(task) for slot, task in enumerate(tasks)}
        self._revive_idle()
        for w in range(len(self._workers)):
            self._send(w, "release", [])
        results = self._dispatch("reset", {slot: ep.task for slot, ep in self._episodes.items()}, self.reset_timeout_s)
        out = []
        for slot in range(len(tasks)):
            ok, value = results[slot]
            out.append(value if ok else ("", self._fail(slot, value)))
        return out

    def step_many(self, actions: Mapping[int, str]) -> dict[int, StepResult]:
        """Play ``actions[slot]`` in each slot; ``info["abstract_action"]`` labels it (before it was played)."""
        self.step_start(actions)
        return self.step_finish()

    def step_start(self, actions: Mapping[int, str]) -> None:
        """Send each worker its share of ``actions`` and return while they play them."""
        check_step_order("step_start", self._step is not None)
        self._revive_idle()
        live = {slot: a for slot, a in actions.items() if not self._episodes[slot].error}
        self._step = (list(actions), self._send_share("step", live, self.step_timeout_s))

    def step_finish(self) -> dict[int, StepResult]:
        """Wait for the step in flight: one result per slot of its ``actions``, failures ended as errors."""
        check_step_order("step_finish", self._step is not None)
        (slots, sent), self._step = self._step, None
        results = self._gather(sent)
        out: dict[int, StepResult] = {}
        for slot in slots:
            ok, value = results.get(slot, (False, self._episodes[slot].error))
            out[slot] = value if ok else ("", 0.0, True, self._fail(slot, value))
        return out

    @property
    def pids(self) -> list[int]:
        return [w.process.pid for w in self._workers]

    def close(self) -> None:
        """Stop every worker: ask, wait, then kill; afterwards no worker process is left."""
        for w in range(len(self._workers)):
            self._send(w, "close", [])
        for worker in self._workers:
            worker.process.join(timeout=15)
            _kill(worker)
        self._workers, self._step = [], None

    def __enter__(self) -> EnvPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_workers", None):
            try:
                self.close()
            except Exception:
                pass

    def _dispatch(self, op: str, items: Mapping[int, Any], timeout_s: float) -> dict[int, tuple[bool, Any]]:
        """Send each worker its share of ``items`` and gather one (ok, value) per slot, handling failures."""
        return self._gather(self._send_share(op, items, timeout_s))

    def _send_share(self, op: str, items: Mapping[int, Any], timeout_s: float) -> _Sent:
        """Send each worker its share of ``items`` (slot s to worker s mod n); the timeouts start now."""
        n = len(self._workers)
        queues = {w: deque(s for s in items if s % n == w) for w in range(n)}
        for w, queue in queues.items():
            if queue:
                self._send(w, op, [(s, items[s]) for s in queue])
        return _Sent(op, items, timeout_s, queues, time.monotonic() + timeout_s)

    def _gather(self, sent: _Sent) -> dict[int, tuple[bool, Any]]:
        """One (ok, value) per slot of ``sent``, handling failures.

        A worker times out when no result of its share arrives for ``timeout_s``; time spent rebuilding
        a failed worker does not count against the others.
        """
        op, items, timeout_s, queues = sent.op, sent.items, sent.timeout_s, sent.queues
        deadlines = dict.fromkeys(queues, sent.deadline)
        started: dict[int, int | None] = dict.fromkeys(queues)  # the slot each worker has begun playing
        innocent_restarts = dict.fromkeys(queues, 0)
        results: dict[int, tuple[bool, Any]] = {}
        while any(queues.values()):
            waiting = {self._workers[w].conn: w for w, q in queues.items() if q}
            left = min(deadlines[w] for w in waiting.values()) - time.monotonic()
            for conn in wait(list(waiting), timeout=max(0.0, left)):
                w = waiting[conn]
                try:
                    slot, ok, value = conn.recv()
                except (EOFError, OSError):
                    if started[w] != queues[w][0] and innocent_restarts[w] == 0:
                        innocent_restarts[w] += 1  # died before this episode began: rebuild, resend, blame none
                        self._restart(w)
                        self._send(w, op, [(s, items[s]) for s in queues[w]])
                    else:
                        self._recover(w, queues[w], op, items, results, "worker process died")
                    started[w] = None
                    deadlines = dict.fromkeys(queues, time.monotonic() + timeout_s)
                    continue
                if ok is None:
                    started[w] = slot
                    continue
                queues[w].popleft()
                results[slot] = (ok, value)
                self._record(op, slot, items[slot], ok, value)
                deadlines[w] = time.monotonic() + timeout_s
            for w in waiting.values():
                conn = self._workers[w].conn
                if queues[w] and time.monotonic() > deadlines[w] and not conn.poll(0):
                    self._recover(w, queues[w], op, items, results, f"no answer within {timeout_s:g} s")
                    deadlines = dict.fromkeys(queues, time.monotonic() + timeout_s)
        return results

    def _record(self, op: str, slot: int, payload: Any, ok: bool, value: Any) -> None:
        """What a rebuild needs, kept as results arrive: the action played, the last info, an error."""
        if not ok:
            self._episodes[slot].error = value
        elif op == "step":
            self._episodes[slot].actions.append(payload)
        if ok and op in ("reset", "step", "restore"):
            self._episodes[slot].info = value[-1]

    def _recover(
        self, w: int, queue: deque, op: str, items: Mapping[int, Any], results: dict[int, tuple[bool, Any]], why: str
    ) -> None:
        """Blame the slot in progress, restart worker ``w``, rebuild its other episodes, resend the rest."""
        culprit = queue.popleft()
        results[culprit] = (False, f"{op} failed: {why}")
        self._episodes[culprit].error = results[culprit][1]
        self._restart(w)
        if queue:
            self._send(w, op, [(s, items[s]) for s in queue])

    def _restart(self, w: int) -> None:
        """Replace worker ``w`` and replay its live episodes onto the new one (errors end them)."""
        _kill(self._workers[w])
        self._workers[w] = self._start()
        self.restarts += 1
        n = len(self._workers)
        live = [s for s, ep in self._episodes.items() if s % n == w and not ep.error and ep.info]
        if not live:
            return
        self._send(w, "restore", [(s, (self._episodes[s].task, self._episodes[s].actions)) for s in live])
        deadline = time.monotonic() + self.reset_timeout_s
        for i, slot in enumerate(live):
            ok, value = self._receive(w, deadline)
            if ok:
                self._record("restore", slot, None, ok, value)
                continue
            for lost in live[i:]:
                self._episodes[lost].error = f"lost with its worker: {value}"
            _kill(self._workers[w])
            self._workers[w] = self._start()
            return

    def _receive(self, w: int, deadline: float) -> tuple[bool, Any]:
        """One (ok, value) from worker ``w`` by ``deadline``; a timeout or a dead worker is a failure."""
        conn = self._workers[w].conn
        ok: bool | None = None
        try:
            while ok is None:  # skip the worker's "started" notice; the result follows
                if not conn.poll(max(0.0, deadline - time.monotonic())):
                    return False, "restore timed out"
                _, ok, value = conn.recv()
        except (EOFError, OSError):
            return False, "worker process died while restoring"
        return ok, value

    def _revive_idle(self) -> None:
        """Restart any worker that died between batches; its episodes are rebuilt, none is lost."""
        for w, worker in enumerate(self._workers):
            if not worker.process.is_alive():
                self._restart(w)

    def _fail(self, slot: int, why: str) -> dict[str, Any]:
        episode = self._episodes[slot]
        episode.error = episode.error or why
        return error_info(episode.info, episode.error)

    def _start(self) -> _Worker:
        parent, child = self._context.Pipe()
        process = self._context.Process(target=serve, args=(child, self.suite, self.seed), daemon=True)
        process.start()
        child.close()
        return _Worker(process, parent)

    def _send(self, w: int, op: str, items: list[tuple[int, Any]]) -> None:
        try:
            self._workers[w].conn.send((op, items))
        except OSError:
            pass  # a dead worker: the receive side reports it


def _kill(worker: _Worker) -> None:
    if worker.process.is_alive():
        worker.process.kill()
    worker.process.join(timeout=15)
    worker.conn.close()


def serve(conn: Connection, suite_ref: SuiteRef, seed: int) -> None:
    """Worker loop: build the suite, then answer (op, [(slot, payload), ...]) with, per slot, a
    ``(slot, None, None)`` notice as it starts and then ``(slot, ok, value)``."""
    _die_with_parent()
    from horizonrl.envs import make_suite

    suite = make_suite(suite_ref, seed) if isinstance(suite_ref, str) else suite_ref(seed)
    envs: dict[int, Any] = {}
    spare: list[Any] = []
    while True:
        try:
            op, items = conn.recv()
        except (EOFError, OSError):
            break
        if op == "close":
            break
        if op == "release":
            spare += envs.values()
            envs.clear()
        for slot, payload in items:
            conn.send((slot, None, None))  # "started": from here on, dying is this episode's fault
            try:
                if slot not in envs:
                    envs[slot] = spare.pop() if spare else suite.make()
                conn.send((slot, True, _OPS[op](envs[slot], payload)))
            except Exception:
                conn.send((slot, False, traceback.format_exc(limit=3)))
                close_quietly(envs.pop(slot, None))
    for env in [*envs.values(), *spare]:
        close_quietly(env)


def _restore(env: Any, payload: tuple[Task, list[str]]) -> tuple[str, dict[str, Any]]:
    task, actions = payload
    obs, info = reset_episode(env, task)
    for action in actions:
        obs, _, _, info = step_episode(env, action)
    return obs, info


_OPS: dict[str, Callable[[Any, Any], Any]] = {
    "reset": reset_episode,
    "step": step_episode,
    "restore": _restore,
}


def _die_with_parent() -> None:
    """Exit this worker once its parent process is gone, even if an environment hangs: a daemon thread
    watches the parent pid (PR_SET_PDEATHSIG would fire when the *thread* that started the worker ends,
    and Prefect runs tasks in threads)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()
