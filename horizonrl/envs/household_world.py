"""The household world: seeded ALFWorld-like layouts, one episode's mutable state, and the rules of play.

A ``Layout`` is the immutable content of one task: rooms, numbered receptacles, where each object
starts, where the desk lamp stands, and the goal. Its ``signature`` is the canonical text the splits
hash. A ``World`` is one episode's mutable state over a layout; ``commands`` lists what is admissible
now and ``execute`` plays one of those commands and returns the observation. Both follow ALFWorld's
TextWorld rules: the agent holds at most one object, a closed receptacle hides its contents, and
``heat X with microwave 1`` needs the agent at the microwave holding X. ``plan_walkthrough`` is the
oracle that solves a layout from its start.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from types import MappingProxyType

FAMILIES = (
    "pick_and_place",
    "pick_heat_then_place",
    "pick_cool_then_place",
    "pick_clean_then_place",
    "pick_two",
    "look_at_obj_in_light",
)
ROOM_RECEPTACLES = MappingProxyType(
    {
        "kitchen": (
            "countertop",
            "cabinet",
            "drawer",
            "shelf",
            "table",
            "garbagecan",
            "fridge",
            "microwave",
            "sinkbasin",
        ),
        "livingroom": (
            "sofa",
            "armchair",
            "coffeetable",
            "sidetable",
            "shelf",
            "cabinet",
            "drawer",
            "box",
            "garbagecan",
        ),
        "bedroom": ("bed", "desk", "sidetable", "dresser", "drawer", "shelf", "safe", "garbagecan"),
        "bathroom": ("countertop", "cabinet", "drawer", "shelf", "sinkbasin", "garbagecan"),
        "office": ("desk", "shelf", "drawer", "safe", "box", "sidetable", "garbagecan"),
    }
)
ROOMS = tuple(ROOM_RECEPTACLES)
RECEPTACLE_KINDS = frozenset(kind for pool in ROOM_RECEPTACLES.values() for kind in pool)
OPENABLE = frozenset({"cabinet", "drawer", "fridge", "microwave", "safe", "box"})
TOOL_VERB = MappingProxyType({"microwave": "heat", "fridge": "cool", "sinkbasin": "clean"})
VERB_STATE = MappingProxyType({"heat": "hot", "cool": "cool", "clean": "clean"})
FAMILY_TOOL = MappingProxyType(
    {
        "pick_heat_then_place": "microwave",
        "pick_cool_then_place": "fridge",
        "pick_clean_then_place": "sinkbasin",
    }
)
LAMP = "desklamp 1"
LAMP_HOSTS = frozenset({"desk", "sidetable", "dresser"})
DIGITS = tuple(str(i) for i in range(1, 10))
SMALL_THINGS = (
    "book",
    "pen",
    "pencil",
    "cellphone",
    "keychain",
    "creditcard",
    "watch",
    "remotecontrol",
    "cd",
    "vase",
    "candle",
    "newspaper",
    "alarmclock",
)
OBJECT_TYPES = (
    "apple",
    "tomato",
    "potato",
    "egg",
    "bread",
    "lettuce",
    "mug",
    "cup",
    "plate",
    "bowl",
    "knife",
    "spoon",
    "fork",
    "soapbar",
    "cloth",
) + SMALL_THINGS
FAMILY_TARGETS = MappingProxyType(
    {
        "pick_and_place": OBJECT_TYPES,
        "pick_heat_then_place": ("apple", "tomato", "potato", "egg", "bread", "mug", "cup", "plate", "bowl"),
        "pick_cool_then_place": ("apple", "tomato", "potato", "egg", "bread", "lettuce", "mug", "cup", "plate", "bowl"),
        "pick_clean_then_place": (
            "apple",
            "tomato",
            "potato",
            "lettuce",
            "mug",
            "cup",
            "plate",
            "bowl",
            "knife",
            "spoon",
            "fork",
            "soapbar",
            "cloth",
        ),
        "pick_two": OBJECT_TYPES,
        "look_at_obj_in_light": SMALL_THINGS + ("mug", "bowl"),
    }
)
MAX_RECEPTACLES_PER_KIND = 4
MAX_OBJECTS_PER_TYPE = 3


@dataclass(frozen=True)
class Tier:
    """Size and rules of one difficulty level; every range is inclusive."""

    rooms: tuple[int, int]  # rooms in the house
    receptacles: tuple[int, int]  # receptacles besides the tool or lamp host the family needs
    objects: tuple[int, int]  # takeable objects, targets included
    families: tuple[str, ...]  # task families drawn uniformly
    p_open: float  # chance that an openable receptacle starts open
    p_lamp: float  # chance of a desk lamp when the family does not need one
    observe: bool  # `look` and `examine ...` are admissible
    horizon: int  # turns the caller allows


# Uniform random play over admissible commands wins about 5.8 % of easy, 1 % of medium and 0.6 % of hard
# tasks within the horizon; harder tiers also start more openables closed.
TIERS = MappingProxyType(
    {
        "easy": Tier(
            rooms=(1, 1),
            receptacles=(4, 4),
            objects=(3, 4),
            families=("pick_and_place",),
            p_open=0.5,
            p_lamp=0.0,
            observe=False,
            horizon=15,
        ),
        "medium": Tier(
            rooms=(1, 2),
            receptacles=(6, 8),
            objects=(4, 6),
            families=FAMILIES,
            p_open=0.4,
            p_lamp=0.5,
            observe=True,
            horizon=30,
        ),
        "hard": Tier(
            rooms=(2, 3),
            receptacles=(8, 12),
            objects=(6, 10),
            families=FAMILIES,
            p_open=0.3,
            p_lamp=0.5,
            observe=True,
            horizon=50,
        ),
    }
)


def kind_of(name: str) -> str:
    """Type of an instance name: 'apple 2' -> 'apple'."""
    return name.rpartition(" ")[0]


@dataclass(frozen=True)
class Goal:
    """What to achieve, by type: any instance of ``target`` in any receptacle of kind ``destination``."""

    family: str
    target: str  # object type, e.g. "apple"
    destination: str  # receptacle kind, e.g. "fridge"; "" for look_at_obj_in_light

    @property
    def tool(self) -> str:
        """The receptacle kind that transforms the target ('' for families without a transform)."""
        return FAMILY_TOOL.get(self.family, "")

    @property
    def state(self) -> str:
        """The state the target must reach before placement: 'hot', 'cool', 'clean' or ''."""
        return VERB_STATE[TOOL_VERB[self.tool]] if self.tool else ""

    def text(self) -> str:
        """ALFWorld's goal sentence, e.g. 'put a hot apple in countertop'."""
        if self.family == "look_at_obj_in_light":
            return f"look at {self.target} under the desklamp"
        if self.family == "pick_two":
            return f"put two {self.target} in {self.destination}"
        adjective = f"{self.state} " if self.state else ""
        return f"put a {adjective}{self.target} in {self.destination}"


