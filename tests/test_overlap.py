"""Overlapped rollouts (``collect(..., overlap=True)``): two fixed halves, one generating while the other's
environments step. The schedule is the one the rollout module states; records are identical whether the
environments step in this process or in a pool; a worker killed mid-step ends only its own episode; the
split step refuses a wrong order; overlap off keeps the lockstep schedule; ``rollout.overlap`` reaches the
collect calls.

Real household and TextWorld environments and the real tiny transformers engine throughout; the spies
below only log the calls they pass on.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from horizonrl import store
from horizonrl.envs.batch import InProcess
from horizonrl.envs.household import HouseholdEnv, HouseholdSuite
from horizonrl.envs.pool import EnvPool
from horizonrl.rollout.branching import collect_branches
from horizonrl.rollout.loop import SamplingSettings, collect
from horizonrl.seeding import derive_seed

SEED = 5
STALL_TASK = 2  # the household task whose first step stalls (slot 2: half B, worker 0 of 2)
STALL_DIR = "HORIZONRL_TEST_STALL_DIR"  # where the stalled worker writes its pid


def _sampling(**kw) -> SamplingSettings:
    return SamplingSettings(
        **dict(
            action_mode="admissible",
            context="window",
            history_turns=2,
            max_turns=4,
            max_action_tokens=12,
            temperature=1.0,
            seed=SEED,
        )
        | kw
    )


def _tables(records) -> tuple:
    """Everything stored about the records but the timings: token ids, log-probs, actions, rewards, status."""
    turns = store.turns_table(records)
    return turns.drop_columns(["gen_s", "env_s"]), store.episodes_table(records, "r", 1, 0)


@pytest.fixture(scope="module")
def household_pool():
    with EnvPool("household", 0, n_workers=2) as pool:
        yield pool


class _LoggedBatch(InProcess):
    """The in-process batch, logging each split step call before passing it on."""

    def __init__(self, suite, log: list) -> None:
        super().__init__(suite)
        self.log = log

    def step_start(self, actions) -> None:
        self.log.append(("start", sorted(actions)))
        super().step_start(actions)

    def step_finish(self):
        self.log.append(("finish",))
        return super().step_finish()


class _LoggedEngine:
    """The real engine, logging each call's batch size and seed."""

    def __init__(self, inner, log: list) -> None:
        self.inner, self.log = inner, log

    def generate(self, request):
        self.log.append(("generate", len(request.prompts), request.seed))
        return self.inner.generate(request)

    def session(self):
        return self.inner.session()


def _playing(records, slots, k: int) -> list[int]:
    """The slots of ``slots`` that played a k-th step (turn index k)."""
    return [s for s in slots if len(records[s].turns) > k]


@pytest.mark.parametrize("overlap", [False, True])
def test_schedule_is_lockstep_or_the_two_half_pipeline(tiny_policy, household_suite, overlap):
    _, _, fmt, engine = tiny_policy
    tasks = household_suite.tasks("train", "easy", 5)
    log: list = []
    with _LoggedBatch(household_suite, log) as envs:
        records = collect(envs, tasks, 1, _LoggedEngine(engine, log), fmt, _sampling(overlap=overlap))
    turns = max(len(r.turns) for r in records)
    assert turns > 1
    if not overlap:  # every playing episode in each engine call, then its step
        expected = []
        for k in range(turns):
            slots = _playing(records, range(5), k)
            expected += [("generate", len(slots), derive_seed(SEED, "turn", k)), ("start", slots), ("finish",)]
        assert log == expected
        return
    # Halves A = slots 0-2 (ceil(5/2)) and B = 3-4. Round i generates half i mod 2's next turn (if it has
    # one) while the previous round's step is in flight, then gathers that step and sends its own.
    halves, expected, in_flight = [range(0, 3), range(3, 5)], [], False
    for i in range(2 * turns + 1):
        h, k = i % 2, i // 2
        slots = _playing(records, halves[h], k)
        if slots:
            expected.append(("generate", len(slots), derive_seed(SEED, "turn", k, h)))
        if in_flight:
            expected.append(("finish",))
        if slots:
            expected.append(("start", slots))
        in_flight = bool(slots)
    assert log[:5] == [
        ("generate", 3, derive_seed(SEED, "turn", 0, 0)),
        ("start", [0, 1, 2]),
        ("generate", 2, derive_seed(SEED, "turn", 0, 1)),
        ("finish",),
        ("start", [3, 4]),
    ]
    assert log == expected


