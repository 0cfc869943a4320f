"""``household``: an ALFWorld-like multi-room text world generated from a seed (rules in ``household_world``).

Besides the game, this module holds the agent-side half that BLPO needs (docs/algorithms.md §2.3-2.4):

* ``Tracker``: ALFWorld's role_v1 ``TargetState``, updated only from the goal, the admissible
  commands the agent played and the observations it got back. It never reads the world.
* ``progress_key(goal, tracker)``: the role_v1 key rendered as an entity-free string, e.g.
  ``role_v1|pick_and_place|place:role=unknown,held=0,near=0,seen=0,dest_seen=0,stage=0|done=0``.
* ``abstract_action_label(goal, tracker, action)``: goal-relative labels such as ``NAVIGATE_DESTINATION``.

Two choices go beyond the released role_v1 tracker. Objects listed in an observation count as seen
(role_v1 only counts objects the agent took or put), as the spec of this environment asks. And since
the desk lamp here stands on a receptacle (as in ALFWorld), "X is a lamp" reads "X is where the
agent has seen the lamp", and ``use desklamp 1`` toggles the tracked lamp.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from horizonrl.envs.base import Task, played_lines
from horizonrl.envs.household_world import (
    DIGITS,
    FAMILIES,
    FAMILY_TARGETS,
    LAMP,
    OBJECT_TYPES,
    RECEPTACLE_KINDS,
    ROOMS,
    TIERS,
    TOOL_VERB,
    VERB_STATE,
    Goal,
    Layout,
    Receptacle,
    World,
    commands,
    describe_start,
    execute,
    generate_layout,
    is_won,
    kind_of,
    partial_score,
    plan_search,
    plan_walkthrough,
)
from horizonrl.seeding import derive_seed

SPLITS = ("train", "test")
TEST_SHARE = 10  # a layout is in the test split iff sha256(signature) % TEST_SHARE == 0
NOTHING_HAPPENS = "nothing happens ."  # the answer to an inadmissible command, as in ALFWorld
_OBJECTS = frozenset(OBJECT_TYPES)
_TOOL_ROLES = MappingProxyType({"microwave": "in_heater", "fridge": "in_cooler", "sinkbasin": "in_cleaner"})
_TOOL_DONE_ROLES = MappingProxyType({"microwave": "heated_at:", "fridge": "cooled_at:", "sinkbasin": "cleaned_at:"})
_PLAIN_LABELS = MappingProxyType(
    {"go_room": "NAVIGATE_ROOM", "close": "SEARCH", "look": "OBSERVE_ENV", "inventory": "INVENTORY"}
)
_SEPARATORS = MappingProxyType(
    {"take": " from ", "put": " in/on ", "heat": " with ", "cool": " with ", "clean": " with "}
)


def _named(name: str, kinds: frozenset[str]) -> bool:
    """Whether ``name`` is an instance like 'apple 2' of one of ``kinds``."""
    kind, _, number = name.rpartition(" ")
    return kind in kinds and number in DIGITS


def parse_command(action: str) -> tuple[str, str, str]:
    """('take', 'apple 1', 'countertop 1') for a well-formed command; ('', '', '') otherwise.

    Verbs: go, go_room, open, close, take, put, heat, cool, clean, use, examine, look, inventory.
    """
    text = " ".join(action.lower().split())
    verb, _, rest = text.partition(" ")
    if text in ("look", "inventory"):
        return text, "", ""
    if text.startswith("go to "):
        place = text.removeprefix("go to ")
        if place in ROOMS:
            return "go_room", place, ""
        return ("go", place, "") if _named(place, RECEPTACLE_KINDS) else ("", "", "")
    if verb in ("open", "close") and _named(rest, RECEPTACLE_KINDS):
        return verb, rest, ""
    if verb == "use" and rest == LAMP:
        return verb, rest, ""
    if verb == "examine" and (_named(rest, RECEPTACLE_KINDS | _OBJECTS) or rest == LAMP):
        return verb, rest, ""
    first, _, second = rest.partition(_SEPARATORS[verb]) if verb in _SEPARATORS else ("", "", "")
    if _named(first, _OBJECTS) and _named(second, RECEPTACLE_KINDS):
        return verb, first, second
    return "", "", ""


@dataclass
class Tracker:
    """What the agent has seen and done (role_v1 ``TargetState``), fed only admissible commands.

    Type-level fields feed the key. Instance names are kept only to tell where a taken object came from
    (pick_two retakes) and where the lamp stands; they never reach the key.
    """

    at: str = ""  # receptacle the agent stands at, "" in the middle of a room
    held: str = ""  # object instance in hand
    visited: set[str] = field(default_factory=set)  # receptacle kinds gone to, opened, used (role_v1 "seen")
    open_kinds: set[str] = field(default_factory=set)
    seen: set[str] = field(default_factory=set)  # object types taken, put or listed in an observation
    role: dict[str, str] = field(default_factory=dict)  # object type -> role_v1 object role
    instance_role: dict[str, str] = field(default_factory=dict)  # object instance -> role
    states: set[tuple[str, str]] = field(default_factory=set)  # (state, object type), e.g. ("hot", "apple")
    placed: dict[tuple[str, str], int] = field(default_factory=dict)  # (object type, receptacle kind) -> puts
    lamp_at: str = ""  # receptacle where the agent saw the lamp
    lamp_on: bool = False

    def update(self, action: str, observation: str) -> None:
        """Apply an admissible ``action`` and read the objects listed in its ``observation``."""
        verb, first, second = parse_command(action)
        _TRACK[verb](self, first, second)
        self.observe(observation)

    def observe(self, observation: str) -> None:
        """Record object types after 'you see', and the lamp if it is listed where the agent stands."""
        for chunk in observation.split("you see ")[1:]:
            for item in chunk.partition(" .")[0].split(" , "):
                name = item.removeprefix("and ").removeprefix("a ")
                if kind_of(name) in _OBJECTS:
                    self.seen.add(kind_of(name))
                elif name == LAMP and self.at:
                    self.lamp_at = self.at


def _track_go(tracker: Tracker, rec: str, _: str) -> None:
    tracker.at = rec
    tracker.visited.add(kind_of(rec))


def _track_go_room(tracker: Tracker, room: str, _: str) -> None:
    tracker.at = ""


def _track_open(tracker: Tracker, rec: str, _: str) -> None:
    tracker.open_kinds.add(kind_of(rec))
    tracker.visited.add(kind_of(rec))


def _track_close(tracker: Tracker, rec: str, _: str) -> None:
    tracker.open_kinds.discard(kind_of(rec))
    tracker.visited.add(kind_of(rec))


def _track_take(tracker: Tracker, obj: str, rec: str) -> None:
    """Taking an object back out of a receptacle it was put in undoes that placement."""
    obj_type, rec_kind = kind_of(obj), kind_of(rec)
    if tracker.instance_role.get(obj) == f"in_recep:{rec_kind}":
        tracker.placed[obj_type, rec_kind] = max(0, tracker.placed.get((obj_type, rec_kind), 0) - 1)
    tracker.held = obj
    tracker.seen.add(obj_type)
    tracker.visited.add(rec_kind)
    tracker.role[obj_type] = tracker.instance_role[obj] = "held"


def _track_put(tracker: Tracker, obj: str, rec: str) -> None:
    obj_type, rec_kind = kind_of(obj), kind_of(rec)
    role = f"in_recep:{rec_kind}"
    if tracker.instance_role.get(obj) != role:
        tracker.placed[obj_type, rec_kind] = tracker.placed.get((obj_type, rec_kind), 0) + 1
    tracker.held = ""
    tracker.seen.add(obj_type)
    tracker.visited.add(rec_kind)
    tracker.role[obj_type] = tracker.instance_role[obj] = role


def _track_transform(tracker: Tracker, obj: str, rec: str) -> None:
    """Only admissible commands arrive here, so ``rec`` is the tool whose verb was played."""
    tool = kind_of(rec)
    tracker.states.add((VERB_STATE[TOOL_VERB[tool]], kind_of(obj)))
    tracker.visited.add(tool)
    tracker.role[kind_of(obj)] = tracker.instance_role[obj] = _TOOL_DONE_ROLES[tool] + tool


def _track_use(tracker: Tracker, lamp: str, _: str) -> None:
    tracker.lamp_on = not tracker.lamp_on
    tracker.lamp_at = tracker.at


def _track_nothing(tracker: Tracker, first: str, second: str) -> None:
    """examine, look and inventory change no tracked fact beyond what their observation lists."""


_TRACK: MappingProxyType[str, Callable[[Tracker, str, str], None]] = MappingProxyType(
    {
        "go": _track_go,
        "go_room": _track_go_room,
        "open": _track_open,
        "close": _track_close,
        "take": _track_take,
        "put": _track_put,
        "use": _track_use,
        "heat": _track_transform,
        "cool": _track_transform,
        "clean": _track_transform,
        "examine": _track_nothing,
        "look": _track_nothing,
        "inventory": _track_nothing,
    }
)


def components(goal: Goal) -> tuple[str, ...]:
    """role_v1 task components: place; (hot|cool|clean, place); place_count2; examine_light."""
    if goal.family == "pick_two":
        return ("place_count2",)
    if goal.family == "look_at_obj_in_light":
        return ("examine_light",)
    return (goal.state, "place") if goal.state else ("place",)


def component_done(goal: Goal, tracker: Tracker, kind: str) -> bool:
    """role_v1 ``component_done``, by type; examine_light: holding a target at the lit lamp."""
    if kind == "place":
        return tracker.role.get(goal.target) == f"in_recep:{goal.destination}"
    if kind == "place_count2":
        return tracker.placed.get((goal.target, goal.destination), 0) >= 2
    if kind == "examine_light":
        return _holds_target(goal, tracker) and tracker.lamp_on and _near_lamp(tracker)
    return (kind, goal.target) in tracker.states


def _holds_target(goal: Goal, tracker: Tracker) -> bool:
    return kind_of(tracker.held) == goal.target


def _near_lamp(tracker: Tracker) -> bool:
    return bool(tracker.at) and tracker.at == tracker.lamp_at


def _simple_role(goal: Goal, tracker: Tracker) -> str:
    """role_v1 ``_simple_role``: held / at_target_recep / in_heater.. / in_other_recep / heated_at.. / unknown.

    role_v1 files an object put in a fridge as ``in_cooler`` even when the fridge is the destination, so
    "put a apple in fridge" never counts as placed; here the destination is checked first.
    """
    role = tracker.role.get(goal.target, "unknown")
    kind = role.removeprefix("in_recep:")
    if kind == goal.destination:
        return "at_target_recep"
    if role.startswith("in_recep:"):
        return _TOOL_ROLES.get(kind, "in_other_recep")
    return role.partition(":")[0]


def _stage(*milestones: bool) -> int:
    """role_v1 progress stage: the 1-based position of the most advanced milestone reached, else 0."""
    return next((len(milestones) - i for i, reached in enumerate(reversed(milestones)) if reached), 0)


def _transform_fields(goal: Goal, tracker: Tracker, kind: str) -> dict[str, Any]:
    held, seen = _holds_target(goal, tracker), _target_seen(goal, tracker)
    role = tracker.role.get(goal.target, "")
    in_tool = role == f"in_recep:{goal.tool}" or role.startswith(_TOOL_DONE_ROLES[goal.tool])
    tool_seen = goal.tool in tracker.visited
    access = kind_of(tracker.at) == goal.tool or goal.tool in tracker.open_kinds
    stage = _stage(held or seen, held and (tool_seen or access), in_tool, component_done(goal, tracker, kind))
    return {"in_tool": in_tool, "access": access, "seen": seen, "tool_seen": tool_seen, "stage": stage}


def _place_fields(goal: Goal, tracker: Tracker, kind: str) -> dict[str, Any]:
    held, seen = _holds_target(goal, tracker), _target_seen(goal, tracker)
    near, dest_seen = kind_of(tracker.at) == goal.destination, goal.destination in tracker.visited
    stage = _stage(held or seen, held and (near or dest_seen), component_done(goal, tracker, kind))
    return {"near": near, "seen": seen, "dest_seen": dest_seen, "stage": stage}


def _place_two_fields(goal: Goal, tracker: Tracker, kind: str) -> dict[str, Any]:
    held, seen = _holds_target(goal, tracker), _target_seen(goal, tracker)
    count = min(tracker.placed.get((goal.target, goal.destination), 0), 2)
    stage = _stage(held or seen, count == 1, count == 1 and held, count >= 2)
    return {
        "near": kind_of(tracker.at) == goal.destination,
        "count": count,
        "seen": seen,
        "dest_seen": goal.destination in tracker.visited,
        "stage": stage,
    }


def _light_fields(goal: Goal, tracker: Tracker, kind: str) -> dict[str, Any]:
    seen, lamp_seen, near = _target_seen(goal, tracker), bool(tracker.lamp_at), _near_lamp(tracker)
    stage = _stage(
        seen or lamp_seen, seen and (near or lamp_seen), seen and tracker.lamp_on, component_done(goal, tracker, kind)
    )
    return {"lamp_on": tracker.lamp_on, "near_lamp": near, "seen": seen, "lamp_seen": lamp_seen, "stage": stage}


def _target_seen(goal: Goal, tracker: Tracker) -> bool:
    return goal.target in tracker.seen or goal.target in tracker.role


_FIELDS: MappingProxyType[str, Callable[[Goal, Tracker, str], dict[str, Any]]] = MappingProxyType(
    {
        "hot": _transform_fields,
        "cool": _transform_fields,
        "clean": _transform_fields,
        "place": _place_fields,
        "place_count2": _place_two_fields,
        "examine_light": _light_fields,
    }
)


def progress_key(goal: Goal, tracker: Tracker) -> str:
    """role_v1 key (docs/algorithms.md §2.3): family, one descriptor per component, done flags; no instance ids.

    A descriptor holds the simple object role, whether a target is held, the kind's target-relative flags
    and progress stage, and the completion of sibling components. Flags role_v1 repeats (done inside
    the descriptor, at_target next to role, the count bucket of a single place) are written once.
    """
    kinds = components(goal)
    done = {kind: component_done(goal, tracker, kind) for kind in kinds}
    parts = ["role_v1", goal.family]
    for kind in kinds:
        fields = {"role": _simple_role(goal, tracker), "held": _holds_target(goal, tracker)}
        fields |= _FIELDS[kind](goal, tracker, kind)
        fields |= {f"sib_{other}": done[other] for other in kinds if other != kind}
        parts.append(_render(kind, fields))
    parts.append("done=" + "".join(str(int(done[kind])) for kind in kinds))
    return "|".join(parts)


def _render(kind: str, fields: dict[str, Any]) -> str:
    """'place:role=held,held=1,...', booleans as 0/1."""
    values = (f"{name}={int(value) if isinstance(value, bool) else value}" for name, value in fields.items())
    return f"{kind}:" + ",".join(values)


def abstract_action_label(goal: Goal, tracker: Tracker, action: str) -> str:
    """Goal-relative function label of ``action`` (docs/algorithms.md §2.4, BLPO ``actions.abstract_action``).

    Like role_v1 the label reads the command text, not its admissibility (that is ``info["valid"]``);
    text that is not a well-formed command over this world's vocabulary is OTHER. ``go to <room>`` adds
    NAVIGATE_ROOM.
    """
    verb, first, second = parse_command(action)
    if verb in ("go", "open"):
        return _label_receptacle(goal, tracker, verb, first)
    if verb in ("take", "put", "heat", "cool", "clean"):
        return _label_target(goal, verb, first, second) if kind_of(first) == goal.target else "OTHER"
    if verb == "use":
        if goal.family != "look_at_obj_in_light":
            return "ACTIVATE_TOOL"
        return "INSPECT_TARGET" if _holds_target(goal, tracker) else "ACTIVATE_LAMP"
    if verb == "examine":
        looking = goal.family == "look_at_obj_in_light" and kind_of(first) == goal.target
        return "EXAMINE_TARGET" if looking else "OBSERVE_OTHER"
    return _PLAIN_LABELS.get(verb, "OTHER")


def _label_receptacle(goal: Goal, tracker: Tracker, verb: str, rec: str) -> str:
    """go to: lamp, tool, destination, else search; open: destination, tool, else source (role_v1 order).

    "Tool" is the goal's tool only: a microwave is just another receptacle in a pick_and_place task.
    """
    kind = kind_of(rec)
    if verb == "open":
        if kind == goal.destination:
            return "OPEN_DESTINATION"
        return "OPEN_TOOL" if kind == goal.tool else "OPEN_SOURCE"
    if goal.family == "look_at_obj_in_light" and rec == tracker.lamp_at:
        return "NAVIGATE_LAMP"
    if goal.tool and kind == goal.tool:
        return "NAVIGATE_TOOL"
    return "NAVIGATE_DESTINATION" if kind == goal.destination else "SEARCH_ENV"


def _label_target(goal: Goal, verb: str, obj: str, rec: str) -> str:
    """take / put / transform of a target-type object."""
    kind = kind_of(rec)
    if verb == "take":
        if goal.family != "pick_two":
            return "TAKE_TARGET"
        return "RETAKE_PLACED_TARGET" if kind == goal.destination else "TAKE_UNPLACED_TARGET"
    if verb == "put":
        if kind == goal.destination:
            return "PUT_TARGET_DESTINATION"
        return "PUT_TARGET_TOOL" if kind == goal.tool else "PUT_TARGET_OTHER"
    return "TRANSFORM_TARGET"


class HouseholdEnv:
    """One household episode; ``reset(task)`` rebuilds the world from ``task.seed`` and ``task.tier`` alone."""

    def __init__(self) -> None:
        self._world: World | None = None
        self._observe = False
        self._tracker = Tracker()
        self._ops: dict[str, tuple[str, ...]] = {}
        self._won = False

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        return self.reset_layout(generate_layout(task.seed, TIERS[task.tier]), task.tier)

    def reset_layout(self, layout: Layout, tier: str) -> tuple[str, dict[str, Any]]:
        """Start an episode on an explicit layout (hand-built cases in tests; ``reset`` generates one)."""
        self._world = World.start(layout)
        self._observe = TIERS[tier].observe
        self._tracker = Tracker()
        self._won = False
        observation = describe_start(self._world)
        self._tracker.observe(observation)
        self._ops = commands(self._world, self._observe)
        return observation, self._info(valid=True)

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        """Play ``action``; an inadmissible one changes nothing and answers 'nothing happens .'."""
        text = " ".join(action.lower().split())
        op = self._ops.get(text)
        if op is None:
            return NOTHING_HAPPENS, 0.0, self._won, self._info(valid=False)
        observation = execute(self.world, op)
        self._tracker.update(text, observation)
        self._ops = commands(self.world, self._observe)
        newly_won = not self._won and is_won(self.world)
        self._won = self._won or newly_won
        return observation, float(newly_won), self._won, self._info(valid=True)

    def _info(self, valid: bool) -> dict[str, Any]:
        goal = self.world.layout.goal
        return {
            "won": self._won,
            "admissible_commands": sorted(self._ops),
            "valid": valid,
            "score": 1.0 if self._won else partial_score(self.world),
            "progress_key": progress_key(goal, self._tracker),
            "family": goal.family,
            "goal": goal.text(),
        }

    @property
    def world(self) -> World:
        """The running episode's world (tests and oracles only; the agent sees observations)."""
        if self._world is None:
            raise RuntimeError("HouseholdEnv: call reset() first")
        return self._world

    @property
    def tracker(self) -> Tracker:
        """What the agent has seen and done so far (read by ``abstract_action`` and the progress key)."""
        return self._tracker

    def goal(self) -> str:
        return self.world.layout.goal.text()

    def abstract_action(self, action: str) -> str:
        return abstract_action_label(self.world.layout.goal, self._tracker, action)

    def walkthrough(self) -> list[str]:
        return plan_walkthrough(self.world.layout)

    def search_walkthrough(self) -> list[str]:
        """The commands of an expert that finds hidden objects by searching (``plan_search``)."""
        return plan_search(self.world.layout)

    def close(self) -> None:
        self._world = None