@dataclass(frozen=True)
class Receptacle:
    """A numbered receptacle, the room it stands in and, if openable, whether it starts open."""

    name: str  # e.g. "cabinet 2"
    room: str
    starts_open: bool = False


@dataclass(frozen=True)
class Layout:
    """The full content of one task; the agent starts in the middle of ``rooms[0]``."""

    goal: Goal
    rooms: tuple[str, ...]
    receptacles: tuple[Receptacle, ...]
    placements: tuple[tuple[str, str], ...]  # (object, receptacle) in listing order
    lamp_host: str = ""  # receptacle the desk lamp stands on, "" when there is no lamp

    def signature(self) -> str:
        """Canonical content string: equal for layouts that play identically up to listing order."""
        receptacles = ";".join(sorted(f"{r.name}@{r.room}:{int(r.starts_open)}" for r in self.receptacles))
        placements = ";".join(sorted(f"{obj}@{rec}" for obj, rec in self.placements))
        goal = f"{self.goal.family}:{self.goal.target}:{self.goal.destination}"
        return "|".join((goal, ",".join(self.rooms), receptacles, placements, self.lamp_host))


def generate_layout(seed: int, tier: Tier) -> Layout:
    """Draw a family and target, then rooms, receptacles, a destination and object placements."""
    rng = random.Random(seed)
    family = rng.choice(tier.families)
    target = rng.choice(FAMILY_TARGETS[family])
    required = _required_kind(rng, family)
    rooms = _choose_rooms(rng, tier, required)
    receptacles = _choose_receptacles(rng, tier, required, rooms)
    lamp_host = _choose_lamp_host(rng, tier, family, receptacles)
    goal = Goal(family, target, _choose_destination(rng, family, receptacles))
    return Layout(goal, rooms, receptacles, _place_objects(rng, tier, goal, receptacles), lamp_host)


