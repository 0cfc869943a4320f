"""ScienceWorld tasks (``scienceworld-<task>``, e.g. ``scienceworld-boil``) on memory-bounded JVMs.

Each ScienceWorld task has variations split by the benchmark itself into train, dev and test
(``get_variations_train/dev/test``); a suite's split lists exactly those, in an order fixed by the
suite seed. Tiers are simplification strings: ``easy`` (the benchmark's own "easy": teleport, open
doors, self-watering pots and, except for electrical tasks, no electrical actions), ``medium`` (open
doors and containers), ``hard`` (none, the paper's setting), or an explicit list such as
``openDoors+teleportAction``.

The simulator is Scala behind py4j. ``scienceworld`` 1.2.3 launches its JVM with no options, so
``JvmHost`` launches it through py4j's ``launch_gateway(javaopts=...)`` with ``-Xmx384m
-XX:+UseSerialGC`` and ``die_on_exit`` (the JVM exits when this process's stdin pipe to it closes,
even if the process is killed), and stops it when its environment closes. One JVM could host several
simulator objects (``PythonInterface``, about 10 MB of heap each), but they share one random stream
that every ``load`` reseeds: an episode loaded after another changes the other's dynamics (measured),
which breaks replay. So each environment gets its own JVM (``SIMULATORS_PER_JVM = 1``; measured
0.23 GB resident after 60 steps of ``boil``); ``JvmHost(per_jvm=n)`` trades that determinism for
memory. Steps go through the benchmark's own ``ScienceWorldEnv.step``, whose ``info["valid"]`` lists
the valid action-object combinations (26-29 ms a step measured on an idle core); the full
enumeration ``get_possible_action_object_combinations`` is never called.

Score is ScienceWorld's 0-100 sub-goal score (negative when the task failed, e.g. focusing on the
wrong object); ``info["score"] = max(score, 0) / 100``, won iff score reaches 100, reward 1 on that
turn. The progress key reads the reported score and whether the agent has focused on something; the
action label reads the verb and whether its object is named in the task description.
"""

from __future__ import annotations

import functools
import logging
import random
import threading
from dataclasses import dataclass, field
from typing import Any

from horizonrl.envs.base import Task, played_lines
from horizonrl.envs.progress import action_label, content_words, game_info, render_key, tidy
from horizonrl.seeding import derive_seed

TASK_NAMES = (
    "boil",
    "melt",
    "freeze",
    "change-the-state-of-matter-of",
    "use-thermometer",
    "measure-melting-point-known-substance",
    "measure-melting-point-unknown-substance",
    "power-component",
    "power-component-renewable-vs-nonrenewable-energy",
    "test-conductivity",
    "test-conductivity-of-unknown-substances",
    "find-living-thing",
    "find-non-living-thing",
    "find-plant",
    "find-animal",
    "grow-plant",
    "grow-fruit",
    "chemistry-mix",
    "chemistry-mix-paint-secondary-color",
    "chemistry-mix-paint-tertiary-color",
    "lifespan-longest-lived",
    "lifespan-shortest-lived",
    "lifespan-longest-lived-then-shortest-lived",
    "identify-life-stages-1",
    "identify-life-stages-2",
    "inclined-plane-determine-angle",
    "inclined-plane-friction-named-surfaces",
    "inclined-plane-friction-unnamed-surfaces",
    "mendelian-genetics-known-plant",
    "mendelian-genetics-unknown-plant",
)  # scienceworld.constants.ID2TASK's values (checked by a test)
SPLITS = ("train", "dev", "test")
TIERS = {"easy": ("easy", 60), "medium": ("openDoors,openContainers", 80), "hard": ("", 100)}
SIMPLIFICATIONS = ("teleportAction", "selfWateringFlowerPots", "openContainers", "openDoors", "noElectricalAction")
JVM_OPTIONS = ("-Xmx384m", "-XX:+UseSerialGC")
SIMULATORS_PER_JVM = 1  # simulators sharing a JVM share its random stream (see above)
STEP_LIMIT = 100_000  # the benchmark's own step limit ends episodes; horizons are the caller's (max_turns)
VERBS = (
    "open",
    "close",
    "activate",
    "deactivate",
    "connect",
    "disconnect",
    "dunk",
    "eat",
    "flush",
    "focus on",
    "go to",
    "look around",
    "look at",
    "look in",
    "mix",
    "move",
    "pick up",
    "pour",
    "put down",
    "read",
    "teleport to",
    "use",
    "wait1",
    "wait",
    "inventory",
    "task",
    "drop",
)


_log = logging.getLogger(__name__)  # reaches the terminal and Prefect through PREFECT_LOGGING_EXTRA_LOGGERS=horizonrl


def simplification(tier: str) -> str:
    """The simplification string of a tier: a preset, or names joined by '+' or ','."""
    if tier in TIERS:
        return TIERS[tier][0]
    names = tier.replace("+", ",").split(",")
    unknown = [n for n in names if n not in SIMPLIFICATIONS]
    if unknown:
        raise ValueError(
            f"scienceworld: tier {tier!r} is neither {tuple(TIERS)} nor simplifications "
            f"joined by '+' from {SIMPLIFICATIONS}"
        )
    return ",".join(names)