@dataclass
class _Enumeration:
    """Tasks of one tier found so far, in order: a growing cache, so ``tasks`` never re-enumerates."""

    counter: int = 0
    signatures: set[str] = field(default_factory=set)
    found: dict[str, list[tuple[int, str]]] = field(default_factory=lambda: {split: [] for split in SPLITS})


# What a suite works out from its seed alone, shared by every suite of that seed in the process: a process
# that starts many runs (a sweep run in place, an evaluation beside its training, the test suite) builds a
# suite per run, and would otherwise enumerate the same tasks and play the same corpus again each time.
# Reentrant: the corpus enumerates tasks while it is built.
_SHARED = threading.RLock()
_ENUMERATIONS: dict[tuple[int, str], _Enumeration] = {}  # (suite seed, tier) -> its tasks found so far
_CORPORA: dict[tuple[int, int], tuple[str, ...]] = {}  # (suite seed, n_tasks) -> the corpus lines


class HouseholdSuite:
    """Household tasks per tier with content-disjoint splits, fixed by the suite seed.

    Candidate ``counter = 0, 1, ...`` gets the layout seed ``derive_seed(seed, "household", tier, counter)``.
    A layout whose signature was already found is skipped, so every task of a split is distinct; the rest
    go to test iff sha256(signature) % 10 == 0, else to train.
    """

    name = "household"

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    def tasks(self, split: str, tier: str, n: int, offset: int = 0) -> list[Task]:
        if split not in SPLITS or tier not in TIERS:
            raise ValueError(f"household: split must be one of {SPLITS} and tier one of {tuple(TIERS)}")
        found = self._find(tier, split, offset + n)
        return [
            Task(self.name, split, tier, offset + i, seed, family)
            for i, (seed, family) in enumerate(found[offset : offset + n])
        ]

    def _find(self, tier: str, split: str, n: int) -> list[tuple[int, str]]:
        """The first ``n`` (seed, family) of ``split``, extending the tier's enumeration as needed."""
        with _SHARED:
            state = _ENUMERATIONS.setdefault((self.seed, tier), _Enumeration())
            while len(state.found[split]) < n:
                seed = derive_seed(self.seed, self.name, tier, state.counter)
                state.counter += 1
                layout = generate_layout(seed, TIERS[tier])
                signature = layout.signature()
                if signature not in state.signatures:
                    state.signatures.add(signature)
                    state.found[split_of(signature)].append((seed, layout.goal.family))
            return state.found[split][:n]

    def make(self) -> HouseholdEnv:
        return HouseholdEnv()

    def max_turns(self, tier: str) -> int:
        return TIERS[tier].horizon

    def corpus(self, n_tasks: int = 200) -> list[str]:
        """Vocabulary lines, every goal form, then what walkthroughs and random play show on train tasks
        (played once per process, seed and ``n_tasks``: ~2 CPU-s, and every run the process starts needs it)."""
        with _SHARED:
            if (self.seed, n_tasks) not in _CORPORA:
                _CORPORA[self.seed, n_tasks] = tuple(self._play_corpus(n_tasks))
            return list(_CORPORA[self.seed, n_tasks])

    def _play_corpus(self, n_tasks: int) -> list[str]:
        lines = [" ".join((*OBJECT_TYPES, *sorted(RECEPTACLE_KINDS), *ROOMS, LAMP, *DIGITS)), NOTHING_HAPPENS]
        lines += [Goal(family, target, "countertop").text() for family in FAMILIES for target in FAMILY_TARGETS[family]]
        env = self.make()
        lines += _demo_lines(env)
        for tier in TIERS:
            for task in self.tasks("train", tier, n_tasks):
                lines += played_lines(env, task, oracle=True, random_turns=TIERS[task.tier].horizon)
                lines += played_lines(env, task, oracle=False, random_turns=TIERS[task.tier].horizon)
        return list(dict.fromkeys(lines))


