"""The PostgreSQL stack's refusals, before anything starts: a store the ``postgres`` user cannot enter, a
port in use. The stack itself, running a sweep beside two solo runs, is tested in ``test_stack.py``."""

from __future__ import annotations

import os
import socket

import pytest

import horizonrl_stack as stack
from horizonrl.engines.vllm_server import free_port


@pytest.mark.extra  # the postgres extra (psycopg) and Debian's PostgreSQL
def test_postgres_stack_refuses_a_store_postgres_cannot_enter(tmp_path):
    """As root the cluster runs as user ``postgres``: a store inside a 0700 folder is named, before any start."""
    if os.geteuid() != 0:
        pytest.skip("only root hands the cluster to the postgres user")
    closed = tmp_path / "closed"
    closed.mkdir(mode=0o700)
    s = stack.Stack(
        home=tmp_path / ".stack",
        store=closed / "store",
        prefect_port=free_port(),
        mlflow_port=free_port(),
        database="postgres",
        postgres_port=free_port(),
    )
    with pytest.raises(RuntimeError, match=r"cannot enter .*closed"):
        stack.up(s)
    assert all(v is None for v in stack.status(s).values())


def test_stack_refuses_a_port_in_use_before_starting_anything(tmp_path):
    with socket.socket() as taken:
        taken.bind((stack.HOST, 0))
        taken.listen()
        port = taken.getsockname()[1]
        s = stack.Stack(
            home=tmp_path / ".stack",
            store=tmp_path / "store",
            prefect_port=free_port(),
            mlflow_port=free_port(),
            database="postgres",
            postgres_port=port,
        )
        with pytest.raises(
            RuntimeError,
            match=rf"port {port} \(postgres\) is already in use on 127\.0\.0\.1: choose another with --postgres-port",
        ):
            stack.up(s)
    assert not (tmp_path / "store").exists() and not (tmp_path / ".stack").exists()