def _required_kind(rng: random.Random, family: str) -> str:
    """The receptacle kind the family cannot be solved without: its tool, or a lamp host."""
    if family == "look_at_obj_in_light":
        return rng.choice(sorted(LAMP_HOSTS))
    return FAMILY_TOOL.get(family, "")


def _choose_rooms(rng: random.Random, tier: Tier, required: str) -> tuple[str, ...]:
    """Rooms in start order; one of them can hold the ``required`` receptacle kind."""
    hosts = [room for room in ROOMS if not required or required in ROOM_RECEPTACLES[room]]
    first = rng.choice(hosts)
    rooms = [first] + rng.sample([room for room in ROOMS if room != first], rng.randint(*tier.rooms) - 1)
    rng.shuffle(rooms)
    return tuple(rooms)


def _choose_receptacles(
    rng: random.Random, tier: Tier, required: str, rooms: tuple[str, ...]
) -> tuple[Receptacle, ...]:
    """Required receptacle first, one per room, then random fill; shuffled, then numbered per kind.

    A kind fills at most ``total - 1`` slots so that the house has two kinds and a destination kind
    leaves somewhere else for the targets to start.
    """
    slots: list[tuple[str, str]] = []
    if required:
        slots.append((rng.choice([r for r in rooms if required in ROOM_RECEPTACLES[r]]), required))
    total = len(slots) + rng.randint(*tier.receptacles)
    cap = min(MAX_RECEPTACLES_PER_KIND, total - 1)
    while len(slots) < total:
        empty = [room for room in rooms if all(room != r for r, _ in slots)]
        room = empty[0] if empty else rng.choice(rooms)
        kind = rng.choice(ROOM_RECEPTACLES[room])
        if sum(k == kind for _, k in slots) < (1 if kind in TOOL_VERB else cap):
            slots.append((room, kind))
    rng.shuffle(slots)
    numbered: dict[str, int] = {}
    receptacles = []
    for room, kind in slots:
        numbered[kind] = numbered.get(kind, 0) + 1
        starts_open = kind in OPENABLE and rng.random() < tier.p_open
        receptacles.append(Receptacle(f"{kind} {numbered[kind]}", room, starts_open))
    return tuple(receptacles)


def _choose_lamp_host(rng: random.Random, tier: Tier, family: str, receptacles: tuple[Receptacle, ...]) -> str:
    """Look tasks always get a lamp; other families get one with probability ``p_lamp`` if a host exists."""
    hosts = [r.name for r in receptacles if kind_of(r.name) in LAMP_HOSTS]
    wanted = family == "look_at_obj_in_light" or rng.random() < tier.p_lamp
    return rng.choice(hosts) if wanted and hosts else ""


def _choose_destination(rng: random.Random, family: str, receptacles: tuple[Receptacle, ...]) -> str:
    """A kind present in the house other than the family's tool (the house always has two kinds)."""
    if family == "look_at_obj_in_light":
        return ""
    return rng.choice(sorted({kind_of(r.name) for r in receptacles} - {FAMILY_TOOL.get(family, "")}))


def _place_objects(
    rng: random.Random, tier: Tier, goal: Goal, receptacles: tuple[Receptacle, ...]
) -> tuple[tuple[str, str], ...]:
    """Targets start outside every destination receptacle (else the task would start won); distractors anywhere."""
    n_objects = rng.randint(*tier.objects)
    n_targets = (2 if goal.family == "pick_two" else 1) + (rng.random() < 0.25)
    types = [goal.target] * min(n_targets, n_objects - 1)
    while len(types) < n_objects:
        kind = rng.choice(OBJECT_TYPES)
        if kind != goal.target and types.count(kind) < MAX_OBJECTS_PER_TYPE:
            types.append(kind)
    sources = [r.name for r in receptacles if kind_of(r.name) != goal.destination]
    anywhere = [r.name for r in receptacles]
    numbered: dict[str, int] = {}
    placements = []
    for kind in types:
        numbered[kind] = numbered.get(kind, 0) + 1
        place = rng.choice(sources if kind == goal.target else anywhere)
        placements.append((f"{kind} {numbered[kind]}", place))
    rng.shuffle(placements)
    return tuple(placements)


