"""The local stack on PostgreSQL (``horizonrl stack up --database postgres``), with more concurrent writers
than SQLite takes: a sweep deployment fanning four cells out at once to the train deployment, and two
``horizonrl train`` processes started beside it, all on one data folder and one MLflow server. Nothing is
mocked: Debian's PostgreSQL (``make setup-test`` installs it), ``prefect server`` and ``mlflow server`` on
it, a process worker. Every run must finish whole: each iteration's metrics logged exactly once, its
episodes stored once, no lock or database error in any log; and no process is left after ``stack down``.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest
from mlflow import MlflowClient

from flowkit import REPO, deployed_sweep, flat, free_port, leftovers, prefect_cli, run_of, steps, tiny_config
import horizonrl_stack as stack
from horizonrl import store

pytestmark = pytest.mark.slow
SWEEP = "pg-sweep"
SOLO = ("solo-a", "solo-b")
CELLS = 4
ERRORS = ("Traceback", "locked", "deadlock", "could not serialize", "too many clients")


@pytest.fixture(scope="module")
def pg_stack(tmp_path_factory):
    """A PostgreSQL-backed stack on free loopback ports. Its store is a fresh folder in the system's temp
    directory: as root, PostgreSQL runs as user ``postgres``, which cannot enter pytest's 0700 folders."""
    root = tmp_path_factory.mktemp("pg")
    store_dir = Path(tempfile.mkdtemp(prefix="horizonrl-pg-store-"))
    store_dir.chmod(0o711)
    prefect_home = root / "prefect-home"
    s = stack.Stack(home=root / ".stack", store=store_dir, prefect_port=free_port(), mlflow_port=free_port(), postgres_port=free_port(),
                    database="postgres", env={"PREFECT_HOME": str(prefect_home), "PREFECT_WORKER_QUERY_SECONDS": "1",
                                              "PREFECT_UI_ENABLED": "false", "TOKENIZERS_PARALLELISM": "false"})
    stack.up(s)
    try:
        yield s, root
    finally:
        stopped = stack.down(s)
        shutil.rmtree(store_dir, ignore_errors=True)
    assert stopped == ["worker", "prefect", "mlflow", "postgres"]
    assert not leftovers(str(prefect_home)), f"processes left after stack down: {leftovers(str(prefect_home))}"


def _postgres_holds(s: stack.Stack) -> dict[str, int]:
    """Rows in the tables that prove both servers store in PostgreSQL, not in a SQLite file."""
    import psycopg

    counts = {}
    for database, table in (("prefect", "flow_run"), ("mlflow", "runs"), ("mlflow", "metrics")):
        with psycopg.connect(host=stack.HOST, port=s.postgres_port, user=stack.PG_USER, dbname=database,
                             password=s.pg_password_file.read_text().strip()) as conn:
            counts[f"{database}.{table}"] = conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
    return counts


