"""What survives what: SIGKILL at every stage, Prefect retries, non-finite steps, concurrent runs, a full disk.

Crashes are real: the train CLI runs as its own process and kills itself with SIGKILL at a named point
(``HORIZONRL_FAULT``, the documented fault-injection facility in ``horizonrl/faults.py``). CLI processes
share the session's Prefect test server, so none of them starts its own.
"""

from __future__ import annotations

import errno
import gc
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from flowkit import REPO, CLIProcess, flat, leftovers, newest_checkpoint, run_of, steps, tiny_config
from safetensors.torch import load_file

from horizonrl import faults, store
from horizonrl.files import file_digest
from horizonrl.models.loading import load_policy
from horizonrl.run import runlock
from horizonrl.tracking import report
from horizonrl.training.checkpoint import (
    CheckpointWriteError,
    checkpoint_dir,
    load_optimizer_state,
    save_checkpoint,
)
from mlflow import MlflowClient

RUN = "r"


def config(root: Path, run_name: str = RUN, iterations: int = 2, **changes) -> dict:
    """The tiny run, with a constant advantage (LOOP's kl_lambda) so every update takes real steps: with
    an untrained policy no episode is won, every advantage would be 0 and the weights would never move."""
    cfg = tiny_config(root, f"sqlite:///{root}/mlflow.db", run_name, iterations)
    cfg["advantage_params"] = {"kl_lambda": 0.5}
    cfg["eval"] = {"every": 1, "n_tasks": 2, "greedy": False}
    return {**cfg, **changes}


def run_dir(root: Path, run_name: str = RUN) -> Path:
    return root / "data" / "test" / run_name


@pytest.fixture(scope="module")
def api_url(prefect_harness) -> str:
    """The session's Prefect test server, passed to CLI processes so none starts its own (~20 s each)."""
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value()


