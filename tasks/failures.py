"""A flow's known failures (bad input, a refused start, a full disk) in one line: the flow's run ends Failed
with the error's line as its message, and Prefect's logs of the process carry that line, not a traceback."""

from __future__ import annotations

import errno
import functools
import logging
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from prefect.client.schemas.objects import State
from prefect.states import Failed

from horizonrl.config import ConfigError
from horizonrl.run import config_history, preflight, runlock
from horizonrl.store import StoreError
from horizonrl.tracking import mlflow_runs
from horizonrl.training.checkpoint import CheckpointDamaged, CheckpointWriteError

P = ParamSpec("P")
R = TypeVar("R")


KNOWN_FAILURES = (
    ConfigError,
    preflight.PreflightError,
    config_history.ConfigChangeRefused,
    runlock.RunInUse,
    CheckpointDamaged,
    StoreError,
    mlflow_runs.ArtifactStoreUnwritable,
    CheckpointWriteError,
)
"""Errors whose one line says it all, the run's state rather than a bug: bad input or a refused start (the
config, what the preflight checks, a changed resume, the run in use, a damaged checkpoint or store), or a
checkpoint or model the disk would not take."""


def known_failure(err: BaseException) -> bool:
    """One of ``KNOWN_FAILURES``, or a write the disk refused (full, read-only, over quota)."""
    return isinstance(err, KNOWN_FAILURES) or (
        isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EROFS, errno.EDQUOT)
    )


class OneLineErrors(logging.Filter):
    """Prefect logs a failed flow or task with its traceback; for the exceptions ``only`` accepts (all where
    not given) the exception's own line is kept and the traceback dropped. A command that reports a failure
    in one line itself holds it for a block (``with``); a flow of ``one_line_failures`` installs it for
    known failures in its process."""

    LOGGERS = ("prefect.flow_runs", "prefect.task_runs")

    def __init__(self, only: Callable[[BaseException], bool] = lambda err: True) -> None:
        super().__init__()
        self.only = only

    def install(self) -> None:
        """On Prefect's run loggers (once: a logger keeps one copy of a filter)."""
        for name in self.LOGGERS:
            logging.getLogger(name).addFilter(self)

    def __enter__(self) -> OneLineErrors:
        """On Prefect's run loggers for the block only (an in-process caller's later logs keep theirs)."""
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        for name in self.LOGGERS:
            logging.getLogger(name).removeFilter(self)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None and self.only(record.exc_info[1]):
            err = record.exc_info[1]
            record.msg = f"{record.getMessage()} {type(err).__name__}: {err}".replace("\n", "; ")
            record.args, record.exc_info, record.exc_text = None, None, None
        return True


KNOWN_FAILURES_IN_ONE_LINE = OneLineErrors(known_failure)


def one_line_failures(flow_fn: Callable[P, R]) -> Callable[P, R | State]:
    """A flow function whose known failures (``known_failure``) end its run in a Failed state that carries
    the error: its message is the error's one line, which ``prefect deployment run --watch`` prints, and an
    in-process caller gets the error itself raised. Their tracebacks are one line in Prefect's logs of this
    process (a task's failure, and the engine's own report of a failed run in a deployment's process). The
    failure hooks run as for a raised error. Other errors are raised as they are, to be debugged."""

    @functools.wraps(flow_fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> R | State:
        KNOWN_FAILURES_IN_ONE_LINE.install()
        try:
            return flow_fn(*args, **kwargs)
        except Exception as err:
            if not known_failure(err):
                raise
            return Failed(message=f"{type(err).__name__}: {'; '.join(str(err).splitlines())}", data=err)

    return run
