"""Run a server module (vLLM's OpenAI-compatible server) for as long as the process that started it lives.

``python -m horizonrl_serve <module> <its arguments>``: the process that starts the server stops it on exit
(``VLLMServer.stop``, at interpreter exit too), but a process killed from outside never gets there: Prefect
answers SIGTERM by re-raising it with the default action, and SIGKILL runs nothing. The server, in a session of
its own, then outlived its trainer holding the port and several GB. Here a thread watches the parent: when it
is gone (this process re-parented), the server's whole process group gets SIGTERM, then SIGKILL.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import threading
import time

POLL_S = 1.0
GRACE_S = 20.0  # SIGTERM lets vLLM shut its engine core down; SIGKILL after this


def watch(parent: int) -> None:
    """Return once ``parent`` is no longer this process's parent; then stop this process group."""
    while os.getppid() == parent:
        time.sleep(POLL_S)
    group = os.getpgrp()
    os.killpg(group, signal.SIGTERM)
    time.sleep(GRACE_S)
    os.killpg(group, signal.SIGKILL)


def main() -> None:
    module, sys.argv = sys.argv[1], [sys.argv[1], *sys.argv[2:]]
    threading.Thread(target=watch, args=(os.getppid(),), daemon=True, name="horizonrl-parent-watch").start()
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
