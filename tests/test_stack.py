"""End-to-end on the real local stack as the study runs it: PostgreSQL behind ``prefect server`` and
``mlflow server`` (``horizonrl stack up --database postgres``), a process worker, all on loopback (free
ports, PREFECT_HOME and the store in temporary folders); ``prefect deploy --all`` from the project's
``prefect.yaml``; the sweep deployment run with ``prefect deployment run`` on a tiny grid (loop, grpo x 2
seeds, 1 iteration, two cells at a time) fanned out to the train deployment, and two ``horizonrl train``
processes started beside it on the same data folder and MLflow server (up to four runs writing at once).
Nothing is mocked. Every run must finish whole: each iteration's metrics logged once, its episodes stored
once, no lock or database error in any log.

One stack serves the module's tests; the fixture takes it down and checks that no process is left. The
default SQLite stack gets a start-and-stop check of its own. Debian's chromium (the browser tests) and
postgresql come with ``make setup-test``.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from flowkit import (
    REPO,
    Browser,
    CLIProcess,
    deployed_sweep,
    flat,
    leftovers,
    prefect_cli,
    run_of,
    steps,
    tiny_config,
)

import horizonrl_stack as stack
from horizonrl import store
from horizonrl.engines.vllm_server import free_port
from mlflow import MlflowClient

pytestmark = pytest.mark.slow
SWEEP = "tiny-sweep"
MODEL = "tiny-sweep-best"
SOLO = ("solo-a", "solo-b")
HISTORIES = (
    "eval/success_rate",
    "collect/episodes",
    "collect/mean_turns",
    "collect/tokens_per_episode",
    "time/train_s",
)
ERRORS = ("Traceback", "locked", "deadlock", "could not serialize", "too many clients")


def _env(home: Path) -> dict[str, str]:
    return {
        "PREFECT_HOME": str(home),
        "PREFECT_WORKER_QUERY_SECONDS": "1",
        "PREFECT_UI_ENABLED": "false",
        "TOKENIZERS_PARALLELISM": "false",
    }


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """The PostgreSQL stack, up; the sweep deployment and two solo runs run to completion. Its store is a
    fresh folder in the system's temp directory: as root, PostgreSQL runs as user ``postgres``, which
    cannot enter pytest's 0700 folders. Yields (stack, root, timings)."""
    root = tmp_path_factory.mktemp("stack")
    store_dir = Path(tempfile.mkdtemp(prefix="horizonrl-pg-store-"))
    store_dir.chmod(0o711)
    prefect_home = root / "prefect-home"
    s = stack.Stack(
        home=root / ".stack",
        store=store_dir,
        prefect_port=free_port(),
        mlflow_port=free_port(),
        postgres_port=free_port(),
        database="postgres",
        env=_env(prefect_home),
    )
    sweep_file = deployed_sweep(root, s.mlflow_uri, SWEEP, iterations=1, concurrency=2, register_best=MODEL)
    timings = {}
    t0 = time.perf_counter()
    stack.up(s)
    timings["stack_up_s"] = time.perf_counter() - t0
    try:
        env = s.environ()
        t0 = time.perf_counter()
        prefect_cli(env, "deploy", "--all", timeout=180)
        timings["deploy_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        logs = {name: root / f"{name}.log" for name in (SWEEP, *SOLO)}
        with open(logs[SWEEP], "w") as out:
            procs = {
                SWEEP: subprocess.Popen(
                    [
                        str(Path(sys.executable).parent / "prefect"),
                        "--no-prompt",
                        "deployment",
                        "run",
                        "sweep/sweep",
                        "--param",
                        f"sweep_path={sweep_file}",
                        "--watch",
                        "--watch-timeout",
                        "600",
                    ],
                    cwd=REPO,
                    env={**env, "PWD": str(REPO)},
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            }
        _wait_for_running_cells(s.prefect_api, procs[SWEEP], logs[SWEEP])
        for name, overrides in _deployed_trains(root).items():  # the train deployment as docs/deploy.md runs it
            logs[name] = root / f"{name}.log"
            with open(logs[name], "w") as out:
                procs[name] = subprocess.Popen(
                    [str(Path(sys.executable).parent / "prefect"), "--no-prompt", *_docs_example(overrides)],
                    cwd=REPO,
                    env={**env, "PWD": str(REPO)},
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
        for name in SOLO:
            cfg = {**tiny_config(root, s.mlflow_uri, iterations=1), "run_name": name, "method": "loop", "seed": 5}
            logs[name].write_text("")
            procs[name] = CLIProcess(["train", *(f"--set={k}={v}" for k, v in flat(cfg).items())], env, logs[name])
        for name, proc in procs.items():
            expected = 1 if name == REFUSED else 0
            assert proc.wait(timeout=660) == expected, f"{name} exit:\n{logs[name].read_text()[-3000:]}"
        timings["sweep_run_s"] = time.perf_counter() - t0
        yield s, root, timings
    finally:
        t0 = time.perf_counter()
        stopped = stack.down(s)
        shutil.rmtree(store_dir, ignore_errors=True)
        timings["stack_down_s"] = time.perf_counter() - t0
        print("\nstack timings:", {k: round(v, 1) for k, v in timings.items()})
    assert stopped == ["worker", "prefect", "mlflow", "postgres"]
    assert not leftovers(str(prefect_home)), f"processes left after stack down: {leftovers(str(prefect_home))}"
    assert all(v is None for v in stack.status(s).values())


DOCS_EXAMPLE = "deploy-example"
DEPLOYED, REFUSED = "first-deployed", "refused-deployed"
UNKNOWN_RUN = "runs:/0123456789abcdef0123456789abcdef"


def _docs_example(extra: list[str]) -> list[str]:
    """The ``prefect deployment run 'train/train' ...`` command docs/deploy.md shows (the code block after its
    ``deploy-example`` marker), with ``extra`` appended to its ``overrides`` list, as arguments after
    ``prefect``."""
    text = (REPO / "docs" / "deploy.md").read_text()
    block = text[text.index(f"<!-- {DOCS_EXAMPLE}") :].split("```")[1]
    [line] = [ln for ln in block.splitlines() if "deployment run" in ln]
    args = shlex.split(line)[1:]  # without .venv/bin/prefect
    at = next(i for i, a in enumerate(args) if a.startswith("overrides="))
    overrides = json.loads(args[at].removeprefix("overrides="))
    assert isinstance(overrides, list) and all("=" in o for o in overrides), overrides
    args[at] = "overrides=" + json.dumps([*overrides, *extra])
    return [*args, "--watch-timeout", "600"]


def _deployed_trains(root: Path) -> dict[str, list[str]]:
    """Overrides added to the docs' example: tiny counts for the one that trains, and a model path the
    store does not hold for one that is refused (its folder under its own data_dir, so one left would show)."""
    tiny = flat({k: v for k, v in tiny_config(root, "unused", iterations=1).items() if k not in ("tracking_uri",)})
    counts = [f"{k}={json.dumps(v)}" for k, v in tiny.items() if k != "run_name"]
    return {
        DEPLOYED: [*counts, "eval.n_tasks_ends=2", f"run_name={DEPLOYED}"],
        REFUSED: [f"model.path={UNKNOWN_RUN}", f"data_dir={root / 'refused'}", f"run_name={REFUSED}"],
    }


def _wait_for_running_cells(api: str, sweep: subprocess.Popen, log: Path, timeout: float = 420) -> None:
    """Block until the sweep's cells run as flow runs, so the solo runs started next write beside them
    (started at once, the solos can finish before the worker has picked up the first cell)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert sweep.poll() is None, f"the sweep ended before its cells ran:\n{log.read_text()[-3000:]}"
        runs = httpx.post(
            f"{api}/flow_runs/filter",
            json={"flow_runs": {"name": {"like_": f"{SWEEP}--"}, "state": {"type": {"any_": ["RUNNING"]}}}},
        ).json()
        if runs:
            return
        time.sleep(0.2)
    raise AssertionError(f"no cell of the sweep was running after {timeout} s:\n{log.read_text()[-3000:]}")


def _parent_and_children(c: MlflowClient):
    exp = c.get_experiment_by_name("test")
    parents = c.search_runs([exp.experiment_id], filter_string=f"tags.`horizonrl.run_name` = '{SWEEP}'")
    assert len(parents) == 1, "one parent run per sweep"
    parent = parents[0]
    children = c.search_runs([exp.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    return exp, parent, children


@pytest.mark.extra  # the PostgreSQL stack (postgres extra, Debian's PostgreSQL) and chromium
def test_sweep_deployment_logs_parent_children_metrics_and_report(swept):
    s, root, _ = swept
    c = MlflowClient(s.mlflow_uri)
    _, parent, children = _parent_and_children(c)
    assert parent.info.status == "FINISHED" and parent.data.tags["horizonrl.kind"] == "sweep"
    cells = sorted((r.data.tags["cell.method"], r.data.tags["cell.seed"]) for r in children)
    assert cells == [("grpo", "0"), ("grpo", "1"), ("loop", "0"), ("loop", "1")]
    for run in children:
        assert run.info.status == "FINISHED"
        assert json.loads(run.data.tags["horizonrl.cell"]) == {
            "method": run.data.tags["cell.method"],
            "seed": int(run.data.tags["cell.seed"]),
        }
        assert (
            run.data.params["method"] == run.data.tags["cell.method"]
            and run.data.tags["seed"] == run.data.tags["cell.seed"]
        )
        assert sorted(m.step for m in c.get_metric_history(run.info.run_id, "eval/success_rate")) == [0, 1]
        for key in ("collect/success_rate", "advantage/kept_fraction", "update/steps"):
            assert [m.step for m in c.get_metric_history(run.info.run_id, key)] == [1], key
    report_files = {a.path for a in c.list_artifacts(parent.info.run_id, "report")}
    assert report_files == {
        "report/comparison.json",
        "report/report.md",
        "report/success_vs_iterations.png",
        "report/success_vs_env_steps.png",
        "report/success_vs_wall_s.png",
    }
    png = Path(c.download_artifacts(parent.info.run_id, "report/success_vs_env_steps.png", str(root / "dl")))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    versions = c.search_model_versions(f"name = '{MODEL}'")
    assert len(versions) == 1 and versions[0].run_id == parent.data.tags["horizonrl.best_run_id"]
    assert versions[0].run_id in {r.info.run_id for r in children}
    keys = [f"{SWEEP}-report", f"{SWEEP}-summary"]
    found = httpx.post(f"{s.prefect_api}/artifacts/filter", json={"artifacts": {"key": {"any_": keys}}}).json()
    assert sorted((a["key"], a["type"]) for a in found) == [(keys[0], "table"), (keys[1], "markdown")]
    # the cells ran as flow runs of the train deployment, never more than `concurrency: 2` at once
    flow_runs = httpx.post(
        f"{s.prefect_api}/flow_runs/filter", json={"flow_runs": {"name": {"like_": f"{SWEEP}--"}}}
    ).json()
    assert sorted(r["name"] for r in flow_runs) == sorted(r.info.run_name for r in children)
    assert all(r["state_type"] == "COMPLETED" and r["deployment_id"] for r in flow_runs)
    spans = [(r["start_time"], r["end_time"]) for r in flow_runs]
    assert max(sum(a <= t < b for a, b in spans) for t, _ in spans) <= 2


@pytest.mark.extra
def test_the_train_deployment_from_the_docs_runs_and_a_refused_one_says_why(swept):
    """docs/deploy.md's ``prefect deployment run 'train/train' ...`` (its parameters as shown, tiny counts
    added) finishes its run; the same with a model path the store lacks fails in one line that ``--watch``
    prints, with no traceback, and leaves no run folder or lock. ``deploy --all`` deployed the scheduled
    sweeps paused. On main the failed run's reason sat in the worker's log with four tracebacks, ``--watch``
    printed only the state's name, and the run folder kept a ``.lock``."""
    s, root, _ = swept
    c = MlflowClient(s.mlflow_uri)
    deployed = run_of(c, DEPLOYED)
    assert deployed.info.status == "FINISHED" and deployed.data.params["iterations"] == "1"
    assert "Flow run finished successfully" in (root / f"{DEPLOYED}.log").read_text()
    assert not (root / "data" / "test" / DEPLOYED / ".lock").exists()
    said = " ".join((root / f"{REFUSED}.log").read_text().split())  # the terminal's line wrapping undone
    assert f"Failed(\"PreflightError: model.path = '{UNKNOWN_RUN}': no run with id" in said, said[-3000:]
    assert "Traceback" not in said and "Flow run finished in state 'Failed'" in said, said[-3000:]
    assert not (root / "refused").exists()
    assert (
        c.search_runs([c.get_experiment_by_name("test").experiment_id], f"tags.`horizonrl.run_name` = '{REFUSED}'")
        == []
    )
    deployments = httpx.post(f"{s.prefect_api}/deployments/filter", json={}).json()
    schedules = {d["name"]: [x["active"] for x in d["schedules"]] for d in deployments}
    assert schedules["ablation-weekly"] == [False] and schedules["study-scheduled"] == [False], schedules


@pytest.mark.extra
def test_every_run_writes_whole_beside_the_others_on_postgres(swept):
    """The four cells, the two solo runs and the deployed one wrote to one MLflow server and one data folder,
    up to five at once: every run finished with each step logged once and its episodes stored once, no lock or database
    error in any log, and both servers keep their rows in PostgreSQL, not in a SQLite file."""
    s, root, _ = swept
    env = s.environ()
    assert not list(Path(env["PREFECT_HOME"]).glob("*.db")), "Prefect's server must not keep a SQLite database"
    for log in [
        *(root / f"{name}.log" for name in (SWEEP, *SOLO)),
        s.home / "worker.log",
        s.home / "mlflow.log",
        s.home / "prefect.log",
    ]:
        text = log.read_text()
        assert not [e for e in ERRORS if e in text], f"{log.name}:\n{text[-3000:]}"
    # PostgreSQL logs a refused INSERT even when the writer expects it and recovers; the only ones allowed:
    # metric_pk (MLflow re-sends a run's metrics when a model is logged and skips the rows it has),
    # trace_info_pk (a trace written again after a retry: MLflow rereads the row and merges),
    # pk_task_run (Prefect's task-run recorder racing a concurrent one: it retries against the row),
    # dataset_pk (the two solo runs log identical tables at once; tracking.log_parquet_input tries again),
    # uq_experiments_workspace_name (two runs create the experiment at once; tracking.experiment_id rereads it).
    recovered = (
        'unique constraint "metric_pk"',
        'unique constraint "trace_info_pk"',
        'unique constraint "pk_task_run"',
        'unique constraint "dataset_pk"',
        'unique constraint "uq_experiments_workspace_name"',
    )
    pg_errors = [line for line in (s.home / "postgres.log").read_text().splitlines() if " ERROR: " in line]
    assert [line for line in pg_errors if not any(r in line for r in recovered)] == []

    c = MlflowClient(s.mlflow_uri)
    _, parent, children = _parent_and_children(c)
    runs = [run_of(c, name) for name in [r.info.run_name for r in children] + list(SOLO) + [DEPLOYED]]
    spans = [(r.info.start_time, r.info.end_time) for r in runs]
    writers = max(sum(a <= t < b for a, b in spans) for t, _ in spans)
    print(f"\nMLflow runs writing at once: {writers} of {len(runs)}")
    assert writers >= 3, spans
    for run in runs:
        name = run.info.run_name
        assert run.info.status == "FINISHED", name
        for key in ("collect/success_rate", "advantage/kept_fraction", "update/steps", "time/iteration_s"):
            assert steps(c, run.info.run_id, key) == [1], (name, key)
        assert steps(c, run.info.run_id, "eval/success_rate") == [0, 1], name
        episodes = store.read_table(
            store.iteration_dir(root / "data", "test", name, 1) / "episodes.parquet", "episodes"
        )
        assert episodes.num_rows == 4 and set(episodes["run_name"].to_pylist()) == {name}
    import psycopg

    held = {}
    for database, table in (("prefect", "flow_run"), ("mlflow", "runs"), ("mlflow", "metrics")):
        with psycopg.connect(
            host=stack.HOST,
            port=s.postgres_port,
            user=stack.PG_USER,
            dbname=database,
            password=s.pg_password_file.read_text().strip(),
        ) as conn:
            held[f"{database}.{table}"] = conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
    solo = len(SOLO) + 1  # and the train deployment's run from the docs
    assert held["prefect.flow_run"] >= len(children) + 1 + solo and held["mlflow.runs"] == 1 + len(children) + solo, (
        held
    )
    assert held["mlflow.metrics"] > 0 and not (Path(s.store) / "mlflow.db").exists()


def test_sqlite_stack_starts_answers_and_stops(tmp_path):
    """The default stack (SQLite files behind both servers): up, both servers answer, the worker has
    registered; a ``horizonrl train`` started in the stack's folder without ``PREFECT_API_URL`` reports to
    the stack's Prefect server instead of starting a temporary one; down, and nothing is left."""
    home = tmp_path / "prefect-home"
    s = stack.Stack(
        home=tmp_path / ".stack",
        store=tmp_path / "mlflow",
        prefect_port=free_port(),
        mlflow_port=free_port(),
        env=_env(home),
    )
    try:
        urls = stack.up(s)
        running = stack.status(s)
        assert [name for name, pgid in running.items() if pgid is not None] == ["worker", "prefect", "mlflow"], running
        assert (
            httpx.get(f"{s.prefect_api}/health").json() is True
            and httpx.get(f"{urls['mlflow']}/health").status_code == 200
        )
        assert (tmp_path / "mlflow" / "mlflow.db").is_file()
        assert stack.running_api(s.home) == s.prefect_api

        cfg = {**tiny_config(tmp_path, f"sqlite:///{tmp_path}/runs.db", "on-the-stack", iterations=1), "seed": 5}
        env = {k: v for k, v in s.environ().items() if k not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI")}
        log = tmp_path / "train.log"
        proc = CLIProcess(["train", *(f"--set={k}={v}" for k, v in flat(cfg).items())], env, log, cwd=tmp_path)
        assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]
        assert f"Prefect API {s.prefect_api}: the running stack's server" in log.read_text()
        runs = httpx.post(f"{s.prefect_api}/flow_runs/filter", json={}).json()
        assert [(r["state_type"], r["parameters"]["config"]["run_name"]) for r in runs] == [
            ("COMPLETED", "on-the-stack")
        ]
    finally:
        stopped = stack.down(s)
    assert stopped == ["worker", "prefect", "mlflow"] and not leftovers(str(home))
    assert stack.running_api(s.home) is None and not (s.home / stack.URLS).exists()


@pytest.mark.extra
def test_report_numbers_match_mlflow_metrics(swept):
    """Every figure of the parent's comparison table, recomputed here from the children's metrics."""
    s, root, _ = swept
    c = MlflowClient(s.mlflow_uri)
    _, parent, children = _parent_and_children(c)
    table = json.loads(
        Path(c.download_artifacts(parent.info.run_id, "report/comparison.json", str(root / "dl2"))).read_text()
    )
    rows = {r["variant"]: r for r in (dict(zip(table["columns"], d)) for d in table["data"])}
    assert sorted(rows) == ["grpo", "loop"]
    for method, row in rows.items():
        per_seed = []
        for run in (r for r in children if r.data.tags["cell.method"] == method):
            h = {k: {m.step: m.value for m in c.get_metric_history(run.info.run_id, k)} for k in HISTORIES}
            success = [h["eval/success_rate"][i] for i in sorted(h["eval/success_rate"])]
            steps = sorted(h["eval/success_rate"])
            auc = sum((success[i] + success[i + 1]) / 2 * (steps[i + 1] - steps[i]) for i in range(len(steps) - 1)) / (
                steps[-1] - steps[0]
            )
            tokens = sum(h["collect/episodes"][i] * h["collect/tokens_per_episode"][i] for i in h["collect/episodes"])
            per_seed.append(
                {
                    "final": success[-1],
                    "best": max(success),
                    "auc": auc,
                    "tokens": tokens,
                    "train_s": h["time/train_s"][max(h["time/train_s"])],
                }
            )
        assert row["seeds"] == len(per_seed) == 2
        for name in ("final", "best", "auc"):
            x = np.array([p[name] for p in per_seed])
            assert row[f"{name}_mean"] == pytest.approx(x.mean(), abs=1e-12)
            assert (row[f"{name}_low"], row[f"{name}_high"]) == (
                pytest.approx(x.min(), abs=1e-12),
                pytest.approx(x.max(), abs=1e-12),
            )  # 2 seeds: their range
        assert row["tokens"] == pytest.approx(np.mean([p["tokens"] for p in per_seed])) and row["tokens"] > 0
        assert row["train_s"] == pytest.approx(np.mean([p["train_s"] for p in per_seed])) and row["train_s"] > 0


@pytest.mark.extra
def test_evaluate_deployment_logs_a_linked_run(swept):
    """The registered best policy, evaluated on the train split through the evaluate deployment."""
    s, _, _ = swept
    prefect_cli(
        s.environ(),
        "deployment",
        "run",
        "evaluate/evaluate",
        "--param",
        f"source=models:/{MODEL}/1",
        "--param",
        "split=train",
        "--param",
        "n_tasks=2",
        "--watch",
        "--watch-timeout",
        "120",
        timeout=150,
    )
    c = MlflowClient(s.mlflow_uri)
    exp, parent, _ = _parent_and_children(c)
    runs = c.search_runs([exp.experiment_id], filter_string="tags.`horizonrl.kind` = 'evaluation'")
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert runs[0].data.tags["horizonrl.source_run_id"] == parent.data.tags["horizonrl.best_run_id"]
    assert runs[0].data.params["eval.split"] == "train" and runs[0].data.params["eval.n_tasks"] == "2"
    assert [m.step for m in c.get_metric_history(runs[0].info.run_id, "eval/success_rate")] == [1]


@pytest.mark.extra
def test_mlflow_ui_shows_the_sweep_runs(swept):
    """Headless chromium renders the MLflow UI (a JavaScript app): the experiment page lists the sweep's
    parent run, and the parent's page lists its four cell runs. Screenshots go to test-artifacts/."""
    s, root, _ = swept
    browser = shutil.which("chromium")
    assert browser, "Debian's chromium is not installed: run `make setup-test` (or apt-get install -y chromium)"
    c = MlflowClient(s.mlflow_uri)
    exp, parent, children = _parent_and_children(c)
    out = REPO / "test-artifacts"
    out.mkdir(exist_ok=True)
    pages = {
        "mlflow_experiment_page": (f"#/experiments/{exp.experiment_id}/runs", [SWEEP]),
        "mlflow_sweep_run_page": (
            f"#/experiments/{exp.experiment_id}/runs/{parent.info.run_id}",
            [r.info.run_name for r in children],
        ),
    }
    for name, (route, expected) in pages.items():
        shot = out / f"{name}.png"
        shot.unlink(missing_ok=True)
        dom = subprocess.run(
            [
                browser,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                f"--user-data-dir={root / 'chromium'}",
                "--window-size=1600,1000",
                "--virtual-time-budget=15000",
                f"--screenshot={shot}",
                "--dump-dom",
                f"{s.mlflow_uri}/{route}",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        ).stdout
        missing = [run_name for run_name in expected if f">{run_name}<" not in dom]
        assert not missing, f"{name}: runs not shown: {missing}"
        assert shot.is_file() and shot.stat().st_size > 10_000, f"{name}: no screenshot"


@pytest.mark.extra
def test_mlflow_ui_shows_an_episode_trace_turn_by_turn(swept):
    """In a cell run's Traces tab, a training episode's trace opens to its turn spans; a turn shows the
    observation, the action and the advantage. Screenshot: test-artifacts/mlflow_episode_trace.png."""
    s, root, _ = swept
    c = MlflowClient(s.mlflow_uri)
    exp, _, children = _parent_and_children(c)
    run = next(r for r in children if r.data.tags["cell.method"] == "loop")
    found = c.search_traces(
        locations=[exp.experiment_id],
        run_id=run.info.run_id,
        filter_string="tags.split = 'train'",
        order_by=["timestamp_ms DESC"],
        max_results=1,
    )  # the newest: the top of the run's list
    assert found, "the cell run has no training episode trace"
    trace = found[0]
    turn = min((sp for sp in trace.data.spans if sp.parent_id), key=lambda sp: sp.attributes["turn"])
    shot = REPO / "test-artifacts" / "mlflow_episode_trace.png"
    shot.parent.mkdir(exist_ok=True)
    shot.unlink(missing_ok=True)
    b = Browser(root / "chromium-trace")
    try:
        # the run page's Traces tab
        tab = f"{s.mlflow_uri}/#/experiments/{exp.experiment_id}/runs/{run.info.run_id}/traces"
        b.open(tab)
        b.wait_for("Session", trace.info.tags["task"])  # its list of episode traces
        b.open(f"{tab}?selectedTraceId={trace.info.trace_id}&selectedEvaluationId={trace.info.trace_id}")  # one opened
        b.wait_for(trace.data.spans[0].name, turn.name)
        b.click(turn.name)
        b.wait_for(
            "observation", turn.inputs["observation"].strip()[:40], "action", turn.outputs["action"], "advantage"
        )
        b.screenshot(shot)
    finally:
        b.close()
    assert shot.stat().st_size > 10_000


@pytest.mark.extra
def test_mlflow_ui_compares_the_cells_on_the_sweep_run(swept):
    """The sweep's parent run lists every variant's held-out success (final, AUC, interval) in its
    Metrics table, and the experiment's chart view grouped by ``cell.method`` draws loop against grpo,
    held-out success against environment steps (the README's three clicks): no artifact to open.
    Screenshots: test-artifacts/mlflow_sweep_comparison.png, test-artifacts/mlflow_success_vs_env_steps.png."""
    s, root, _ = swept
    c = MlflowClient(s.mlflow_uri)
    exp, parent, _ = _parent_and_children(c)
    metrics = parent.data.metrics
    assert parent.data.tags["git_commit"] not in ("", "unknown")
    for method in ("loop", "grpo"):
        assert {
            f"compare/{method}/{k}" for k in ("final_mean", "final_low", "final_high", "best_mean", "auc_mean", "seeds")
        } <= set(metrics)
    assert {f"compare/loop-vs-grpo/{k}" for k in ("paired_mean", "paired_low", "paired_high", "verdict")} <= set(
        metrics
    )
    shot, chart = (
        REPO / "test-artifacts" / "mlflow_sweep_comparison.png",
        REPO / "test-artifacts" / "mlflow_success_vs_env_steps.png",
    )
    shot.unlink(missing_ok=True)
    chart.unlink(missing_ok=True)
    b = Browser(root / "chromium-compare")
    try:
        b.open(f"{s.mlflow_uri}/#/experiments/{exp.experiment_id}/runs/{parent.info.run_id}")
        b.wait_for("compare/loop/final_mean")
        b.type_into("Search metrics", "final_mean")
        b.wait_for("compare/loop/final_mean", "compare/grpo/final_mean")
        b.screenshot(shot)
        b.open(
            f"{s.mlflow_uri}/#/experiments/{exp.experiment_id}/runs?compareRunsMode=CHART"
        )  # click 1: the chart view
        b.wait_for("Group by")
        b.click("Group by")  # click 2
        b.wait_for("cell.method")
        b.click("cell.method")  # click 3
        b.wait_for("Group: loop", "Group: grpo")
        b.type_into("Search metric charts", "success_by_env_steps")  # charts render only when scrolled to
        b.wait_for("loop (eval/success_by_env_steps)", "grpo (eval/success_by_env_steps)")
        b.screenshot(chart)
    finally:
        b.close()
    assert shot.stat().st_size > 10_000 and chart.stat().st_size > 10_000