@dataclass
class World:
    """One episode's mutable state over a layout."""

    layout: Layout
    room: str  # room the agent is in
    at: str = ""  # receptacle the agent stands at; "" in the middle of the room
    held: str = ""  # object in hand, "" when empty
    lamp_on: bool = False
    contents: dict[str, list[str]] = field(default_factory=dict)  # receptacle -> objects, listing order
    is_open: dict[str, bool] = field(default_factory=dict)  # openable receptacle -> open
    states: dict[str, set[str]] = field(default_factory=dict)  # object -> {"hot", "cool", "clean"}
    in_room: dict[str, list[str]] = field(default_factory=dict)  # room -> receptacles, listing order

    @classmethod
    def start(cls, layout: Layout) -> World:
        """The layout's initial state: every object in place, openables as drawn, lamp off."""
        world = cls(layout, layout.rooms[0])
        for rec in layout.receptacles:
            world.contents[rec.name] = []
            world.in_room.setdefault(rec.room, []).append(rec.name)
            if kind_of(rec.name) in OPENABLE:
                world.is_open[rec.name] = rec.starts_open
        for obj, rec in layout.placements:
            world.contents[rec].append(obj)
            world.states[obj] = set()
        return world

    def accessible(self, rec: str) -> bool:
        """Whether the contents of ``rec`` can be seen and reached (open, or not openable)."""
        return self.is_open.get(rec, True)


def commands(world: World, observe: bool) -> dict[str, tuple[str, ...]]:
    """Admissible commands now, each mapped to its operation (verb, arguments) for ``execute``."""
    ops: dict[str, tuple[str, ...]] = {"inventory": ("inventory",)}
    for rec in world.in_room[world.room]:
        if rec != world.at:
            ops[f"go to {rec}"] = ("go", rec)
    for room in world.layout.rooms:
        if room != world.room:
            ops[f"go to {room}"] = ("go_room", room)
    if observe:
        ops["look"] = ("look",)
        if world.held:
            ops[f"examine {world.held}"] = ("examine_object", world.held)
    if world.at:
        ops.update(_local_commands(world, world.at, observe))
    return ops


def _local_commands(world: World, rec: str, observe: bool) -> dict[str, tuple[str, ...]]:
    """Commands that need the agent at ``rec``: open/close, take/put, transform, lamp, examine."""
    ops: dict[str, tuple[str, ...]] = {}
    if rec in world.is_open:
        verb = "close" if world.is_open[rec] else "open"
        ops[f"{verb} {rec}"] = (verb, rec)
    if observe:
        ops[f"examine {rec}"] = ("examine_receptacle", rec)
    if world.accessible(rec):
        for obj in world.contents[rec]:
            if not world.held:
                ops[f"take {obj} from {rec}"] = ("take", obj, rec)
            if observe:
                ops[f"examine {obj}"] = ("examine_object", obj)
        if world.held:
            ops[f"put {world.held} in/on {rec}"] = ("put", world.held, rec)
    tool_verb = TOOL_VERB.get(kind_of(rec), "")
    if tool_verb and world.held:
        ops[f"{tool_verb} {world.held} with {rec}"] = ("transform", tool_verb, world.held, rec)
    if rec == world.layout.lamp_host:
        ops[f"use {LAMP}"] = ("use",)
    return ops


def series(phrases: list[str]) -> str:
    """ALFWorld's list style: 'a apple 1 , a mug 2 , and a pen 1'."""
    if len(phrases) > 1:
        phrases = phrases[:-1] + [f"and {phrases[-1]}"]
    return " , ".join(phrases)


def listing(items: list[str]) -> str:
    """Instances as ALFWorld lists them: 'a apple 1 , and a mug 2'; 'nothing' when empty."""
    return series([f"a {item}" for item in items]) if items else "nothing"


def describe_receptacle(world: World, rec: str) -> str:
    """What the agent sees at ``rec``: its contents, or that it is closed; the lamp is listed first."""
    if not world.accessible(rec):
        return f"the {rec} is closed ."
    items = ([LAMP] if rec == world.layout.lamp_host else []) + world.contents[rec]
    if rec in world.is_open:
        return f"the {rec} is open . in it , you see {listing(items)} ."
    return f"on the {rec} , you see {listing(items)} ."


def describe_room(world: World) -> str:
    """The receptacles in view from the middle of the current room, and the other rooms."""
    text = f"looking around you , you see {listing(world.in_room[world.room])} ."
    others = [f"the {room}" for room in world.layout.rooms if room != world.room]
    if others:
        text += f" the other rooms are {series(others)} ."
    return text


