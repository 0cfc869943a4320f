"""One process at a time per run: the run folder's lock, and clean-up after a holder that was killed.

``<run_dir>/.lock`` is held (``flock``) while a process trains or rewrites the run. The kernel releases it
when the process ends, however it ends, so a SIGKILLed run never leaves a stale lock behind; a process that
ends its block removes the file. The file
also says who holds it (pid, host, start time, Prefect flow run): a refused second process names the
holder, and the next holder can tell that the previous one died without releasing it. Everything that
must not happen while another process works on the run (removing stale temporaries, rewriting its
files) happens under this lock, and only there.

A killed ``horizonrl train`` also leaves Prefect's temporary API server running (its parent is gone, it
has no reason to stop): ``stop_orphaned_prefect_servers`` finds and stops such servers of this user and
``PREFECT_HOME``; the next run calls it when it starts.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

LOCK_FILE = ".lock"


class RunInUse(RuntimeError):
    """Another live process holds the run folder's lock; the message names it."""


@dataclass
class RunLock:
    """A held lock. ``previous`` is what the last holder recorded if it ended without releasing (it was
    killed): its pid, host, start time and Prefect flow run id, for the clean-up after it."""

    path: Path
    file: IO[str]
    previous: dict[str, Any] | None
    holder: dict[str, Any] = field(default_factory=dict)

    def record(self, **info: Any) -> None:
        """Add ``info`` (e.g. the Prefect flow run id) to what the lock file says about its holder."""
        self.holder.update(info)
        _write(self.file, self.holder)


@contextmanager
def hold(run_dir: str | Path) -> Iterator[RunLock]:
    """Hold ``run_dir``'s lock for the block; raise ``RunInUse`` naming the holder if another process
    has it. Leaving the block removes the lock file (and the run folder, if nothing else is in it); a
    killed holder leaves it, marked unreleased, so the next holder knows clean-up is due."""
    run_dir = Path(run_dir)
    created = not run_dir.exists()
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    f = _locked(path)
    f.seek(0)
    previous = _parse(f.read())
    lock = RunLock(
        path,
        f,
        None if previous.get("released", True) else previous,
        {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "released": False,
        },
    )
    _write(f, lock.holder)
    try:
        yield lock
    finally:
        lock.record(released=True)
        path.unlink()  # while held: a process that opened the old file finds it gone and opens anew
        f.close()  # closing the file releases the lock
        if created and not any(run_dir.iterdir()):  # made only for the lock: a refused start leaves no folder
            run_dir.rmdir()


def _locked(path: Path) -> IO[str]:
    """``path`` opened and locked (``flock``); ``RunInUse`` naming the holder if another process holds it.
    A lock won on a file its holder had just removed (``hold`` unlinks on release) is taken again on the
    new file, so two processes never hold the run at once."""
    while True:
        f = open(path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = _parse(f.read())
            f.close()
            raise RunInUse(
                f"run folder {path.parent} is in use by {describe(holder)}; wait for it to end, or stop it (lock "
                f"file {path})"
            ) from None
        try:
            if os.stat(path).st_ino == os.fstat(f.fileno()).st_ino:
                return f
        except FileNotFoundError:
            pass
        f.close()


def held_elsewhere(run_dir: str | Path) -> bool:
    """Whether another process holds ``run_dir``'s lock now (a failure hook must not mark its run)."""
    path = Path(run_dir) / LOCK_FILE
    if not path.is_file():
        return False
    with open(path) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
    return False


def describe(holder: dict[str, Any]) -> str:
    if not holder:
        return "another process (it has not written its name yet)"
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, started {holder.get('started', '?')}"


def _parse(text: str) -> dict[str, Any]:
    try:
        found = json.loads(text)
    except json.JSONDecodeError:  # empty (new), or caught half-written
        return {}
    return found if isinstance(found, dict) else {}


def _write(f: IO[str], holder: dict[str, Any]) -> None:
    f.seek(0)
    f.truncate()
    f.write(json.dumps(holder, sort_keys=True))
    f.flush()


SERVER_APP = b"prefect.server.api.server:create_app"
TEMPORARY_MARK = b"PREFECT__SERVER_EPHEMERAL=1"  # set by Prefect on the temporary servers it starts


def orphaned_prefect_servers(prefect_home: str | Path) -> list[int]:
    """Pids of Prefect temporary API servers of this user and ``prefect_home`` whose starting process is
    gone. Such a server is started by a Python process with the same interpreter; once that process dies
    the server is re-parented (to pid 1 or a subreaper), which is how an orphan is told from a live one."""
    home = str(Path(prefect_home).expanduser().resolve())
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if proc.stat().st_uid != os.getuid() or SERVER_APP not in (proc / "cmdline").read_bytes():
                continue
            environ = (proc / "environ").read_bytes().split(b"\0")
            if TEMPORARY_MARK not in environ:
                continue
            homes = [e.split(b"=", 1)[1].decode() for e in environ if e.startswith(b"PREFECT_HOME=")]
            if str(Path(homes[0] if homes else "~/.prefect").expanduser().resolve()) != home:
                continue
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            exe = os.readlink(proc / "exe")
        except (OSError, ValueError, IndexError):  # ended meanwhile, or not ours to read
            continue
        try:
            parent_exe = os.readlink(f"/proc/{ppid}/exe")
        except OSError:
            parent_exe = None
        if ppid == 1 or parent_exe != exe:
            found.append(int(proc.name))
    return found


def stop_orphaned_prefect_servers(prefect_home: str | Path, grace_s: float = 5.0) -> list[int]:
    """Stop (SIGTERM, then SIGKILL after ``grace_s``) the servers ``orphaned_prefect_servers`` finds;
    returns their pids."""
    pids = orphaned_prefect_servers(prefect_home)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
            time.sleep(0.1)
        if not any(_alive(pid) for pid in pids):
            break
    return pids


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
