"""The local stack on 127.0.0.1: ``prefect server``, a process work pool with one worker, and
``mlflow server`` on the project's store (``sqlite:///<store>/mlflow.db``, artifacts in ``<store>/artifacts``).

Every process starts in its own session; taking the stack down signals each part's process group and
every descendant (a worker's flow runs, a server's workers), found in /proc (Linux). Pid files and logs
live in ``<home>`` (``.stack/``, git-ignored). Down stops the worker before the servers: a worker whose
server is gone hangs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

HOST = "127.0.0.1"
ORDER_DOWN = ("worker", "prefect", "mlflow")


@dataclass(frozen=True)
class Stack:
    home: Path = Path(".stack")
    """Pid files, logs and (unless $PREFECT_HOME is set) the Prefect server's database."""
    store: Path = Path("mlflow")
    """MLflow store: SQLite database and artifact folder."""
    prefect_port: int = 4200
    mlflow_port: int = 5000
    pool: str = "horizonrl"
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment for all three processes (e.g. ``PREFECT_WORKER_QUERY_SECONDS``)."""

    @property
    def prefect_api(self) -> str:
        return f"http://{HOST}:{self.prefect_port}/api"

    @property
    def mlflow_uri(self) -> str:
        return f"http://{HOST}:{self.mlflow_port}"

    def environ(self) -> dict[str, str]:
        """What a client of the stack (worker, ``prefect deploy``, a flow run) needs in its environment."""
        return {**os.environ, "PREFECT_HOME": os.environ.get("PREFECT_HOME", str((self.home / "prefect").resolve())),
                "PREFECT_SERVER_ANALYTICS_ENABLED": "false", **self.env,
                "PREFECT_API_URL": self.prefect_api, "MLFLOW_TRACKING_URI": self.mlflow_uri}


def up(stack: Stack, timeout_s: float = 180) -> dict[str, str]:
    """Start both servers, wait until they answer, start a worker (it creates the process pool if it is
    missing) and wait until it has registered. Returns the URLs. Raises (after taking down what started) if something does not come up."""
    running = [name for name, pgid in status(stack).items() if pgid is not None]
    if running:
        raise RuntimeError(f"the stack in {stack.home} is already running ({', '.join(running)}); take it down first")
    stack.home.mkdir(parents=True, exist_ok=True)
    stack.store.mkdir(parents=True, exist_ok=True)
    (stack.store / "artifacts").mkdir(exist_ok=True)
    bin_dir = Path(sys.executable).parent
    try:
        _start(stack, "prefect", [str(bin_dir / "prefect"), "server", "start", "--host", HOST, "--port", str(stack.prefect_port)])
        # MLflow's job runner (GenAI judges, trace roll-ups) is not used here: six fewer processes
        _start(stack, "mlflow", [str(bin_dir / "mlflow"), "server", "--host", HOST, "--port", str(stack.mlflow_port), "--workers", "1",
                                 "--backend-store-uri", f"sqlite:///{stack.store.resolve()}/mlflow.db",
                                 "--artifacts-destination", str((stack.store / "artifacts").resolve())],
               {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
        _wait_http(f"{stack.prefect_api}/health", timeout_s, stack, "prefect")
        _wait_http(f"{stack.mlflow_uri}/health", timeout_s, stack, "mlflow")
        _start(stack, "worker", [str(bin_dir / "prefect"), "worker", "start", "--pool", stack.pool, "--type", "process"])
        _wait_http(f"{stack.prefect_api}/work_pools/{stack.pool}/workers/filter", timeout_s, stack, "worker", method="POST", nonempty=True)
    except BaseException:
        down(stack)
        raise
    return {"prefect": stack.prefect_api, "prefect_ui": f"http://{HOST}:{stack.prefect_port}", "mlflow": stack.mlflow_uri}


def down(stack: Stack, grace_s: float = 20) -> list[str]:
    """Stop worker, then servers. Returns the parts that were running."""
    stopped = []
    for name in ORDER_DOWN:
        pid_file = stack.home / f"{name}.pid"
        if not pid_file.is_file():
            continue
        if _alive(int(pid_file.read_text())):
            stopped.append(name)
            _stop(int(pid_file.read_text()), grace_s)
        pid_file.unlink()
    return stopped


def _stop(pgid: int, grace_s: float) -> None:
    """SIGTERM to the group and every descendant (flow runs may start sessions of their own), SIGKILL
    after ``grace_s``; the set is read again each round, since a dying server may restart a helper."""
    signalled: set[int] = set()
    deadline = time.monotonic() + grace_s
    while pids := processes_alive(processes(pgid) | signalled):
        if time.monotonic() < deadline:
            _signal(pids - signalled, signal.SIGTERM)
        else:
            _signal(pids, signal.SIGKILL)
        signalled |= pids
        time.sleep(0.2)


def processes(pgid: int) -> set[int]:
    """Live processes of group ``pgid`` and all their descendants (from /proc)."""
    parent, group = {}, {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            pid = int(stat.parent.name)
            parent[pid], group[pid] = int(fields[1]), int(fields[2])
    found = {pid for pid, g in group.items() if g == pgid}
    while True:
        more = {pid for pid, ppid in parent.items() if ppid in found} - found
        if not more:
            return found
        found |= more


def processes_alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            os.waitpid(pid, os.WNOHANG)  # reap our own children (the test runs up and down in one process)
        except ChildProcessError:
            pass
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                alive.add(pid)
        except OSError:
            pass
    return alive


def status(stack: Stack) -> dict[str, int | None]:
    """Process group id of each running part, None where it is not running."""
    out: dict[str, int | None] = {}
    for name in ORDER_DOWN:
        pid_file = stack.home / f"{name}.pid"
        pgid = int(pid_file.read_text()) if pid_file.is_file() else None
        out[name] = pgid if pgid is not None and _alive(pgid) else None
    return out


def _start(stack: Stack, name: str, cmd: list[str], env: dict[str, str] | None = None) -> None:
    pid_file = stack.home / f"{name}.pid"
    with open(stack.home / f"{name}.log", "ab") as log:
        proc = subprocess.Popen(cmd, env={**stack.environ(), **(env or {})}, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    pid_file.write_text(str(proc.pid))


def _wait_http(url: str, timeout_s: float, stack: Stack, name: str, method: str = "GET", nonempty: bool = False) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if status(stack)[name] is None:
            raise RuntimeError(f"stack {name} exited while starting; see {stack.home / (name + '.log')}")
        try:
            req = urllib.request.Request(url, method=method, data=b"{}" if method == "POST" else None, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=5) as resp:
                if resp.status == 200 and (not nonempty or resp.read().strip() not in (b"[]", b"")):
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"stack {name} did not answer at {url} within {timeout_s:.0f} s; see {stack.home / (name + '.log')}")


def _alive(pgid: int) -> bool:
    return bool(processes_alive(processes(pgid)))


def _signal(pids: set[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
