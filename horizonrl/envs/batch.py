"""A batch of episodes addressed by slot: the one interface the rollout loop steps environments through.

Two implementations share it: ``InProcess`` steps the episodes one after another in this process, and
``horizonrl.envs.pool.EnvPool`` steps them in worker processes. Both

* return, from ``reset_many(tasks)``, one ``(observation, info)`` per task, slot i playing ``tasks[i]``,
  with ``info["goal"]`` set (the rollout loop builds the system prompt from it);
* return, from ``step_many({slot: action})``, ``(observation, reward, done, info)`` per slot with
  ``info["abstract_action"]`` (the goal-relative label of the action, taken *before* it was played);
* split that step in two, so the caller can work while the environments step: ``step_start(actions)``
  sends and returns, ``step_finish()`` waits for that step's results (``step_many`` is the two in a
  row). At most one step is in flight; any other order raises ``RuntimeError``;
* end an episode whose environment raises or answers with something that is not a step result:
  ``done=True`` and ``info["error"]`` says why; the other episodes go on. The pool also ends an episode
  whose environment crashes its process or hangs past its timeout.

Results are identical between the two for deterministic environments, so the choice is only about speed.
"""

from __future__ import annotations

import traceback
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

from horizonrl.envs.base import Env, EnvSuite, Task

StepResult = tuple[str, float, bool, dict[str, Any]]


class EpisodeBatch(Protocol):
    def reset_many(self, tasks: Sequence[Task]) -> list[tuple[str, dict[str, Any]]]: ...

    def step_many(self, actions: Mapping[int, str]) -> dict[int, StepResult]: ...

    def step_start(self, actions: Mapping[int, str]) -> None: ...

    def step_finish(self) -> dict[int, StepResult]: ...

    def close(self) -> None: ...


def reset_episode(env: Env, task: Task) -> tuple[str, dict[str, Any]]:
    """``env.reset`` checked, with the goal added to the info."""
    result = env.reset(task)
    if not (
        isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], str) and isinstance(result[1], dict)
    ):
        raise TypeError(f"reset returned {_brief(result)}, not (observation: str, info: dict)")
    obs, info = result
    return obs, {**_checked_info(info), "goal": env.goal()}


def step_episode(env: Env, action: str) -> StepResult:
    """``env.step`` checked (a garbage answer raises ``TypeError`` naming what came back), labelled with
    the abstract action of ``action`` in the state it was chosen in."""
    label = env.abstract_action(action)
    result = env.step(action)
    if not (
        isinstance(result, tuple) and len(result) == 4 and isinstance(result[0], str) and isinstance(result[3], dict)
    ):
        raise TypeError(f"step returned {_brief(result)}, not (observation, reward, done, info)")
    obs, reward, done, info = result
    try:
        reward = float(reward)
    except (TypeError, ValueError):
        raise TypeError(f"step returned reward {_brief(reward)}, not a number") from None
    if reward != reward or reward in (float("inf"), float("-inf")):
        raise TypeError(f"step returned reward {reward}, not a finite number")
    return obs, reward, bool(done), {**_checked_info(info), "abstract_action": label}


def check_step_order(call: str, in_flight: bool) -> None:
    """At most one step in flight: ``step_finish`` needs one; ``step_start``, ``reset_many`` and the
    like need none (their results would interleave with the step's)."""
    if call == "step_finish" and not in_flight:
        raise RuntimeError("step_finish with no step in flight: call step_start first")
    if call != "step_finish" and in_flight:
        raise RuntimeError(f"{call} while a step is in flight: call step_finish first")


def error_info(last_info: Mapping[str, Any], why: str) -> dict[str, Any]:
    """The info of an episode ended by an error: its last progress, no commands, ``error`` set."""
    return {**last_info, "won": False, "admissible_commands": [], "valid": False, "error": why}


class InProcess:
    """Episodes stepped one after another in this process. Environments are kept between batches and
    reset to the next task (as the pool's workers do), so JVMs and loaded games stay warm; one that
    failed is closed and replaced."""

    def __init__(self, suite: EnvSuite) -> None:
        self.suite = suite
        self._envs: dict[int, Env] = {}
        self._infos: dict[int, dict[str, Any]] = {}
        self._errors: dict[int, str] = {}
        self._sent: dict[int, str] | None = None  # the step in flight

    def reset_many(self, tasks: Sequence[Task]) -> list[tuple[str, dict[str, Any]]]:
        check_step_order("reset_many", self._sent is not None)
        for slot in self._errors:
            close_quietly(self._envs.pop(slot, None))
        spare = list(self._envs.values())
        self._envs, self._infos, self._errors = {}, {}, {}
        out = []
        for slot, task in enumerate(tasks):
            try:
                self._envs[slot] = spare.pop() if spare else self.suite.make()
                obs, info = reset_episode(self._envs[slot], task)
            except Exception:
                obs, info = "", self._fail(slot, f"reset failed: {traceback.format_exc(limit=3)}")
            self._infos[slot] = info
            out.append((obs, info))
        for env in spare:
            close_quietly(env)
        return out

    def step_many(self, actions: Mapping[int, str]) -> dict[int, StepResult]:
        self.step_start(actions)
        return self.step_finish()

    def step_start(self, actions: Mapping[int, str]) -> None:
        """Only keeps ``actions``: one process has nothing to overlap, so ``step_finish`` steps them."""
        check_step_order("step_start", self._sent is not None)
        self._sent = dict(actions)

    def step_finish(self) -> dict[int, StepResult]:
        check_step_order("step_finish", self._sent is not None)
        actions, self._sent = self._sent, None
        out: dict[int, StepResult] = {}
        for slot, action in actions.items():
            if slot in self._errors:
                out[slot] = ("", 0.0, True, error_info(self._infos[slot], self._errors[slot]))
                continue
            try:
                out[slot] = step_episode(self._envs[slot], action)
                self._infos[slot] = out[slot][3]
            except Exception:
                out[slot] = ("", 0.0, True, self._fail(slot, f"step failed: {traceback.format_exc(limit=3)}"))
        return out

    def close(self) -> None:
        for env in self._envs.values():
            close_quietly(env)
        self._envs, self._infos, self._errors, self._sent = {}, {}, {}, None

    def _fail(self, slot: int, why: str) -> dict[str, Any]:
        self._errors[slot] = why
        return error_info(self._infos.get(slot, {}), why)

    def __enter__(self) -> InProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextmanager
def as_batch(envs: EpisodeBatch | EnvSuite) -> Iterator[EpisodeBatch]:
    """``envs`` itself if it is a batch (the caller keeps it open), else its suite played ``InProcess`` for
    the block and closed after it."""
    if isinstance(envs, EnvSuite):
        with InProcess(envs) as batch:
            yield batch
    else:
        yield envs


def close_quietly(env: Env | None) -> None:
    try:
        if env is not None:
            env.close()
    except Exception:
        pass


def _checked_info(info: dict[str, Any]) -> dict[str, Any]:
    commands = info.get("admissible_commands")
    if not isinstance(commands, list):
        raise TypeError(f"info['admissible_commands'] is {_brief(commands)}, not a list of commands")
    return info


def _brief(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:80]}{'...' if len(text) > 80 else ''}"
