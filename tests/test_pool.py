"""EnvPool: the same results as stepping in-process; a crash, a hang, an exception and a killed worker
end only their own episode (or none); close() leaves no worker process (and no JVM) behind."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest

from horizonrl.envs.batch import InProcess
from horizonrl.envs.household import HouseholdEnv, HouseholdSuite
from horizonrl.envs.pool import EnvPool

N_EPISODES = 6


class FaultyEnv(HouseholdEnv):
    """A household env that crashes its process, hangs or raises on request."""

    def step(self, action: str):
        if action == "crash":
            os.kill(os.getpid(), signal.SIGKILL)
        if action == "hang":
            time.sleep(3600)
        if action == "raise":
            raise ValueError("boom")
        return super().step(action)


class FaultySuite(HouseholdSuite):
    def make(self) -> FaultyEnv:
        return FaultyEnv()


def faulty_suite(seed: int) -> FaultySuite:
    """Picklable factory: the worker imports this module and calls it."""
    return FaultySuite(seed)


def _tasks():
    return HouseholdSuite(seed=0).tasks("train", "easy", N_EPISODES)


def _plan(turns: int = 6) -> list[dict[int, str]]:
    """A fixed action script per turn and slot, replayed by the reference and by the pool."""
    envs = [HouseholdEnv() for _ in range(N_EPISODES)]
    infos = {slot: env.reset(task)[1] for slot, (env, task) in enumerate(zip(envs, _tasks()))}
    rng, plan = random.Random(0), []
    for _ in range(turns):
        actions = {slot: rng.choice(infos[slot]["admissible_commands"]) for slot in infos}
        infos = {slot: envs[slot].step(a)[3] for slot, a in actions.items()}
        plan.append(actions)
    return plan


def _reference(plan: list[dict[int, str]]) -> list[dict[int, tuple]]:
    """The same episodes stepped one after another in this process, labels added as the pool adds them."""
    envs = [HouseholdEnv() for _ in range(N_EPISODES)]
    for env, task in zip(envs, _tasks()):
        env.reset(task)
    out = []
    for actions in plan:
        turn = {}
        for slot, action in actions.items():
            label = envs[slot].abstract_action(action)
            obs, reward, done, info = envs[slot].step(action)
            turn[slot] = (obs, float(reward), done, {**info, "abstract_action": label})
        out.append(turn)
    return out


def _starts() -> list[tuple[str, dict]]:
    """What reset_many answers: each episode's first observation, its goal added to the info."""
    out = []
    for task in _tasks():
        env = HouseholdEnv()
        obs, info = env.reset(task)
        out.append((obs, {**info, "goal": env.goal()}))
    return out


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, reaped or not, counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def plan():
    return _plan()


def test_pool_matches_in_process_stepping_and_closes_cleanly(plan):
    pool = EnvPool("household", 0, n_workers=2)
    pids = pool.pids
    starts = pool.reset_many(_tasks())
    assert starts == _starts()
    assert [pool.step_many(actions) for actions in plan] == _reference(plan)
    assert pool.restarts == 0
    pool.close()
    assert not any(_alive(pid) for pid in pids)
    with InProcess(HouseholdSuite(seed=0)) as local:  # the in-process batch answers the same
        assert local.reset_many(_tasks()) == _starts()
        assert [local.step_many(actions) for actions in plan] == _reference(plan)


@pytest.mark.parametrize("fault,timeout_s", [("crash", 30.0), ("hang", 1.5), ("raise", 30.0)])
def test_a_faulty_episode_ends_as_an_error_and_the_batch_goes_on(plan, fault, timeout_s):
    reference = _reference(plan)
    with EnvPool(faulty_suite, 0, n_workers=2, step_timeout_s=timeout_s) as pool:
        pool.reset_many(_tasks())
        bad = 2  # on worker 0, with slot 0 before it (already stepped) and slot 4 after it (still queued)
        for turn, actions in enumerate(plan):
            sent = {**actions, bad: fault} if turn == 2 else actions
            start = time.monotonic()
            results = pool.step_many(sent)
            assert time.monotonic() - start < timeout_s + 10
            for slot, (obs, reward, done, info) in results.items():
                if slot == bad and turn >= 2:
                    assert (obs, reward, done, info["won"], info["admissible_commands"]) == ("", 0.0, True, False, [])
                    assert ("boom" if fault == "raise" else "failed") in info["error"]
                else:
                    assert (obs, reward, done, info) == reference[turn][slot]
        assert pool.restarts == (0 if fault == "raise" else 1)
        pids = pool.pids
    assert not any(_alive(pid) for pid in pids)


def test_a_worker_killed_between_batches_is_restarted_and_loses_no_episode(plan):
    reference = _reference(plan)
    with EnvPool("household", 0, n_workers=2) as pool:
        pool.reset_many(_tasks())
        for turn, actions in enumerate(plan):
            if turn == 3:
                victim = pool.pids[1]
                os.kill(victim, signal.SIGKILL)
                while _alive(victim):
                    time.sleep(0.05)
            assert pool.step_many(actions) == reference[turn]
        assert pool.restarts == 1 and victim not in pool.pids
        pids = pool.pids
    assert not any(_alive(pid) for pid in pids + [victim])


def test_reset_many_reuses_workers_for_a_new_batch(plan):
    with EnvPool("household", 0, n_workers=2) as pool:
        pool.reset_many(_tasks()[:3])
        pool.step_many({0: plan[0][0]})
        starts = pool.reset_many(_tasks())
        assert starts == _starts()
        assert pool.step_many(plan[0]) == _reference(plan)[0]


def test_scienceworld_pool_leaves_no_jvm_behind():
    from test_scienceworld import scienceworld_jvms, wait_until_gone

    from horizonrl.envs.scienceworld_env import ScienceWorldSuite

    tasks = ScienceWorldSuite("boil").tasks("train", "easy", 3)
    with EnvPool("scienceworld-boil", 0, n_workers=2) as pool:
        infos = [info for _, info in pool.reset_many(tasks)]
        jvms = scienceworld_jvms(set(pool.pids))
        assert len(jvms) == 3  # one per episode, started by the workers
        victim = pool.pids[0]
        os.kill(victim, signal.SIGKILL)  # its two episodes (slots 0 and 2) are rebuilt by replay
        while _alive(victim):
            time.sleep(0.05)
        results = pool.step_many({slot: info["admissible_commands"][0] for slot, info in enumerate(infos)})
        errors = [results[slot][3].get("error", "") for slot in range(3)]
        # No episode is lost: the killed worker had not started on this batch (even if its threads were
        # still exiting when the batch was sent), so its episodes are rebuilt, not blamed.
        assert errors == ["", "", ""], errors
        assert pool.restarts == 1
        jvms |= scienceworld_jvms(set(pool.pids))
        assert len(jvms) == 5  # the killed worker's two JVMs, then two more on its replacement
    assert not wait_until_gone(jvms)