_DEMO_LAYOUT = Layout(
    Goal("pick_heat_then_place", "apple", "sidetable"),
    ("kitchen", "bedroom"),
    (
        Receptacle("fridge 1", "kitchen"),
        Receptacle("microwave 1", "kitchen", True),
        Receptacle("sinkbasin 1", "kitchen"),
        Receptacle("countertop 1", "kitchen"),
        Receptacle("sidetable 1", "bedroom"),
    ),
    (("apple 1", "fridge 1"),),
    "sidetable 1",
)
_DEMO_SCRIPT = (
    "look",
    "inventory",
    "go to fridge 1",
    "open fridge 1",
    "examine fridge 1",
    "take apple 1 from fridge 1",
    "close fridge 1",
    "cool apple 1 with fridge 1",
    "go to microwave 1",
    "heat apple 1 with microwave 1",
    "go to sinkbasin 1",
    "clean apple 1 with sinkbasin 1",
    "examine apple 1",
    "inventory",
    "look",
    "go to countertop 1",
    "put apple 1 in/on countertop 1",
    "go to bedroom",
    "go to sidetable 1",
    "use desklamp 1",
    "use desklamp 1",
)


def _demo_lines(env: HouseholdEnv) -> list[str]:
    """Every observation form once, so the corpus does not depend on random play reaching rare ones."""
    observation, _ = env.reset_layout(_DEMO_LAYOUT, "medium")
    return [observation] + [env.step(action)[0] for action in _DEMO_SCRIPT]


def split_of(signature: str) -> str:
    """'test' for about one layout in ``TEST_SHARE``, by a stable hash of its content."""
    return "test" if int(hashlib.sha256(signature.encode()).hexdigest(), 16) % TEST_SHARE == 0 else "train"