@dataclass
class _Jvm:
    gateway: Any
    process: Any
    simulators: int = 0


class JvmHost:
    """The JVMs of one process: at most ``per_jvm`` simulators each, a JVM stopped with its last one.

    Thread-safe; the suite holds one, so the JVMs of a process are counted and stopped in one place.
    """

    def __init__(self, options: tuple[str, ...] = JVM_OPTIONS, per_jvm: int = SIMULATORS_PER_JVM) -> None:
        self.options, self.per_jvm = options, per_jvm
        self._jvms: list[_Jvm] = []
        self._lock = threading.Lock()

    def acquire(self) -> tuple[_Jvm, Any]:
        """A fresh simulator object (``PythonInterface``) on a JVM with room for it."""
        with self._lock:
            jvm = next((j for j in self._jvms if j.simulators < self.per_jvm), None)
            if jvm is None:
                jvm = self._start()
                self._jvms.append(jvm)
            jvm.simulators += 1
        return jvm, jvm.gateway.jvm.scienceworld.runtime.pythonapi.PythonInterface()

    def release(self, jvm: _Jvm, server: Any) -> None:
        with self._lock:
            jvm.simulators -= 1
            if jvm.simulators == 0:
                self._jvms.remove(jvm)
                _stop(jvm)
            else:
                jvm.gateway.detach(server)

    @property
    def pids(self) -> list[int]:
        return [j.process.pid for j in self._jvms]

    def _start(self) -> _Jvm:
        try:
            from py4j.java_gateway import GatewayParameters, JavaGateway, launch_gateway
            from scienceworld.constants import BASEPATH, JAR_PATH
        except ImportError as err:
            raise RuntimeError(
                "scienceworld suites need the extra: `pip install -e '.[scienceworld]'` "
                "(scienceworld==1.2.3) and Java 17 on PATH"
            ) from err
        _log.info(
            "ScienceWorld: starting a Java simulator (JVM %d of this process, a few seconds)", len(self._jvms) + 1
        )
        port, process = launch_gateway(
            classpath=JAR_PATH, die_on_exit=True, cwd=BASEPATH, javaopts=list(self.options), return_proc=True
        )
        gateway = JavaGateway(gateway_parameters=GatewayParameters(auto_field=True, port=port), java_process=process)
        return _Jvm(gateway, process)


def _stop(jvm: _Jvm) -> None:
    """Shut the gateway, close the JVM's stdin (``die_on_exit``), wait; kill it if it lingers."""
    try:
        jvm.gateway.shutdown()
    finally:
        try:
            jvm.process.stdin.write(b"\n")
            jvm.process.stdin.close()
        except OSError:
            pass
        try:
            jvm.process.wait(timeout=10)
        except Exception:
            jvm.process.kill()
            jvm.process.wait(timeout=10)


def _simulator(gateway: Any, server: Any) -> Any:
    """The benchmark's ``ScienceWorldEnv`` bound to a simulator on a shared JVM (no JVM of its own)."""
    sim = _shared_class()()
    sim._gateway, sim.server = gateway, server
    sim.lastStepScore, sim.taskName, sim.envStepLimit = 0, None, STEP_LIMIT
    sim.goldPathGenerated, sim.runHistories = False, {}
    return sim


@functools.cache
def _shared_class() -> type:
    """``ScienceWorldEnv`` minus its JVM: no launch in ``__init__``, no shutdown in ``close``/``__del__``
    (``JvmHost.release`` owns the JVM). Built on first use so that importing this module needs no
    scienceworld."""
    from scienceworld import ScienceWorldEnv as Benchmark

    def _nothing(self: Any) -> None:
        pass

    return type("SharedScienceWorldEnv", (Benchmark,), {"__init__": _nothing, "close": _nothing, "__del__": _nothing})


@dataclass
class Tracker:
    """What the agent knows: the task description, the reported score, whether it has focused."""

    description: str = ""
    score: int = 0
    focused: bool = False
    goal_words: frozenset[str] = field(default_factory=frozenset)

    def observe(self, observation: str, score: int) -> None:
        self.score = score
        self.focused = self.focused or observation.startswith("You focus on")


def progress_key(task_name: str, tracker: Tracker) -> str:
    """'sw_v1|boil|score=25|focus=1': ScienceWorld's sub-goal score so far and the focus flag."""
    return render_key(f"sw_v1|{task_name}", {"score": tracker.score, "focus": tracker.focused})


