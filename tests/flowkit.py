"""Helpers shared by the end-to-end tests: a tiny run config, MLflow look-ups, and the local stack's
ports, CLI and leftover processes."""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

from horizonrl.tracking.mlflow_runs import RUN_NAME_TAG
from horizonrl.training.checkpoint import CheckpointRef, resume_checkpoint
from mlflow import MlflowClient

REPO = Path(__file__).resolve().parents[1]


def tiny_config(tmp_path: Path, tracking_uri: str, run_name: str = "e2e", iterations: int = 2) -> dict:
    return {
        "run_name": run_name,
        "experiment": "test",
        "seed": 3,
        "method": "loop",
        "iterations": iterations,
        "env": {"name": "household", "tier": "easy", "max_turns": 4, "train_pool": 50},
        "model": {
            "tiny": {"hidden_size": 32, "intermediate_size": 64, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1}
        },
        "rollout": {"tasks_per_iteration": 2, "group_size": 2},
        "update": {"minibatch_size": 2},
        "eval": {"every": 1, "n_tasks": 3},
        "data_dir": str(tmp_path / "data"),
        "tracking_uri": tracking_uri,
    }


# What every `horizonrl` command imports before its own work: ~6.5 CPU-s per process on these machines,
# paid once per test worker by the fork server below instead of once per CLI process. Prefect reads its
# settings (PREFECT_API_URL, PREFECT_HOME, logging) when imported, and each test gives its own: the child
# reads them again from its own environment (``_cli_main``), as Prefect's plugins make it do after they
# change the environment. MLflow's SQL store and Alembic, which it imports at a process's first store open,
# are in too (1 CPU-s per process).
_PRELOAD = [
    "torch",
    "transformers.models.qwen2.modeling_qwen2",
    "mlflow",
    "mlflow.store.tracking.sqlalchemy_store",
    "alembic.migration",
    "alembic.script",
    "sqlalchemy.dialects.sqlite",
    "pyarrow.parquet",
    "horizonrl.run.player",
    "horizonrl.store",
    "horizonrl.tracking.mlflow_runs",
    "methods",
    "prefect",
    "prefect.flow_engine",
    "prefect.task_engine",
    "cli_warmup",  # last: a policy log's one-time work (tests/cli_warmup.py)
]
_forks: multiprocessing.context.ForkServerContext | None = None


class CLIProcess:
    """``horizonrl <args>`` as a process of its own, forked from a server that has imported torch,
    transformers, MLflow and Prefect already (``multiprocessing``'s fork server). The process is real: its
    own pid, environment, working folder, session and output files; a SIGKILL kills it and nothing else; it
    reads Prefect's settings from its own environment and runs ``flows.cli.main`` as ``python -m flows.cli``
    would, atexit hooks included. What it saves is only the imports, the largest share of a short CLI run's
    CPU in the suite. The entry point itself (the ``horizonrl`` console script) is run as a fresh interpreter
    by the benchmark test, and the stack test's flow runs start fresh from Prefect's worker."""

    def __init__(
        self,
        args: list[str],
        env: dict[str, str],
        log: Path,
        *,
        stderr: Path | None = None,
        new_session: bool = False,
        cwd: Path = REPO,
    ):
        global _forks
        if _forks is None:
            _forks = multiprocessing.get_context("forkserver")
            _forks.set_forkserver_preload(_PRELOAD)
        self.args, self.log, self.stderr = args, log, stderr
        self._proc = _forks.Process(
            target=_cli_main, args=(args, env, str(log), str(stderr or log), new_session, str(cwd)), daemon=False
        )
        self._proc.start()
        self.pid = self._proc.pid

    def wait(self, timeout: float | None = None) -> int:
        """The exit status as subprocess reports it: negative for a signal."""
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(["horizonrl", *self.args], timeout or 0)
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    returncode = property(poll)


def without_heartbeats() -> contextlib.AbstractContextManager:
    """Prefect's settings with flow-run heartbeats off, for the suite's own processes (the harness's and the
    CLI children). Heartbeats let a server mark a crashed run, which no test asks of them, and each flow
    run's end waited for the heartbeat thread's next one-second tick (0.9 s of a trivial flow's 1.1 s,
    measured; a few hundred flow runs in the suite)."""
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    return temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None})