def test_overlap_off_is_the_default(tiny_policy, household_suite):
    _, _, fmt, engine = tiny_policy
    tasks = household_suite.tasks("train", "easy", 3)
    for context in ("window", "full"):
        default = collect(household_suite, tasks, 2, engine, fmt, _sampling(context=context))
        off = collect(household_suite, tasks, 2, engine, fmt, _sampling(context=context, overlap=False))
        assert _tables(off) == _tables(default)


@pytest.mark.parametrize("context", ["window", "full"])
def test_overlap_records_match_between_in_process_and_pool(tiny_policy, household_suite, household_pool, context):
    _, _, fmt, engine = tiny_policy
    tasks = household_suite.tasks("train", "easy", 3)
    local = collect(household_suite, tasks, 2, engine, fmt, _sampling(context=context, max_turns=6, overlap=True))
    pooled = collect(household_pool, tasks, 2, engine, fmt, _sampling(context=context, max_turns=6, overlap=True))
    assert _tables(pooled) == _tables(local)
    assert all(r.status in ("won", "done", "truncated") for r in local) and max(len(r.turns) for r in local) > 1


def test_overlap_branches_replay_and_match_between_backends(tiny_policy, household_suite, household_pool):
    from horizonrl.rollout.branching import plan_branches
    from methods.appo import BranchingParams

    _, tokenizer, fmt, engine = tiny_policy
    sampling = _sampling(context="full", max_turns=5, max_action_tokens=24, overlap=True)
    initial = collect(household_suite, household_suite.tasks("train", "easy", 2), 3, engine, fmt, sampling)
    starts, _, _ = plan_branches(initial, 3, BranchingParams(), tokenizer)
    local = collect_branches(household_suite, starts, engine, fmt, sampling, first_rollout_id=100)
    pooled = collect_branches(household_pool, starts, engine, fmt, sampling, first_rollout_id=100)
    assert _tables(pooled) == _tables(local)
    for b, start in zip(local, starts):
        flat, parent = (
            [t for x in b.turns for t in x.gen.token_ids],
            [t for x in start.parent.turns for t in x.gen.token_ids],
        )
        assert b.kind == "branch" and b.status != "error" and flat[: start.split + 1] == parent[: start.split + 1]


@pytest.fixture(scope="module")
def textworld_policy(tmp_path_factory, tw_root):
    """Two easy TextWorld coin-collector games (the suite's shared folder) and a tiny model over their corpus."""
    from horizonrl.config import ModelConfig, TinyModelConfig
    from horizonrl.engines.hf import TransformersEngine
    from horizonrl.envs.textworld_env import TextWorldSuite
    from horizonrl.models.loading import load_policy, tiny_model_dir
    from horizonrl.rollout.prompting import ChatFormat

    root = tmp_path_factory.mktemp("overlap-textworld")
    suite = TextWorldSuite("textworld-coin", root=tw_root)
    tasks = suite.tasks("train", "easy", 2)
    suite.prepare(tasks)
    tiny = TinyModelConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1)
    model, tokenizer = load_policy(tiny_model_dir(root, suite.name, ModelConfig(tiny=tiny), suite.corpus(n_tasks=1)))
    fmt = ChatFormat.for_tokenizer(tokenizer)
    return suite, tasks, fmt, TransformersEngine(model, tokenizer.pad_token_id, [fmt.end_id])


@pytest.mark.slow
def test_overlap_records_match_between_backends_on_textworld(textworld_policy):
    from horizonrl.envs.textworld_env import TextWorldSuite

    suite, tasks, fmt, engine = textworld_policy
    sampling = _sampling(context="full", max_turns=6, max_action_tokens=32, overlap=True)
    local = collect(suite, tasks, 2, engine, fmt, sampling)
    with EnvPool(functools.partial(TextWorldSuite, suite.name, root=suite.root), 0, n_workers=2) as pool:
        pooled = collect(pool, tasks, 2, engine, fmt, sampling)
    assert _tables(pooled) == _tables(local)
    assert all(r.status != "error" for r in local) and max(len(r.turns) for r in local) > 1


class _StallingEnv(HouseholdEnv):
    """Household, whose first step of task ``STALL_TASK`` stalls: in a pool worker (``STALL_DIR`` set) it
    writes the worker's pid there and sleeps until killed; in this process it raises. A test double of
    the failure only."""

    stall = False

    def reset(self, task):
        self.stall = task.index == STALL_TASK
        return super().reset(task)

    def step(self, action: str):
        stall, self.stall = self.stall, False
        if stall and STALL_DIR not in os.environ:
            raise RuntimeError("stalled")
        if stall:
            marker = Path(os.environ[STALL_DIR]) / "stalled"
            marker.with_suffix(".tmp").write_text(str(os.getpid()))
            marker.with_suffix(".tmp").rename(marker)
            time.sleep(600)
        return super().step(action)


