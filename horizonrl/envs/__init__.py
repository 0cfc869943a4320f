"""Environment suites by name. Factories import their module lazily, so an optional package
(TextWorld, ScienceWorld) is needed only when its suite is used."""

from __future__ import annotations

from typing import Callable

from horizonrl.envs.base import Env, EnvSuite, Task


def _household(seed: int) -> EnvSuite:
    from horizonrl.envs.household import HouseholdSuite

    return HouseholdSuite(seed=seed)


SUITES: dict[str, Callable[[int], EnvSuite]] = {"household": _household}


def make_suite(name: str, seed: int = 0) -> EnvSuite:
    if name not in SUITES:
        raise ValueError(f"env.name = {name!r} is unknown; known: {', '.join(sorted(SUITES))}")
    return SUITES[name](seed)


__all__ = ["Env", "EnvSuite", "Task", "SUITES", "make_suite"]
