"""The local stack on 127.0.0.1 (``horizonrl stack``): ``prefect server``, a process work pool with one
worker, and ``mlflow server`` on the project's store (artifacts in ``<store>/artifacts``). Process
supervision, not ML, so a package beside the library (``horizonrl/``), which never imports it.

Two databases behind the servers (``Stack.database``):

* ``sqlite`` (default): MLflow in ``<store>/mlflow.db``, Prefect in ``$PREFECT_HOME``. Enough for one user
  and a few concurrent runs (SQLite takes one writer at a time).
* ``postgres``: one local PostgreSQL cluster (Debian's package) in ``<store>/postgres``, listening on
  127.0.0.1 only, with password authentication (scram-sha-256; the password, generated once, is kept in
  ``<store>/postgres.password``, mode 0600). Databases ``prefect`` and ``mlflow``. This is what many
  concurrent sweep workers need. PostgreSQL refuses to run as root: as root the cluster belongs to, and
  runs as, Debian's ``postgres`` user, which must be able to enter ``<store>``.

Every process starts in its own session; taking the stack down signals each part's process group and
every descendant (a worker's flow runs, a server's workers), found in /proc (Linux). Pid files and logs
live in ``<home>`` (``.stack/``, git-ignored). Down stops the worker before the servers: a worker whose
server is gone hangs.
"""

from __future__ import annotations

import json
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

HOST = "127.0.0.1"
ORDER_DOWN = ("worker", "prefect", "mlflow", "postgres")
PG_USER = "horizonrl"
PG_DATABASES = ("prefect", "mlflow")
LOG_STREAM = {"PREFECT_SERVER_LOGS_STREAM_PUBLISHING_ENABLED": "true", "PREFECT_SERVER_LOGS_STREAM_OUT_ENABLED": "true"}
"""The Prefect server streams flow runs' logs to its clients (off by default), so that ``prefect deployment
run --watch`` prints the run's log, its failure's one line included, and not only its state's name."""
URLS = "urls.json"  # in the stack's home while it is up: its servers' addresses (running_api)


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
    """Extra environment for all processes (e.g. ``PREFECT_WORKER_QUERY_SECONDS``)."""
    database: Literal["sqlite", "postgres"] = "sqlite"
    postgres_port: int = 5432

    @property
    def pg_data(self) -> Path:
        return self.store / "postgres"

    @property
    def pg_password_file(self) -> Path:
        return self.store / "postgres.password"

    def pg_url(self, database: str, driver: str) -> str:
        """No password in the URL (it would show in ``ps``): libpq and asyncpg read ``$PGPASSWORD``."""
        return f"{driver}://{PG_USER}@{HOST}:{self.postgres_port}/{database}"

    @property
    def prefect_api(self) -> str:
        return f"http://{HOST}:{self.prefect_port}/api"

    @property
    def mlflow_uri(self) -> str:
        return f"http://{HOST}:{self.mlflow_port}"

    def environ(self) -> dict[str, str]:
        """What a client of the stack (worker, ``prefect deploy``, a flow run) needs in its environment."""
        return {
            **os.environ,
            "PREFECT_HOME": os.environ.get("PREFECT_HOME", str((self.home / "prefect").resolve())),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            **self.env,
            "PREFECT_API_URL": self.prefect_api,
            "MLFLOW_TRACKING_URI": self.mlflow_uri,
        }