class _StallingSuite(HouseholdSuite):
    def make(self) -> _StallingEnv:
        return _StallingEnv()


def stalling_suite(seed: int) -> _StallingSuite:
    """Picklable factory: the pool's workers import this module and call it."""
    return _StallingSuite(seed)


def _kill_when_stalled(marker: Path, killed: list[int]) -> None:
    """SIGKILL the process whose pid appears in ``marker`` (within a minute)."""
    deadline = time.monotonic() + 60
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    if marker.exists():
        killed.append(int(marker.read_text()))
        os.kill(killed[0], signal.SIGKILL)


def test_a_worker_killed_mid_step_ends_only_its_episode(tiny_policy, household_suite, tmp_path, monkeypatch):
    _, _, fmt, engine = tiny_policy
    tasks = household_suite.tasks("train", "easy", 4)
    assert [t.index for t in tasks] == [0, 1, 2, 3]
    reference = collect(
        stalling_suite(0), tasks, 1, engine, fmt, _sampling(overlap=True)
    )  # raises in place of the stall
    monkeypatch.setenv(STALL_DIR, str(tmp_path))
    killed: list[int] = []
    with EnvPool(stalling_suite, 0, n_workers=2) as pool:
        pids = pool.pids
        killer = threading.Thread(target=_kill_when_stalled, args=(tmp_path / "stalled", killed))
        killer.start()
        records = collect(pool, tasks, 1, engine, fmt, _sampling(overlap=True))
        killer.join()
        assert killed == [pids[0]] and pool.restarts == 1 and killed[0] not in pool.pids
    bad = records[STALL_TASK]
    assert (
        bad.status == "error" and "step failed: worker process died" in bad.error and len(bad.turns) == 1
    )  # the kill, not the step timeout
    assert reference[STALL_TASK].status == "error" and "stalled" in reference[STALL_TASK].error
    healthy = [r for r in records if r is not bad]
    assert all(r.status in ("won", "done", "truncated") and r.turns for r in healthy)
    # slot 0 shared the killed worker and was rebuilt by replay: every other episode plays as in the reference
    others = [r for r in reference if r.rollout_id != bad.rollout_id]
    assert _tables(healthy)[0] == _tables(others)[0]


@pytest.mark.parametrize("backend", ["in_process", "pool"])
def test_split_step_refuses_a_wrong_order(household_suite, backend):
    envs = InProcess(household_suite) if backend == "in_process" else EnvPool("household", 0, n_workers=1)
    with envs:
        starts = envs.reset_many(household_suite.tasks("train", "easy", 2))
        actions = {slot: info["admissible_commands"][0] for slot, (_, info) in enumerate(starts)}
        with pytest.raises(RuntimeError, match="step_finish with no step in flight"):
            envs.step_finish()
        envs.step_start(actions)
        with pytest.raises(RuntimeError, match="step_start while a step is in flight"):
            envs.step_start(actions)
        with pytest.raises(RuntimeError, match="reset_many while a step is in flight"):
            envs.reset_many(household_suite.tasks("train", "easy", 2))
        results = envs.step_finish()  # the refused calls left the step in flight untouched
        with pytest.raises(RuntimeError, match="step_finish with no step in flight"):
            envs.step_finish()
    with InProcess(household_suite) as reference:
        reference.reset_many(household_suite.tasks("train", "easy", 2))
        assert results == reference.step_many(actions)


class _FailingEngine:
    """The real engine, raising on its third call: half A's second turn, while half B's step is in flight."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, 0

    def generate(self, *args):
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError("engine down")
        return self.inner.generate(*args)

    def session(self):
        return self.inner.session()


def test_an_engine_error_leaves_no_step_in_flight(tiny_policy, household_suite, household_pool):
    _, _, fmt, engine = tiny_policy
    tasks = household_suite.tasks("train", "easy", 2)
    with pytest.raises(RuntimeError, match="engine down"):
        collect(household_pool, tasks, 2, _FailingEngine(engine), fmt, _sampling(overlap=True))
    retried = collect(household_pool, tasks, 2, engine, fmt, _sampling(overlap=True))  # as a task retry would
    assert _tables(retried) == _tables(collect(household_suite, tasks, 2, engine, fmt, _sampling(overlap=True)))


def test_config_turns_overlap_on_for_collect():
    from horizonrl.config import TrainConfig

    assert TrainConfig().rollout.overlap is False
    cfg = TrainConfig(env={"max_turns": 4}, rollout={"overlap": True})
    assert (
        SamplingSettings.from_config(cfg, HouseholdSuite(0), 0).overlap is True
    )  # what collect and collect_branches get
