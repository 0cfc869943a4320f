"""Session-wide fixtures: one Prefect test harness, an MLflow SQLite store and a data folder per session."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def prefect_harness():
    """A real (temporary) Prefect API for flow runs; entering it costs ~13 s, so once per session."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def session_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("horizonrl")


@pytest.fixture()
def tracking_uri(tmp_path):
    """A fresh MLflow SQLite store for one test."""
    return f"sqlite:///{tmp_path}/mlflow.db"