def _cli_main(args: list[str], env: dict[str, str], stdout: str, stderr: str, new_session: bool, cwd: str) -> None:
    if new_session:
        os.setsid()
    os.chdir(cwd)
    sys.path.insert(0, str(REPO))
    os.environ.clear()
    os.environ.update(env)
    import prefect.context
    import prefect.logging.configuration

    prefect.context.refresh_global_settings_context()  # the settings this child's environment gives
    prefect.logging.configuration.setup_logging(incremental=False)
    for fd, path in ((1, stdout), (2, stderr)):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(out, fd)
        os.close(out)
    sys.stdout.reconfigure(line_buffering=True)  # as on a terminal: printed lines and logs in the order they came
    sys.argv = ["horizonrl", *args]
    code = 1
    try:
        from flows.cli import main

        with without_heartbeats():
            code = main(args)
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    finally:
        atexit._run_exitfuncs()  # a multiprocessing child ends with os._exit: run what `python` runs at exit
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code or 0)


def cli_run(args: list[str], env: dict[str, str], log_dir: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """``CLIProcess`` run to its end, its output read back like ``subprocess.run(..., capture_output=True)``."""
    log_dir.mkdir(parents=True, exist_ok=True)
    n = len(list(log_dir.glob("cli-*.out")))
    out, err = log_dir / f"cli-{n}.out", log_dir / f"cli-{n}.err"
    out.write_text("")
    err.write_text("")
    rc = CLIProcess(args, env, out, stderr=err).wait(timeout)
    return subprocess.CompletedProcess(["horizonrl", *args], rc, out.read_text(), err.read_text())


def newest_checkpoint(run_dir: Path) -> CheckpointRef | None:
    """The newest checkpoint of the run in ``run_dir`` that verifies against its manifest, or None."""
    return resume_checkpoint(run_dir)[0]


def built_owners(monkeypatch, on_build=None) -> list:
    """Every run's owners the construction point builds in this process while the test runs (``on_build``
    called with each as it is built), so a test can look at what a flow built and closed."""
    import tasks.context

    built, build = [], tasks.context.build_run

    def record(cfg):
        owners = build(cfg)
        built.append(owners)
        if on_build is not None:
            on_build(owners)
        return owners

    monkeypatch.setattr(tasks.context, "build_run", record)
    return built


def run_of(c: MlflowClient, name: str):
    exp = c.get_experiment_by_name("test")
    runs = c.search_runs([exp.experiment_id], filter_string=f"tags.`{RUN_NAME_TAG}` = '{name}'")
    assert len(runs) == 1, f"expected one MLflow run named {name}, found {len(runs)}"
    return runs[0]


def steps(c: MlflowClient, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in c.get_metric_history(run_id, key))


def flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def deployed_sweep(root: Path, tracking_uri: str, name: str, iterations: int, **options: object) -> Path:
    """A sweep file over loop/grpo x seeds 0, 1 on the tiny config, its cells fanned out to the train
    deployment; ``options`` add sweep keys (``concurrency``, ``register_best``)."""
    import yaml

    base = tiny_config(root, tracking_uri, iterations=iterations)
    for key in ("run_name", "method", "seed"):
        base.pop(key)
    (root / "base.yaml").write_text(yaml.safe_dump(base))
    path = root / "sweep.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "name": name,
                "base": "base.yaml",
                "grid": {"method": ["loop", "grpo"], "seed": [0, 1]},
                "deployment": "train/train",
                **options,
            }
        )
    )
    return path