def test_sweep_and_two_runs_write_at_once_on_postgres(pg_stack):
    s, root = pg_stack
    env = s.environ()
    sweep_file = deployed_sweep(root, s.mlflow_uri, SWEEP, iterations=2, concurrency=CELLS)
    base = tiny_config(root, s.mlflow_uri, iterations=2)
    prefect_cli(env, "deploy", "--all", timeout=180)
    assert not list(Path(env["PREFECT_HOME"]).glob("*.db")), "Prefect's server must not keep a SQLite database"

    logs = {name: root / f"{name}.log" for name in (SWEEP, *SOLO)}
    with open(logs[SWEEP], "w") as out:
        procs = {SWEEP: subprocess.Popen([str(Path(sys.executable).parent / "prefect"), "--no-prompt", "deployment", "run", "sweep/sweep",
                                          "--param", f"sweep_path={sweep_file}", "--watch", "--watch-timeout", "600"],
                                         cwd=REPO, env={**env, "PWD": str(REPO)}, stdout=out, stderr=subprocess.STDOUT)}
    for name in SOLO:
        cfg = {**base, "run_name": name, "method": "loop", "seed": 5}
        with open(logs[name], "w") as out:
            procs[name] = subprocess.Popen([sys.executable, "-m", "flows.cli", "train", *(f"--set={k}={v}" for k, v in flat(cfg).items())],
                                           cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    for name, proc in procs.items():
        rc = proc.wait(timeout=660)
        assert rc == 0, f"{name} failed:\n{logs[name].read_text()[-3000:]}"
    for log in [*logs.values(), s.home / "worker.log", s.home / "mlflow.log", s.home / "prefect.log"]:
        text = log.read_text()
        assert not [e for e in ERRORS if e in text], f"{log.name}:\n{text[-3000:]}"
    # PostgreSQL logs a refused INSERT even when the writer expects it and recovers; the only ones allowed:
    # metric_pk (MLflow re-sends a run's metrics when a model is logged and skips the rows it has),
    # trace_info_pk (MLflow's trace start racing the same trace's spans: it rereads the row and merges),
    # pk_task_run (Prefect's task-run recorder racing a concurrent one: it retries against the row),
    # dataset_pk (the two solo runs log identical tables at once; tracking.log_parquet_input tries again).
    recovered = ('unique constraint "metric_pk"', 'unique constraint "trace_info_pk"', 'unique constraint "pk_task_run"',
                 'unique constraint "dataset_pk"')
    pg_errors = [line for line in (s.home / "postgres.log").read_text().splitlines() if " ERROR: " in line]
    assert all(any(r in line for r in recovered) for line in pg_errors), pg_errors

    # the four cells really ran at the same time, as flow runs of the train deployment
    flow_runs = httpx.post(f"{s.prefect_api}/flow_runs/filter", json={"flow_runs": {"name": {"like_": f"{SWEEP}--"}}}).json()
    assert len(flow_runs) == CELLS and all(r["state_type"] == "COMPLETED" and r["deployment_id"] for r in flow_runs)
    spans = [(r["start_time"], r["end_time"]) for r in flow_runs]
    assert max(sum(a <= t < b for a, b in spans) for t, _ in spans) >= 3, spans

    c = MlflowClient(s.mlflow_uri)
    exp = c.get_experiment_by_name("test")
    parent = run_of(c, SWEEP)
    children = c.search_runs([exp.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    assert parent.info.status == "FINISHED" and len(children) == CELLS
    runs = [run_of(c, name) for name in [r.info.run_name for r in children] + list(SOLO)]
    spans = [(r.info.start_time, r.info.end_time) for r in runs]
    writers = max(sum(a <= t < b for a, b in spans) for t, _ in spans)
    print(f"\nMLflow runs writing at once: {writers} of {len(runs)}")
    assert writers >= 4, spans
    for run in runs:
        name = run.info.run_name
        assert run.info.status == "FINISHED", name
        for key in ("collect/success_rate", "advantage/kept_fraction", "update/steps", "time/iteration_s"):
            assert steps(c, run.info.run_id, key) == [1, 2], (name, key)
        assert steps(c, run.info.run_id, "eval/success_rate") == [0, 1, 2], name
        for it in (1, 2):
            episodes = store.read_table(store.iteration_dir(root / "data", "test", name, it) / "episodes.parquet", "episodes")
            assert episodes.num_rows == 4 and set(episodes["run_name"].to_pylist()) == {name}
    held = _postgres_holds(s)
    assert held["prefect.flow_run"] >= CELLS + 1 + len(SOLO) and held["mlflow.runs"] == 1 + CELLS + len(SOLO), held
    assert held["mlflow.metrics"] > 0 and not (Path(s.store) / "mlflow.db").exists()


def test_postgres_stack_refuses_a_store_postgres_cannot_enter(tmp_path):
    """As root the cluster runs as user ``postgres``: a store inside a 0700 folder is named, before any start."""
    if os.geteuid() != 0:
        pytest.skip("only root hands the cluster to the postgres user")
    closed = tmp_path / "closed"
    closed.mkdir(mode=0o700)
    s = stack.Stack(home=tmp_path / ".stack", store=closed / "store", database="postgres", postgres_port=free_port())
    with pytest.raises(RuntimeError, match=r"cannot enter .*closed"):
        stack.up(s)
    assert all(v is None for v in stack.status(s).values())


def test_stack_refuses_a_port_in_use_before_starting_anything(tmp_path):
    with socket.socket() as taken:
        taken.bind((stack.HOST, 0))
        taken.listen()
        port = taken.getsockname()[1]
        s = stack.Stack(home=tmp_path / ".stack", store=tmp_path / "store", prefect_port=free_port(), mlflow_port=free_port(),
                        database="postgres", postgres_port=port)
        with pytest.raises(RuntimeError, match=rf"port {port} \(postgres\) is already in use on 127\.0\.0\.1: choose another with --postgres-port"):
            stack.up(s)
    assert not (tmp_path / "store").exists() and not (tmp_path / ".stack").exists()