class ScienceWorldEnv:
    """One ScienceWorld episode on a simulator borrowed from the suite's ``JvmHost``."""

    def __init__(self, task_name: str, host: JvmHost) -> None:
        self.task_name, self.host = task_name, host
        self._lease: tuple[_Jvm, Any] | None = None
        self._sim: Any = None
        self._task: Task | None = None
        self._tracker = Tracker()
        self._obs, self._info, self._done = "", {}, False

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        if self._sim is None:
            self._lease = self.host.acquire()
            self._sim = _simulator(self._lease[0].gateway, self._lease[1])
        self._task = task
        self._sim.load(self.task_name, task.seed, simplification(task.tier), False)
        observation, info = self._sim.reset()
        description = tidy(info["taskDesc"])
        self._tracker = Tracker(description=description, goal_words=content_words(description))
        self._done = False
        self._obs = description + "\n" + tidy(observation)
        self._info = self._info_of(info, valid=True)
        return self._obs, self._info

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        if self._done:
            return self._obs, 0.0, True, {**self._info, "valid": False}
        command = " ".join(action.split())
        valid = command in self._info["admissible_commands"]
        observation, _, completed, info = self._sim.step(command)
        self._obs = tidy(observation)
        self._tracker.observe(observation, int(info["score"]))
        self._info = self._info_of(info, valid)
        self._done = bool(completed) or self._info["won"] or self._info["lost"]
        return self._obs, float(self._info["won"]), self._done, self._info

    def _info_of(self, info: dict[str, Any], valid: bool) -> dict[str, Any]:
        score, key = int(info["score"]), progress_key(self.task_name, self._tracker)
        clipped = max(0, min(score, 100)) / 100
        return game_info(score >= 100, score < 0, set(info["valid"]), valid, clipped, key, self.task_name, self.goal())

    def goal(self) -> str:
        return self._tracker.description

    def abstract_action(self, action: str) -> str:
        return action_label(action, VERBS, self._tracker.goal_words)

    def walkthrough(self) -> list[str]:
        """The benchmark's gold path, from a second simulator (so this episode's state is untouched)."""
        if self._task is None:
            raise RuntimeError("ScienceWorldEnv: call reset() first")
        jvm, server = self.host.acquire()
        try:
            oracle = _simulator(jvm.gateway, server)
            oracle.load(self.task_name, self._task.seed, simplification(self._task.tier), True)
            return list(oracle.get_gold_action_sequence())
        finally:
            self.host.release(jvm, server)

    def close(self) -> None:
        if self._lease is not None:
            self.host.release(*self._lease)
            self._lease, self._sim = None, None


# (task, suite seed, variations per tier, tier) -> a corpus played in this process (``ScienceWorldSuite.corpus``)
_CORPORA: dict[tuple[str, int, int, str], tuple[str, ...]] = {}


class ScienceWorldSuite:
    """One ScienceWorld task; splits are the benchmark's own variation splits, shuffled by the seed."""

    def __init__(self, task_name: str, seed: int = 0, host: JvmHost | None = None) -> None:
        if task_name not in TASK_NAMES:
            raise ValueError(f"scienceworld: unknown task {task_name!r}; known: {', '.join(TASK_NAMES)}")
        self.task_name, self.seed = task_name, seed
        self.name = f"scienceworld-{task_name}"
        self.host = host or JvmHost()
        self._variations: dict[str, list[int]] = {}

    def variations(self, split: str) -> list[int]:
        """The benchmark's variation indices of ``split`` (read once from a simulator)."""
        if split not in SPLITS:
            raise ValueError(f"{self.name}: split must be one of {SPLITS}")
        if not self._variations:
            jvm, server = self.host.acquire()
            try:
                server.load(self.task_name, 0, "", False)
                lists = (server.getVariationsTrain(), server.getVariationsDev(), server.getVariationsTest())
                self._variations = {s: [int(v) for v in vs] for s, vs in zip(SPLITS, lists)}
            finally:
                self.host.release(jvm, server)
        return self._variations[split]

    def tasks(self, split: str, tier: str, n: int, offset: int = 0) -> list[Task]:
        """The first ``n`` tasks of the split; fewer when the split has fewer variations."""
        simplification(tier)
        order = list(self.variations(split))
        random.Random(derive_seed(self.seed, self.name, split)).shuffle(order)
        chosen = order[offset : offset + n]
        return [Task(self.name, split, tier, offset + i, v, self.task_name) for i, v in enumerate(chosen)]

    def make(self) -> ScienceWorldEnv:
        return ScienceWorldEnv(self.task_name, self.host)

    def max_turns(self, tier: str) -> int:
        return TIERS[tier][1] if tier in TIERS else TIERS["hard"][1]

    def corpus(self, n_tasks: int = 200, n_variations: int = 4, tier: str = "easy") -> list[str]:
        """Task descriptions, observations and valid actions of gold-path and random play on a few train
        variations of the easy tier and, when ``tier`` is another, of ``tier`` too. Played once per process
        and arguments (seconds of the simulator's time), as every run the process starts needs it."""
        n = min(n_tasks, n_variations)
        key = (self.task_name, self.seed, n, tier)
        if key not in _CORPORA:
            _CORPORA[key] = tuple(self._play_corpus(n, tier))
        return list(_CORPORA[key])

    def _play_corpus(self, n: int, tier: str) -> list[str]:
        env, lines = self.make(), []
        tasks = [t for tr in dict.fromkeys(("easy", tier)) for t in self.tasks("train", tr, n)]
        try:
            for task in tasks:
                for oracle in (True, False):
                    lines += played_lines(env, task, oracle)
        finally:
            env.close()
        return list(dict.fromkeys(lines))