def prefect_cli(env: dict[str, str], *args: str, timeout: float) -> subprocess.CompletedProcess:
    """``prefect <args>`` from the repository root (prefect.yaml's pull step runs flows in ``{{ $PWD }}``)."""
    done = subprocess.run(
        [str(Path(sys.executable).parent / "prefect"), "--no-prompt", *args],
        cwd=REPO,
        env={**env, "PWD": str(REPO)},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, f"prefect {' '.join(args)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def leftovers(marker: str) -> list[str]:
    """Processes whose environment holds ``marker`` (a stack's unique PREFECT_HOME)."""
    found = []
    for env in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker.encode() in env.read_bytes():
                cmdline = (env.parent / "cmdline").read_bytes().replace(b"\0", b" ")[:200]
                found.append(f"{env.parent.name}: {cmdline!r}")
        except OSError:
            continue
    return found


class Browser:
    """Headless chromium driven over the DevTools protocol (Debian's chromium, ``make setup-test``): open
    a page, wait for text, click an element by its text, read the page's text, take a screenshot. The
    MLflow UI is a JavaScript app, so what a user sees is only known once it has rendered."""

    def __init__(self, profile: Path, width: int = 1600, height: int = 1000):
        import json
        import shutil
        import urllib.request

        from websockets.sync.client import connect

        browser = shutil.which("chromium")
        assert browser, "Debian's chromium is not installed: run `make setup-test` (or apt-get install -y chromium)"
        self.proc = subprocess.Popen(
            [
                browser,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                f"--user-data-dir={profile}",
                f"--window-size={width},{height}",
                "--remote-debugging-address=127.0.0.1",
                "--remote-debugging-port=0",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        port_file = profile / "DevToolsActivePort"
        for _ in range(300):
            if port_file.is_file() and port_file.read_text().strip():
                break
            time.sleep(0.1)
        port = port_file.read_text().split()[0]
        pages = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10).read())
        self.ws = connect(
            next(p for p in pages if p["type"] == "page")["webSocketDebuggerUrl"], max_size=None, open_timeout=30
        )
        self.next_id = 0
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)

    def call(self, method: str, **params: object) -> dict:
        import json

        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv(timeout=60))
            if message.get("id") == self.next_id:
                assert "error" not in message, f"{method}: {message['error']}"
                return message["result"]

    def js(self, expression: str) -> object:
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")

    def open(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def text(self) -> str:
        return self.js("document.body ? document.body.innerText : ''") or ""

    def wait_for(self, *texts: str, timeout: float = 60) -> str:
        """The page's text once it shows every one of ``texts``; fails naming the ones missing."""
        deadline = time.monotonic() + timeout
        while True:
            page = self.text()
            missing = [t for t in texts if t not in page]
            if not missing:
                return page
            assert time.monotonic() < deadline, (
                f"page does not show {missing} after {timeout:.0f} s; it shows:\n{page[:2000]}"
            )
            time.sleep(0.1)

    def click(self, text: str) -> None:
        """Click, with the mouse, the innermost element whose whole text is ``text``; a page tab
        (``role="tab"``) before a link of the same name (MLflow's sidebar and a run's tabs both say "Traces")."""
        import json

        at = self.js(f"""(() => {{
            const all = [...document.querySelectorAll('body *')]
                .filter(e => e.innerText && e.innerText.trim() === {json.dumps(text)});
            const leaves = all.filter(e => ![...e.children].some(c => all.includes(c)));
            const leaf = leaves.find(e => e.closest('[role="tab"]')) || leaves[0]; if (!leaf) return null;
            leaf.scrollIntoView({{block: 'center'}}); const r = leaf.getBoundingClientRect();
            return [r.x + r.width / 2, r.y + r.height / 2]; }})()""")
        assert at, f"no element shows {text!r}"
        for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", type=kind, x=at[0], y=at[1], button="left", clickCount=1)

    def type_into(self, placeholder: str, text: str) -> None:
        """Type ``text`` into the input field whose placeholder is ``placeholder``, as a user would."""
        import json

        found = self.js(f"""(() => {{
            const e = document.querySelector('input[placeholder=' + JSON.stringify({json.dumps(placeholder)}) + ']');
            if (!e) return false; e.scrollIntoView({{block: 'start'}}); e.focus(); return true; }})()""")
        assert found, f"no input field with placeholder {placeholder!r}"
        self.call("Input.insertText", text=text)

    def screenshot(self, path: Path) -> None:
        import base64

        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))

    def close(self) -> None:
        self.ws.close()
        self.proc.kill()
        self.proc.wait(timeout=30)
