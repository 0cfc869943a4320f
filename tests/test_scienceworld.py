"""ScienceWorld suites: the benchmark's splits, bounded JVMs that stop with their last episode, replay,
the gold path, and agent-side keys and labels."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest

from horizonrl.envs import SUITES, make_suite
from horizonrl.envs.base import Env, EnvSuite
from horizonrl.envs.scienceworld_env import (
    TASK_NAMES,
    JvmHost,
    ScienceWorldEnv,
    ScienceWorldSuite,
    _shared_class,
)


def scienceworld_jvms(parents: set[int] | None = None) -> set[int]:
    """Pids of running ScienceWorld JVMs started by ``parents`` (default: this process), so that JVMs of
    other processes on the machine do not count."""
    parents = parents or {os.getpid()}
    pids = set()
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            ppid = int((proc / "stat").read_text().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid in parents and cmdline[0].endswith(b"java") and any(b"scienceworld" in a for a in cmdline):
            pids.add(int(proc.name))
    return pids


def running(pids: set[int]) -> set[int]:
    """Those of ``pids`` still running (zombies count as gone)."""
    alive = set()
    for pid in pids:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z":
                alive.add(pid)
        except OSError:
            pass
    return alive


def wait_until_gone(pids: set[int], timeout_s: float = 15.0) -> set[int]:
    deadline = time.monotonic() + timeout_s
    while running(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return running(pids)


@pytest.fixture(scope="module")
def boil():
    suite = ScienceWorldSuite("boil")
    yield suite
    assert not suite.host.pids  # every test closed its environments


def _random_trace(env: ScienceWorldEnv, task, seed: int, turns: int = 8) -> list:
    rng = random.Random(seed)
    observation, info = env.reset(task)
    trace = [(observation, info)]
    for turn in range(turns):
        commands = [c for c in info["admissible_commands"] if not c.startswith("focus on")]
        action = "dance wildly" if turn == 3 else rng.choice(commands)
        trace.append((action, *env.step(action)))
    return trace


def test_every_task_is_a_registered_suite():
    from scienceworld.constants import ID2TASK

    assert TASK_NAMES == tuple(ID2TASK.values())
    assert all(f"scienceworld-{task}" in SUITES for task in TASK_NAMES)
    suite = make_suite("scienceworld-boil", 0)
    assert isinstance(suite, EnvSuite) and isinstance(suite.make(), Env) and suite.name == "scienceworld-boil"
    assert [suite.max_turns(t) for t in ("easy", "medium", "hard")] == [60, 80, 100]
    with pytest.raises(ValueError):
        suite.tasks("train", "openDoors+flying", 1)


def test_splits_are_the_benchmarks_own_variation_splits(boil):
    lists = {split: boil.variations(split) for split in ("train", "dev", "test")}
    assert (len(lists["train"]), len(lists["dev"]), len(lists["test"])) == (14, 7, 9)  # boil, as ScienceWorld ships it
    assert sorted(sum(lists.values(), [])) == list(range(30))
    tasks = boil.tasks("train", "easy", 100)
    assert sorted(t.seed for t in tasks) == sorted(lists["train"]) and [t.index for t in tasks] == list(range(14))
    assert boil.tasks("train", "easy", 3, offset=2) == tasks[2:5]
    other = ScienceWorldSuite("boil", seed=1, host=boil.host)
    assert [t.seed for t in other.tasks("train", "easy", 14)] != [t.seed for t in tasks]


def test_each_episode_has_a_memory_bounded_jvm_stopped_when_it_closes(boil):
    before = scienceworld_jvms()
    first, second = boil.make(), boil.make()
    first.reset(boil.tasks("train", "easy", 1)[0])
    (pid,) = boil.host.pids
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    assert b"-Xmx384m" in cmdline and b"-XX:+UseSerialGC" in cmdline
    first.reset(boil.tasks("train", "easy", 2)[1])
    assert boil.host.pids == [pid]  # a new episode reuses its environment's JVM
    second.reset(boil.tasks("dev", "easy", 1)[0])
    pids = set(boil.host.pids)
    assert len(pids) == 2 and pids - before == pids
    first.close()
    assert not wait_until_gone({pid}) and boil.host.pids == list(pids - {pid})
    second.close()
    assert not boil.host.pids and not wait_until_gone(pids)
    assert scienceworld_jvms() <= before


def test_a_shared_jvm_stops_with_its_last_simulator():
    host = JvmHost(per_jvm=2)
    suite = ScienceWorldSuite("melt", host=host)
    envs = [suite.make() for _ in range(2)]
    for env in envs:
        env.reset(suite.tasks("train", "easy", 1)[0])
    (pid,) = host.pids
    envs[0].close()
    assert host.pids == [pid]
    envs[1].close()
    assert not host.pids and not wait_until_gone({pid})


def test_replay_is_identical_with_interleaved_episodes(boil, monkeypatch):
    """An episode replays identically while another one is loaded after it and stepped in between; the
    valid actions come from the step info, never from the full enumeration."""
    monkeypatch.setattr(
        _shared_class(), "get_possible_action_object_combinations", lambda self: pytest.fail("enumerated")
    )
    task = boil.tasks("train", "hard", 1)[0]
    first, second = boil.make(), boil.make()
    reference = _random_trace(first, task, seed=5)
    trace = [second.reset(task)]
    first.reset(boil.tasks("test", "easy", 1)[0])  # another episode, loaded after this one
    for step in reference[1:]:
        first.step("look around")
        trace.append((step[0], *second.step(step[0])))
    assert trace == reference
    assert not reference[4][4]["valid"] and reference[4][1]  # 'dance wildly' is answered, flagged invalid
    for env in (first, second):
        env.close()


def test_gold_path_wins_and_keys_use_no_gold_path(boil, monkeypatch):
    env = boil.make()
    task = boil.tasks("train", "easy", 1)[0]
    observation, info = env.reset(task)
    assert observation.startswith(info["goal"]) and "boil" in info["goal"]
    plan = env.walkthrough()  # from a second simulator: this episode is untouched
    monkeypatch.setattr(_shared_class(), "get_gold_action_sequence", lambda self: pytest.fail("gold path read"))
    keys, labels = [info["progress_key"]], []
    for action in plan:
        labels.append(env.abstract_action(action))
        observation, reward, done, info = env.step(action)
        keys.append(info["progress_key"])
        if done:
            break
    assert info["won"] and info["score"] == 1.0 and reward == 1.0
    assert keys[0] == "sw_v1|boil|score=0|focus=0" and keys[-1] == "sw_v1|boil|score=100|focus=1"
    assert all(" " not in key for key in keys) and len(set(keys)) >= 4
    focus = next(i for i, a in enumerate(plan) if a.startswith("focus on"))
    assert labels[focus] == "FOCUS_ON_GOAL" and "focus=1" in keys[focus + 1] and "focus=0" in keys[focus]
    env.close()


def test_a_wrong_focus_loses_with_zero_score(boil):
    env = boil.make()
    _, info = env.reset(boil.tasks("train", "easy", 1)[0])
    assert "air" not in info["goal"] and env.abstract_action("focus on air") == "FOCUS_ON_OTHER"
    _, reward, done, info = env.step("focus on air")
    assert (reward, done, info["won"], info["lost"], info["score"]) == (0.0, True, False, True, 0.0)
    env.close()


def test_no_jvm_is_left_when_the_python_process_dies():
    """die_on_exit: a JVM exits once the process that launched it is gone, even if killed."""
    import subprocess
    import sys

    code = (
        "from horizonrl.envs.scienceworld_env import ScienceWorldSuite as S; s = S('boil'); e = s.make(); "
        "e.reset(s.tasks('train','easy',1)[0]); print(s.host.pids[0], flush=True); import time; time.sleep(60)"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    pid = int(child.stdout.readline())
    assert pid in scienceworld_jvms({child.pid})
    child.kill()
    child.wait()
    assert not wait_until_gone({pid})