def describe_start(world: World) -> str:
    """Reset observation: where the agent is, what it sees, and the goal."""
    goal = world.layout.goal.text()
    return f"you are in the middle of the {world.room} . {describe_room(world)} your task is to : {goal} ."


def _go(world: World, rec: str) -> str:
    world.at = rec
    return f"you arrive at {rec} . {describe_receptacle(world, rec)}"


def _go_room(world: World, room: str) -> str:
    world.room, world.at = room, ""
    return f"you arrive at the {room} . {describe_room(world)}"


def _open(world: World, rec: str) -> str:
    world.is_open[rec] = True
    return f"you open the {rec} . {describe_receptacle(world, rec)}"


def _close(world: World, rec: str) -> str:
    world.is_open[rec] = False
    return f"you close the {rec} ."


def _take(world: World, obj: str, rec: str) -> str:
    world.contents[rec].remove(obj)
    world.held = obj
    return f"you pick up the {obj} from the {rec} ."


def _put(world: World, obj: str, rec: str) -> str:
    world.contents[rec].append(obj)
    world.held = ""
    return f"you put the {obj} in/on the {rec} ."


def _transform(world: World, verb: str, obj: str, rec: str) -> str:
    """Heating undoes cooling and vice versa; cleaning keeps both."""
    states = world.states[obj]
    state = VERB_STATE[verb]
    states.discard({"hot": "cool", "cool": "hot"}.get(state, ""))
    states.add(state)
    return f"you {verb} the {obj} using the {rec} ."


def _use(world: World) -> str:
    world.lamp_on = not world.lamp_on
    return f"you turn {'on' if world.lamp_on else 'off'} the {LAMP} ."


def _examine_object(world: World, obj: str) -> str:
    adjectives = "".join(f"{state} " for state in ("hot", "cool", "clean") if state in world.states[obj])
    return f"this is a {adjectives}{obj} ."


def _inventory(world: World) -> str:
    return f"you are carrying : a {world.held} ." if world.held else "you are not carrying anything ."


def _look(world: World) -> str:
    if world.at:
        return f"you are in the {world.room} , facing the {world.at} ."
    return f"you are in the middle of the {world.room} . {describe_room(world)}"


_HANDLERS: MappingProxyType[str, Callable[..., str]] = MappingProxyType(
    {
        "go": _go,
        "go_room": _go_room,
        "open": _open,
        "close": _close,
        "take": _take,
        "put": _put,
        "transform": _transform,
        "use": _use,
        "examine_receptacle": describe_receptacle,
        "examine_object": _examine_object,
        "inventory": _inventory,
        "look": _look,
    }
)


def execute(world: World, op: tuple[str, ...]) -> str:
    """Apply an operation from ``commands`` (so known to be admissible) and return the observation."""
    return _HANDLERS[op[0]](world, *op[1:])


def _targets_in_destination(world: World) -> int:
    """Target-type objects in destination-kind receptacles that carry the goal's state, if it has one."""
    goal = world.layout.goal
    return sum(
        kind_of(obj) == goal.target and (not goal.state or goal.state in world.states[obj])
        for rec, objs in world.contents.items()
        if kind_of(rec) == goal.destination
        for obj in objs
    )


def is_won(world: World) -> bool:
    """ALFWorld's goal test; a look task is won holding the target at the lit lamp."""
    goal = world.layout.goal
    if goal.family == "look_at_obj_in_light":
        return world.lamp_on and world.at == world.layout.lamp_host and kind_of(world.held) == goal.target
    return _targets_in_destination(world) >= (2 if goal.family == "pick_two" else 1)


def partial_score(world: World) -> float:
    """Goal components done, before the win: pick_two placed/2; transform families 0.5 once a target has
    the goal's state; look 0.5 while holding a target; pick_and_place 0."""
    goal = world.layout.goal
    if goal.family == "pick_two":
        return min(_targets_in_destination(world), 2) / 2
    if goal.state:
        done = any(goal.state in states for obj, states in world.states.items() if kind_of(obj) == goal.target)
        return 0.5 * done
    if goal.family == "look_at_obj_in_light":
        return 0.5 * (kind_of(world.held) == goal.target)
    return 0.0