def start_cli(
    cfg: dict,
    api_url: str | None,
    log: Path,
    fault: str | None = None,
    command: list[str] | None = None,
    fresh: bool = False,
) -> CLIProcess | subprocess.Popen:
    """``horizonrl train`` with ``cfg`` as --set overrides (or ``horizonrl <command>``), a process in its own
    session; ``api_url`` None: with no API, so that it starts Prefect's temporary server as a user's run does
    (in the log's folder, where no local stack is up, even when one is up in the repository). ``fresh``: the
    console script in a new interpreter, as a user starts it, not a child of the suite's fork server (whose
    children end with ``os._exit``, skipping what the interpreter's own shutdown does)."""
    env = {k: v for k, v in os.environ.items() if k not in (faults.ENV, "PREFECT_API_URL")}
    env.update(PREFECT_HOME=str(log.parent / "prefect"), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    if api_url:
        env["PREFECT_API_URL"] = api_url
    if fault:
        env[faults.ENV] = fault
    args = command or ["train", *(f"--set={k}={v}" for k, v in flat(cfg).items())]
    log.write_text("")
    cwd = REPO if api_url else log.parent
    if fresh:
        with open(log, "w") as out:
            return subprocess.Popen(
                [str(Path(sys.executable).with_name("horizonrl")), *args],
                env=env,
                cwd=cwd,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
    return CLIProcess(args, env, log, new_session=True, cwd=cwd)


def finish(proc: CLIProcess | subprocess.Popen, timeout: float = 300) -> int:
    """Wait for the CLI, then kill whatever it left in its session (a killed process cleans up nothing)."""
    rc = proc.wait(timeout=timeout)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return rc


def metric_steps(tracking_uri: str, run_name: str) -> dict[str, list[int]]:
    c = MlflowClient(tracking_uri)
    run = run_of(c, run_name)
    return {k: sorted(m.step for m in c.get_metric_history(run.info.run_id, k)) for k in run.data.metrics}


def logged_at(root: Path, key: str, step: int) -> bool:
    return step in metric_steps(f"sqlite:///{root}/mlflow.db", RUN).get(key, [])


def files(d: Path) -> set[str]:
    return {str(p.relative_to(d)) for p in d.rglob("*") if p.is_file()}


def assert_same_tensors(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k} differs"


def test_fault_spec_is_checked(monkeypatch):
    """A misspelt fault must fail loudly: a test meaning to inject it would otherwise pass without it."""
    monkeypatch.setenv(faults.ENV, "collect:2,nan-grad:1")
    assert faults.active("collect", 2) and faults.active("nan-grad", 1)
    assert not faults.active("collect", 1) and not faults.active("update", 2)
    monkeypatch.setenv(faults.ENV, "colect:2")
    with pytest.raises(ValueError, match="'colect:2' is not <point>:<iteration>"):
        faults.active("collect", 2)


# (fault, newest complete checkpoint after the kill, metric the kill kept from being logged, what the
# restarted process says). Each fault lies later in the run than the one before, so each restart
# resumes the killed one and then is killed itself; a last start without a fault finishes the run.
# Evaluation every 2 iterations: the start after the kill at collect:2 resumes at iteration 1, off that
# schedule, and must not evaluate there.
CYCLE = [
    ("advantage:1", 0, ("advantage/kept_fraction", 1), "iteration 1: rollouts already stored, reused"),
    ("update:1", 0, ("update/steps", 1), "iteration 1: rollouts already stored, reused"),
    ("checkpoint:1", 0, ("update/steps", 1), "removed a partial file left by an interrupted run"),
    ("collect:2", 1, ("collect/success_rate", 2), "resumes after iteration 1"),
    ("evaluate:2", 2, ("eval/success_rate", 2), "resumes after iteration 2"),
]
SCHEDULE = {"every": 2, "n_tasks": 2, "greedy": False}
STRAIGHT = "straight"


def without_run_name(table: pa.Table) -> pa.Table:
    return table.drop_columns([c for c in ("run_name",) if c in table.column_names])


@pytest.mark.slow
def test_sigkill_at_every_stage_resumes_to_the_same_run(api_url, tmp_path):
    """A run killed in each stage in turn (one CLI process per kill) ends bit-identical to one never
    killed: the same rollouts, advantages, weights and optimizer state, and the same MLflow steps, once,
    evaluated on the same schedule (so the report's best and area under the curve are the same).

    The uninterrupted run and a sweep (one cell, in its process) start together with the first of the
    killed processes, on one data folder and one new SQLite MLflow store: three processes create the
    store, the experiment and the tiny model at once, and every run finishes whole, with no lock error."""
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump(config(tmp_path, "unused", eval=SCHEDULE)))
    sweep_file = tmp_path / "trio.yaml"
    sweep_file.write_text(yaml.safe_dump({"name": "trio", "base": "base.yaml", "grid": {"seed": [3]}}))
    beside = {
        STRAIGHT: start_cli(config(tmp_path, STRAIGHT, eval=SCHEDULE), api_url, tmp_path / f"{STRAIGHT}.log"),
        "trio": start_cli({}, api_url, tmp_path / "trio.log", command=["sweep", str(sweep_file), "--here"]),
    }
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    logs = []
    for n, (fault, completed, (key, step), _) in enumerate(CYCLE):
        logs.append(tmp_path / f"cli-{n}.log")
        rc = finish(start_cli(config(tmp_path, eval=SCHEDULE), api_url, logs[-1], fault))
        assert rc == -signal.SIGKILL, f"{fault}: the process was not killed (rc {rc}):\n{logs[-1].read_text()[-3000:]}"
        d = run_dir(tmp_path)
        assert newest_checkpoint(d).iteration == completed, fault
        assert not logged_at(tmp_path, key, step), f"{fault}: {key} was logged before the kill"
        if fault == "checkpoint:1":
            assert list((d / "checkpoints").glob(".iter=00001.tmp-*/model.safetensors")), (
                "the kill did not land inside the checkpoint write"
            )
        if fault == "collect:2":
            it2 = store.iteration_dir(tmp_path / "data", "test", RUN, 2)
            assert (it2 / "turns.parquet").is_file() and not (it2 / "episodes.parquet").exists()
    logs.append(tmp_path / "cli-final.log")
    assert finish(start_cli(config(tmp_path, eval=SCHEDULE), api_url, logs[-1])) == 0, logs[-1].read_text()[-3000:]
    for name, proc in beside.items():
        out = (tmp_path / f"{name}.log").read_text()
        assert finish(proc) == 0, out[-3000:]
        assert "locked" not in out and "Traceback" not in out, out[-3000:]
    for (fault, *_, says), restart_log in zip(CYCLE, logs[1:]):
        assert says in restart_log.read_text(), (
            f"the start after the kill at {fault} did not resume from the last completed stage"
        )
    assert "iteration 2: rollouts already stored" not in logs[-2].read_text(), (
        "half-stored rollouts were taken as complete"
    )

    a, b = run_dir(tmp_path, STRAIGHT), run_dir(tmp_path)
    assert files(b) == files(a), "the killed run holds other files than the uninterrupted one"
    assert not [p for p in b.rglob("*") if ".tmp-" in p.name], "a temporary (partial) file was left behind"
    for it in (1, 2):
        da, db = (store.iteration_dir(tmp_path / "data", "test", name, it) for name in (STRAIGHT, RUN))
        for name in ("advantages-loop.parquet", "episodes.parquet"):
            assert without_run_name(pq.read_table(db / name)).equals(without_run_name(pq.read_table(da / name))), (
                it,
                name,
            )
        timing = ["gen_s", "env_s"]  # wall-clock columns, the only ones allowed to differ
        assert without_run_name(pq.read_table(db / "turns.parquet").drop_columns(timing)).equals(
            without_run_name(pq.read_table(da / "turns.parquet").drop_columns(timing))
        ), it
        assert store.read_table(db / "episodes.parquet", "episodes").num_rows == 4  # every rollout once
    ca, cb = checkpoint_dir(a, 2), checkpoint_dir(b, 2)
    assert_same_tensors(load_file(cb / "model.safetensors"), load_file(ca / "model.safetensors"), "weights")
    w0, w2 = load_file(checkpoint_dir(a, 0) / "model.safetensors"), load_file(ca / "model.safetensors")
    assert any(not torch.equal(w0[k], w2[k]) for k in w0), (
        "the updates moved no weight, so equal weights would prove nothing"
    )
    opt_a, opt_b = (torch.load(c / "optimizer.pt", weights_only=True)["state"] for c in (ca, cb))
    assert opt_a.keys() == opt_b.keys()
    for k in opt_a:
        assert_same_tensors(opt_b[k], opt_a[k], f"optimizer state of parameter {k}")
    model, _ = load_policy(cb)  # the resumed run's checkpoint loads, with its optimizer
    assert load_optimizer_state(newest_checkpoint(b), torch.optim.AdamW(model.parameters()))

    killed_steps, straight_steps = metric_steps(uri, RUN), metric_steps(uri, STRAIGHT)
    assert all(len(s) == len(set(s)) for s in killed_steps.values()), "a metric step was logged twice"
    per_process = "time/startup_s"  # one point per process start, at the iteration it starts from
    assert set(killed_steps.pop(per_process)) == {0, 1, 2} and straight_steps.pop(per_process) == [0]
    assert killed_steps == straight_steps and straight_steps["eval/success_rate"] == [0, 2]
    killed, straight = eval_curve(uri, RUN), eval_curve(uri, STRAIGHT)
    assert (
        killed == straight
        and max(killed.values()) == max(straight.values())
        and report.auc(killed) == report.auc(straight)
    )
    assert run_of(MlflowClient(uri), RUN).info.status == "FINISHED"

    cell = "trio--seed=3"  # the sweep's cell, written beside the others
    got = metric_steps(uri, cell)
    for key in ("collect/success_rate", "advantage/kept_fraction", "update/steps", "time/iteration_s"):
        assert got[key] == [1, 2], key
    assert got["eval/success_rate"] == [0, 2]
    for name in (STRAIGHT, cell):
        for it in (1, 2):
            episodes = store.read_table(
                store.iteration_dir(tmp_path / "data", "test", name, it) / "episodes.parquet", "episodes"
            )
            assert episodes.num_rows == 4 and set(episodes["run_name"].to_pylist()) == {name}
        assert newest_checkpoint(run_dir(tmp_path, name)).iteration == 2


def eval_curve(tracking_uri: str, run_name: str) -> dict[int, float]:
    c = MlflowClient(tracking_uri)
    return {m.step: m.value for m in c.get_metric_history(run_of(c, run_name).info.run_id, "eval/success_rate")}


def fail_once(fn: Callable[..., Any], failed: list[str], name: str, when: Callable[..., bool]) -> Callable[..., Any]:
    """``fn``, except that its first call for which ``when(*args)`` holds raises an I/O error."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if name not in failed and when(*args):
            failed.append(name)
            raise OSError(errno.EIO, f"injected {name} failure")
        return fn(*args, **kwargs)

    return wrapper


@pytest.mark.slow
def test_collect_and_evaluate_are_retried_and_write_once(prefect_harness, tmp_path, monkeypatch):
    """Each retried task's first attempt fails half-way through its writes; Prefect's retry finishes the
    run with every file, table row and metric step once. Mocked: the episodes.parquet write and the
    evaluation's metric logging each fail once (after turns.parquet and the episode table are written)."""
    import tasks.evaluate
    from flows.train import train

    failed: list[str] = []
    monkeypatch.setattr(
        store,
        "write_table",
        fail_once(store.write_table, failed, "collect", lambda table, path, kind: kind == "episodes"),
    )
    monkeypatch.setattr(
        tasks.evaluate,
        "log_stage",
        fail_once(tasks.evaluate.log_stage, failed, "evaluate", lambda ctx, stage, *rest: stage == "eval"),
    )
    train(config=config(tmp_path, iterations=1))
    assert failed == ["evaluate", "collect"]
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    assert metric_steps(uri, RUN)["collect/success_rate"] == [1]
    assert metric_steps(uri, RUN)["eval/success_rate"] == [0, 1]
    d = store.iteration_dir(tmp_path / "data", "test", RUN, 1)
    assert sorted(p.name for p in d.iterdir()) == [
        "advantages-loop.parquet",
        "episodes.parquet",
        "eval-episodes.parquet",  # the evaluation after the iteration, stored beside its rollouts
        "eval-turns.parquet",
        "turns.parquet",
    ]
    episodes, turns = (
        store.read_table(d / "episodes.parquet", "episodes"),
        store.read_table(d / "turns.parquet", "turns"),
    )
    assert episodes.num_rows == 4 and sum(episodes["n_turns"].to_pylist()) == turns.num_rows  # the retry's pair
    c = MlflowClient(uri)
    run = run_of(c, RUN)
    table = c.load_table(run.info.experiment_id, "episodes/eval_iter_00000.json", run_ids=[run.info.run_id])
    assert len(table) > 0 and not table.duplicated(subset=["rollout_id", "turn"]).any(), (
        "the retried evaluation logged its episode table twice"
    )


@pytest.mark.slow
def test_nonfinite_steps_are_skipped_and_counted_and_too_many_abort(prefect_harness, tmp_path, monkeypatch):
    """NaN gradients (fault point ``nan-grad``) skip every step of iteration 1, counted; at iteration 2
    the count passes ``update.max_nan_skips`` and the run stops, naming the limit, with checkpoint 1
    left byte for byte as it was."""
    from flows.train import train
    from tasks.update import TooManyNonFiniteSteps

    cfg = config(
        tmp_path,
        iterations=1,
        update={"minibatch_size": 2, "max_nan_skips": 4},
        eval={"every": 10, "n_tasks": 2, "greedy": False},
    )
    monkeypatch.setenv(faults.ENV, "nan-grad:1")
    train(config=cfg)
    d = run_dir(tmp_path)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    c = MlflowClient(uri)
    metrics = run_of(c, RUN).data.metrics
    assert metrics["update/steps"] == 0 and 3 <= metrics["update/nonfinite_steps"] <= 4  # 2 epochs x 2 minibatches
    w0, w1 = (load_file(checkpoint_dir(d, i) / "model.safetensors") for i in (0, 1))
    assert_same_tensors(w1, w0, "weights after skipped steps")
    before = {p: file_digest(p) for p in checkpoint_dir(d, 1).iterdir()}

    monkeypatch.setenv(faults.ENV, "nan-grad:2")
    with pytest.raises(TooManyNonFiniteSteps, match=r"update\.max_nan_skips = 4\); last good checkpoint: .*iter=00001"):
        train(config={**cfg, "iterations": 2})
    assert newest_checkpoint(d).iteration == 1 and not checkpoint_dir(d, 2).exists()
    assert {p: file_digest(p) for p in checkpoint_dir(d, 1).iterdir()} == before
    assert not [p for p in d.rglob("*") if ".tmp-" in p.name]
    assert steps(c, run_of(c, RUN).info.run_id, "update/steps") == [1]
    assert run_of(c, RUN).info.status == "FAILED", "a failed flow marks its MLflow run FAILED"
    monkeypatch.delenv(faults.ENV)
    train(config={**cfg, "iterations": 2})  # the same run name resumes the run, which ends FINISHED
    assert run_of(c, RUN).info.status == "FINISHED" and steps(c, run_of(c, RUN).info.run_id, "update/steps") == [1, 2]


@pytest.fixture(params=["tmpfs", "fsync", "read-only"])
def full_disk(request, tmp_path: Path, monkeypatch) -> Iterator[tuple[Path, Callable[[], None], int]]:
    """(folder, fill, errno): after ``fill()`` every write into the folder fails with ``errno``.

    tmpfs: a real 4 MiB tmpfs filled up with a file (ENOSPC; needs root to mount, which the tests run as).
    fsync: mocked, ``os.fsync`` raises ENOSPC, as it does where a filesystem allocates on flush.
    read-only: the same tmpfs remounted read-only (EROFS: as root, a folder's permissions stop nothing)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if request.param == "fsync":

        def fill() -> None:
            def no_space(fd: int) -> None:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

            monkeypatch.setattr(os, "fsync", no_space)

        yield disk, fill, errno.ENOSPC
        return
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], check=True)

    def fill() -> None:
        with open(disk / "filler", "wb", buffering=0) as f:  # unbuffered: nothing left to flush on close
            try:
                while True:
                    f.write(b"\0" * 65536)
            except OSError as err:
                assert err.errno == errno.ENOSPC

    def read_only() -> None:
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)

    try:
        yield (
            disk,
            (read_only if request.param == "read-only" else fill),
            (errno.EROFS if request.param == "read-only" else errno.ENOSPC),
        )
    finally:
        gc.collect()  # a failed writer's frame, kept by the exception's traceback, holds a file open there
        subprocess.run(["umount", str(disk)], check=True)


def test_full_disk_while_writing_parquet_keeps_the_previous_file(full_disk):
    disk, fill, code = full_disk
    path = disk / "iter=00001" / "advantages-loop.parquet"
    n = 50_000

    def table(rows: int) -> pa.Table:
        return pa.table(
            {
                "rollout_id": pa.array(range(rows), pa.int64()),
                "turn": pa.array([0] * rows, pa.int32()),
                "adv": pa.array([i / 7 for i in range(rows)]),
                "keep": pa.array([True] * rows),
                "adv_tokens": pa.array([None] * rows, pa.list_(pa.float64())),
            },
            schema=store.ADVANTAGES,
        )

    store.write_table(table(3), path, "advantages")
    before = path.read_bytes()
    fill()
    with pytest.raises(OSError) as err:
        store.write_table(table(n), path, "advantages")
    assert err.value.errno == code and str(path) in str(err.value) and "is unchanged" in str(err.value)
    assert path.read_bytes() == before
    assert sorted(p.name for p in path.parent.iterdir()) == ["advantages-loop.parquet"]
    assert store.read_table(path, "advantages").num_rows == 3


def test_full_disk_while_writing_a_checkpoint_keeps_the_previous_one(full_disk, tiny_policy):
    disk, fill, code = full_disk
    model, tokenizer, *_ = tiny_policy
    save_checkpoint(disk, 1, model, tokenizer, None, {})
    first = checkpoint_dir(disk, 1)
    before = {p.name: file_digest(p) for p in first.iterdir()}
    fill()
    with pytest.raises(CheckpointWriteError) as err:
        save_checkpoint(disk, 2, model, tokenizer, None, {})
    assert str(checkpoint_dir(disk, 2)) in str(err.value) and os.strerror(code) in str(err.value)
    assert {p.name: file_digest(p) for p in first.iterdir()} == before
    assert sorted(p.name for p in (disk / "checkpoints").iterdir()) == ["iter=00001"]  # no partial folder
    assert newest_checkpoint(disk).iteration == 1


def test_a_second_process_on_a_held_run_is_refused_naming_the_holder(prefect_harness, tmp_path, capsys):
    """While a process holds the run folder (here this test itself), ``horizonrl train`` on the same run
    name stops before it touches anything: no MLflow store, no checkpoint, the holder's temporary file
    (which a stale-temporary clean-up would delete) left alone, and the holder's lock intact."""
    from flows.cli import main

    d = run_dir(tmp_path)
    with runlock.hold(d) as lock:
        partial = d / ".episodes.parquet.tmp-1"  # a file the holder is writing
        partial.write_bytes(b"half")
        assert main(["train", *(f"--set={k}={v}" for k, v in flat(config(tmp_path, iterations=1)).items())]) == 1
        err = capsys.readouterr().err
        assert (
            f"run folder {d} is in use by pid {os.getpid()} on host {lock.holder['host']}, started "
            f"{lock.holder['started']}" in err
        ), err
        assert partial.read_bytes() == b"half"
    assert sorted(p.name for p in d.iterdir()) == [".episodes.parquet.tmp-1"]  # the holder's release took its lock
    assert not (tmp_path / "mlflow.db").exists()


def flow_run_state(prefect_home: Path, flow_run_id: str) -> str:
    with sqlite3.connect(prefect_home / "prefect.db") as db:
        rows = db.execute("SELECT id, state_type FROM flow_run").fetchall()
    return {str(i).replace("-", ""): state for i, state in rows}[flow_run_id.replace("-", "")]


@pytest.mark.slow
def test_second_process_refused_and_a_killed_run_leaves_no_server(api_url, tmp_path, capsys):
    """A user's ``horizonrl train`` (no Prefect server configured: it starts a temporary one) is running; a
    second start on the same run name (in this test's process) is refused, naming it. The first is then
    SIGKILLed: its temporary server survives it (re-parented). The next run of that name stops that server, marks the
    dead flow run crashed, and finishes; afterwards no server process of this Prefect home is left."""
    from flows.cli import TEMPORARY_SERVER_IDLE, main

    home = tmp_path / "prefect"
    long = config(tmp_path, iterations=50, eval={"every": 50, "n_tasks": 2, "greedy": False})
    first = start_cli(long, None, tmp_path / "first.log")
    lock_file = run_dir(tmp_path) / runlock.LOCK_FILE
    holder: dict = {}
    for _ in range(1200):  # the temporary server takes ~20 s to start on a busy machine
        holder = json.loads(lock_file.read_text() or "{}") if lock_file.is_file() else {}
        if holder.get("flow_run_id") or first.poll() is not None:
            break
        time.sleep(0.25)
    assert holder.get("pid") == first.pid and first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]

    assert main(["train", *(f"--set={k}={v}" for k, v in flat(long).items())]) == 1  # the second, in this process
    err = capsys.readouterr().err
    assert (
        f"is in use by pid {first.pid} on host {holder['host']}" in err
        and "Traceback" not in err.split("horizonrl: run")[-1]
    ), err[-3000:]

    os.kill(first.pid, signal.SIGKILL)  # the CLI process alone, as `kill -9` does
    first.wait()
    orphans = runlock.orphaned_prefect_servers(home)
    assert orphans and leftovers(str(home)), "the killed run left no server behind, so the test would check nothing"
    server_env = Path(f"/proc/{orphans[0]}/environ").read_bytes().split(b"\0")
    assert all(f"{name}=false".encode() in server_env for name in TEMPORARY_SERVER_IDLE)  # its idle loops off

    third = start_cli(
        config(tmp_path, iterations=1, eval={"every": 50, "n_tasks": 2, "greedy": False}),
        None,
        tmp_path / "third.log",
        fresh=True,
    )
    assert finish(third) == 0, (tmp_path / "third.log").read_text()[-3000:]
    out = (tmp_path / "third.log").read_text()
    assert f"stopped Prefect's temporary API server (pid {orphans[0]})" in out and "crashed" in out, out[-3000:]
    # the summary is the last thing said: the run's own temporary server is stopped before it
    assert out.index("Stopping temporary server") < out.index("== horizonrl: run finished ==")
    assert out.strip().splitlines()[-1] == f"data: {tmp_path / 'data' / 'test' / RUN}", out[-1000:]
    assert leftovers(str(home)) == []
    assert flow_run_state(home, holder["flow_run_id"]) == "CRASHED"
    # the run's last words reached its temporary server before it stopped: on main they were still queued
    # when it stopped, and the process spent a minute after the summary sending them to it, then said so
    assert "Error logging to API" not in out, out[-3000:]
    with sqlite3.connect(home / "prefect.db") as db:
        said = db.execute(
            "SELECT log.message FROM log JOIN flow_run ON log.flow_run_id = flow_run.id "
            "WHERE flow_run.state_type = 'COMPLETED' AND log.task_run_id IS NULL AND log.name = 'prefect.flow_runs'"
        ).fetchall()
    assert ("Finished in state Completed()",) in said, said
    assert run_of(MlflowClient(f"sqlite:///{tmp_path}/mlflow.db"), RUN).info.status == "FINISHED"