def up(stack: Stack, timeout_s: float = 180) -> dict[str, str]:
    """Start PostgreSQL (``database="postgres"``), both servers, wait until they answer, start a worker (it
    creates the process pool if it is missing) and wait until it has registered. Returns the URLs. Raises
    (after taking down what started) if something does not come up."""
    running = [name for name, pgid in status(stack).items() if pgid is not None]
    if running:
        raise RuntimeError(f"the stack in {stack.home} is already running ({', '.join(running)}); take it down first")
    if stack.database not in ("sqlite", "postgres"):
        raise ValueError(f"stack database must be 'sqlite' or 'postgres', got {stack.database!r}")
    ports = {
        "prefect": stack.prefect_port,
        "mlflow": stack.mlflow_port,
        **({"postgres": stack.postgres_port} if stack.database == "postgres" else {}),
    }
    for name, port in ports.items():
        if not _port_free(port):
            raise RuntimeError(f"port {port} ({name}) is already in use on {HOST}: choose another with --{name}-port")
    stack.home.mkdir(parents=True, exist_ok=True)
    stack.store.mkdir(parents=True, exist_ok=True)
    (stack.store / "artifacts").mkdir(exist_ok=True)
    bin_dir = Path(sys.executable).parent
    db_env: dict[str, str] = {}  # PostgreSQL's password, for both servers' database drivers
    prefect_db: dict[str, str] = {}
    mlflow_store = f"sqlite:///{stack.store.resolve()}/mlflow.db"
    try:
        if stack.database == "postgres":
            db_env = {"PGPASSWORD": _postgres_up(stack, timeout_s)}
            prefect_db = {"PREFECT_API_DATABASE_CONNECTION_URL": stack.pg_url("prefect", "postgresql+asyncpg")}
            mlflow_store = stack.pg_url("mlflow", "postgresql+psycopg")
        _start(
            stack,
            "prefect",
            [str(bin_dir / "prefect"), "server", "start", "--host", HOST, "--port", str(stack.prefect_port)],
            {**db_env, **prefect_db, **LOG_STREAM},
        )
        # MLflow's job runner (GenAI judges, trace roll-ups) is not used here: six fewer processes
        _start(
            stack,
            "mlflow",
            [
                str(bin_dir / "mlflow"),
                "server",
                "--host",
                HOST,
                "--port",
                str(stack.mlflow_port),
                "--workers",
                "1",
                "--backend-store-uri",
                mlflow_store,
                "--artifacts-destination",
                str((stack.store / "artifacts").resolve()),
            ],
            {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **db_env},
        )
        _wait_http(f"{stack.prefect_api}/health", timeout_s, stack, "prefect")
        _wait_http(f"{stack.mlflow_uri}/health", timeout_s, stack, "mlflow")
        _start(
            stack, "worker", [str(bin_dir / "prefect"), "worker", "start", "--pool", stack.pool, "--type", "process"]
        )
        _wait_http(
            f"{stack.prefect_api}/work_pools/{stack.pool}/workers/filter",
            timeout_s,
            stack,
            "worker",
            method="POST",
            nonempty=True,
        )
    except BaseException:
        down(stack)
        raise
    urls = {
        "prefect": stack.prefect_api,
        "prefect_ui": f"http://{HOST}:{stack.prefect_port}",
        "mlflow": stack.mlflow_uri,
    }
    (stack.home / URLS).write_text(json.dumps(urls))
    return urls


def running_api(home: Path) -> str | None:
    """The Prefect API of the stack whose pid files are in ``home``, if it is up and answers; else None.
    What ``horizonrl train`` (and the other flow commands) use when ``PREFECT_API_URL`` is unset, instead of
    starting a temporary server of their own."""
    urls = home / URLS
    if not urls.is_file() or status(Stack(home=home))["prefect"] is None:
        return None
    api = json.loads(urls.read_text())["prefect"]
    try:
        with urllib.request.urlopen(f"{api}/health", timeout=2) as resp:
            return api if resp.status == 200 else None
    except (OSError, ValueError):
        return None


def down(stack: Stack, grace_s: float = 20) -> list[str]:
    """Stop worker, then servers, then PostgreSQL. Returns the parts that were running."""
    stopped = []
    (stack.home / URLS).unlink(missing_ok=True)
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


def _start(
    stack: Stack, name: str, cmd: list[str], env: dict[str, str] | None = None, user: dict[str, Any] | None = None
) -> None:
    pid_file = stack.home / f"{name}.pid"
    with open(stack.home / f"{name}.log", "ab") as log:
        proc = subprocess.Popen(
            cmd,
            env={**stack.environ(), **(env or {})},
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            **(user or {}),
        )
    pid_file.write_text(str(proc.pid))


def _postgres_up(stack: Stack, timeout_s: float) -> str:
    """Create the cluster on first use (initdb), start it on loopback, create the two databases.
    Returns the cluster's password."""
    try:
        import psycopg  # MLflow's server needs it too
    except ImportError:
        raise RuntimeError("the postgres stack needs psycopg: pip install -e '.[postgres]'") from None

    user = _pg_user()
    data = stack.pg_data.resolve()
    if not (data / "PG_VERSION").is_file():
        _initdb(stack, data, user)
    password = _pg_password(stack)
    _start(
        stack,
        "postgres",
        [
            _pg_bin("postgres"),
            "-D",
            str(data),
            "-p",
            str(stack.postgres_port),
            "-c",
            f"listen_addresses={HOST}",
            "-c",
            "unix_socket_directories=",
            "-c",
            "max_connections=200",
        ],
        user=user,
    )
    deadline = time.monotonic() + timeout_s
    while True:
        if status(stack)["postgres"] is None:
            raise RuntimeError(f"stack postgres exited while starting; see {stack.home / 'postgres.log'}")
        try:
            conn = psycopg.connect(
                host=HOST,
                port=stack.postgres_port,
                user=PG_USER,
                password=password,
                dbname="postgres",
                connect_timeout=3,
                autocommit=True,
            )  # CREATE DATABASE cannot run in a transaction
            break
        except psycopg.OperationalError as err:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"stack postgres did not accept connections on {HOST}:{stack.postgres_port} within "
                    f"{timeout_s:.0f} s "
                    f"({str(err).strip()}); see {stack.home / 'postgres.log'}"
                ) from None
            time.sleep(0.2)
    with conn:
        for name in PG_DATABASES:
            if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone() is None:
                conn.execute(f'CREATE DATABASE "{name}"')
    return password


