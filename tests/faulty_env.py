"""A household environment with a fault injected on the first step of chosen tasks (a test double of
the failure only). Its own small module, so that pool workers, which import it to build the suite,
start in a fraction of a second instead of importing a whole test module."""

from __future__ import annotations

import os
import signal
import time

from horizonrl.envs.household import HouseholdEnv, HouseholdSuite

# task index -> the fault its episodes hit on their first step
FAULTS = {1: "raise", 2: "garbage", 3: "crash", 4: "hang"}


class FaultyEnv(HouseholdEnv):
    """Household, with the fault of ``FAULTS[task.index]`` on its first step."""

    fault = ""

    def reset(self, task):
        self.fault = FAULTS.get(task.index, "")
        return super().reset(task)

    def step(self, action: str):
        fault, self.fault = self.fault, ""
        if fault == "raise":
            raise ValueError("injected")
        if fault == "garbage":
            return None
        if fault == "crash":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault == "hang":
            time.sleep(3600)
        return super().step(action)


class FaultySuite(HouseholdSuite):
    def make(self) -> FaultyEnv:
        return FaultyEnv()

    def corpus(self, n_tasks: int = 200) -> list[str]:
        """The plain household corpus (the tokenizer is built by playing tasks, faults aside)."""
        return HouseholdSuite(self.seed).corpus(n_tasks)


def faulty_suite(seed: int) -> FaultySuite:
    """Picklable factory for the pool's workers."""
    return FaultySuite(seed)