@dataclass
class _Route:
    """Walkthrough bookkeeping: where the planned agent is and which receptacles it has opened."""

    layout: Layout
    room: str
    at: str = ""
    opened: set[str] = field(default_factory=set)
    actions: list[str] = field(default_factory=list)

    def visit(self, rec: Receptacle, need_open: bool) -> None:
        """Walk to ``rec`` (changing room first if needed) and open it if its contents are needed."""
        if rec.room != self.room:
            self.actions.append(f"go to {rec.room}")
            self.room, self.at = rec.room, ""
        if rec.name != self.at:
            self.actions.append(f"go to {rec.name}")
            self.at = rec.name
        closed = kind_of(rec.name) in OPENABLE and not rec.starts_open and rec.name not in self.opened
        if need_open and closed:
            self.actions.append(f"open {rec.name}")
            self.opened.add(rec.name)


def plan_walkthrough(layout: Layout) -> list[str]:
    """Oracle commands from the start: per target, fetch it, transform it, then place it or light it."""
    goal = layout.goal
    receptacles = {r.name: r for r in layout.receptacles}
    start = layout.rooms[0]
    targets = sorted(
        ((receptacles[rec].room != start, obj, rec) for obj, rec in layout.placements if kind_of(obj) == goal.target)
    )
    route = _Route(layout, start)
    for _, obj, source in targets[: 2 if goal.family == "pick_two" else 1]:
        _take_and_deliver(route, receptacles, obj, source, lambda: layout.lamp_host)
    return route.actions


def _take_and_deliver(
    route: _Route, receptacles: dict[str, Receptacle], obj: str, source: str, lamp_host: Callable[[], str]
) -> None:
    """Take ``obj`` from ``source``, transform it if the goal says so, then place it or light it (the lamp's
    receptacle comes from ``lamp_host``, called only for the lamp goal)."""
    layout, goal = route.layout, route.layout.goal
    route.visit(receptacles[source], need_open=True)
    route.actions.append(f"take {obj} from {source}")
    if goal.tool:
        tool = next(r for r in layout.receptacles if kind_of(r.name) == goal.tool)
        route.visit(tool, need_open=False)
        route.actions.append(f"{TOOL_VERB[goal.tool]} {obj} with {tool.name}")
    if goal.family == "look_at_obj_in_light":
        route.visit(receptacles[lamp_host()], need_open=False)
        route.actions.append(f"use {LAMP}")
    else:
        destination = min(
            (r.room != route.room, r.name) for r in layout.receptacles if kind_of(r.name) == goal.destination
        )[1]
        route.visit(receptacles[destination], need_open=True)
        route.actions.append(f"put {obj} in/on {destination}")


def plan_search(layout: Layout) -> list[str]:
    """Commands of an expert that knows only what it has seen: where a target object (or the desk lamp)
    lies is found by visiting receptacles in turn, the start room's first, each room's in listing order,
    opening the closed ones, until one shows it; a receptacle seen once is remembered (the second object of
    ``pick_two`` may already have been seen). Receptacles themselves are in view from a room's middle, so
    tools and destinations are walked to directly, as in ``plan_walkthrough``. A policy cloned from this
    can learn to search; one cloned from the walkthrough is shown objects' hidden places."""
    goal = layout.goal
    receptacles = {r.name: r for r in layout.receptacles}
    order = [r for room in layout.rooms for r in layout.receptacles if r.room == room]
    holds = {rec: [obj for obj, where in layout.placements if where == rec] for rec in receptacles}
    route = _Route(layout, layout.rooms[0])
    seen: list[str] = []  # receptacles whose contents the expert has seen, in visiting order

    def find(wanted: Callable[[str], bool]) -> str:
        for rec in seen:
            if wanted(rec):
                return rec
        for rec in order:
            if rec.name not in seen:
                route.visit(rec, need_open=True)
                seen.append(rec.name)
                if wanted(rec.name):
                    return rec.name
        raise ValueError(f"layout has nothing wanted: {layout.signature()}")  # generated layouts always do

    for _ in range(2 if goal.family == "pick_two" else 1):
        source = find(lambda rec: any(kind_of(obj) == goal.target for obj in holds[rec]))
        obj = next(o for o in holds[source] if kind_of(o) == goal.target)
        holds[source].remove(obj)
        _take_and_deliver(route, receptacles, obj, source, lambda: find(lambda rec: rec == layout.lamp_host))
    return route.actions