def _initdb(stack: Stack, data: Path, user: dict[str, Any]) -> None:
    """A new cluster owned by the user PostgreSQL runs as, password auth only, the password kept 0600."""
    if user:
        for folder in data.parents:
            if not folder.stat().st_mode & 0o001:
                raise RuntimeError(
                    f"PostgreSQL cannot run as root, so it runs as user 'postgres', which cannot enter {folder} "
                    f"(mode {folder.stat().st_mode & 0o777:o}): put the stack's store elsewhere or `chmod o+x {folder}`"
                )
    password = secrets.token_urlsafe(24)
    stack.pg_password_file.touch(mode=0o600)
    stack.pg_password_file.write_text(password)
    data.mkdir(parents=True, exist_ok=True)
    data.chmod(0o700)
    fd, pwfile = tempfile.mkstemp(prefix="horizonrl-initdb-")  # mode 0600, read by initdb, then removed
    try:
        os.write(fd, password.encode())
        os.close(fd)
        if user:
            for path in (data, pwfile):
                os.chown(path, user["user"], user["group"])
        done = subprocess.run(
            [
                _pg_bin("initdb"),
                "-D",
                str(data),
                "-U",
                PG_USER,
                f"--pwfile={pwfile}",
                "--auth=scram-sha-256",
                "-E",
                "UTF8",
                "--locale=C",
            ],
            capture_output=True,
            text=True,
            **user,
        )
    finally:
        os.unlink(pwfile)
    if done.returncode != 0:
        raise RuntimeError(f"initdb failed for {data}:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")


def _pg_password(stack: Stack) -> str:
    if not stack.pg_password_file.is_file():
        raise RuntimeError(
            f"{stack.pg_password_file} is missing: the cluster in {stack.pg_data} cannot be opened without it"
        )
    return stack.pg_password_file.read_text().strip()


def _pg_user() -> dict[str, Any]:
    """Popen's user arguments: Debian's ``postgres`` user when we are root (PostgreSQL refuses root)."""
    if os.geteuid() != 0:
        return {}
    try:
        pw = pwd.getpwnam("postgres")
    except KeyError:
        raise RuntimeError(
            "running as root, PostgreSQL needs an unprivileged user: Debian's 'postgres' user is missing "
            "(apt-get install postgresql creates it)"
        ) from None
    return {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": []}


def _pg_bin(name: str) -> str:
    """A PostgreSQL server program: on PATH, else Debian's /usr/lib/postgresql/<newest>/bin."""
    found = shutil.which(name) or next(
        (
            str(p)
            for p in sorted(
                Path("/usr/lib/postgresql").glob(f"*/bin/{name}"),
                key=lambda p: int(p.parts[-3]) if p.parts[-3].isdigit() else 0,
                reverse=True,
            )
        ),
        None,
    )
    if found is None:
        raise RuntimeError(
            f"PostgreSQL's {name} was not found: apt-get install postgresql (make setup-test installs it)"
        )
    return found


def _wait_http(
    url: str, timeout_s: float, stack: Stack, name: str, method: str = "GET", nonempty: bool = False
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if status(stack)[name] is None:
            raise RuntimeError(f"stack {name} exited while starting; see {stack.home / (name + '.log')}")
        try:
            req = urllib.request.Request(
                url,
                method=method,
                data=b"{}" if method == "POST" else None,
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=5) as resp:
                if resp.status == 200 and (not nonempty or resp.read().strip() not in (b"[]", b"")):
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.2)  # a refused connection on loopback costs nothing; `stack up` waits on each part in turn
    raise TimeoutError(
        f"stack {name} did not answer at {url} within {timeout_s:.0f} s; see {stack.home / (name + '.log')}"
    )


def _port_free(port: int) -> bool:
    """Whether nothing listens on ``port``. SO_REUSEADDR, as the servers themselves bind: connections of a
    stack just taken down linger in TIME_WAIT for a minute and must not block the next ``up``."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((HOST, port))
        except OSError:
            return False
    return True


def _alive(pgid: int) -> bool:
    return bool(processes_alive(processes(pgid)))


def _signal(pids: set[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
