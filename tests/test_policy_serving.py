"""The logged policy serves outside the project (issue 51): ``mlflow models serve --env-manager local`` in an
environment where the project cannot be imported answers a prediction, from the code and pinned requirements
the model carries. On main the model's code imported ``horizonrl.*`` that it did not carry
(``ModuleNotFoundError`` without the project), had no input example (MLflow's warning on every run), carried
the optimizer's state, and a row without its admissible commands raised a ``TypeError`` (``None``) or
generated "assistant assistant ..." for 32 tokens.

The environment is a fresh virtual environment whose only addition is a path file naming this one's
installed packages: the project's editable install is a path hook in this environment's site folder, which
a path file does not run, so ``import horizonrl`` fails there as in a fresh one with the logged requirements.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

import mlflow
from horizonrl.engines.vllm_server import free_port
from horizonrl.tracking import mlflow_runs
from mlflow import MlflowClient

pytestmark = pytest.mark.slow
DECODING = {"prompt": "listed", "free_format": "plain", "enable_thinking": False, "action_mode": "admissible"}


def _without_the_project(root: Path) -> Path:
    """A virtual environment that sees this one's installed packages but not the project; returns its
    interpreter. ``uvicorn`` as pip installs its console script (MLflow's local server runs it from PATH)."""
    base = Path(sys.base_prefix) / "bin" / "python3"
    subprocess.run([str(base), "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    python = root / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(site) / "installed.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    uvicorn = root / "bin" / "uvicorn"
    uvicorn.write_text(f"#!{python}\nimport sys\nfrom uvicorn.main import main\nsys.exit(main())\n")
    uvicorn.chmod(0o755)
    done = subprocess.run([str(python), "-c", "import horizonrl"], capture_output=True, text=True, cwd=root)
    assert done.returncode != 0 and "No module named 'horizonrl'" in done.stderr, "the project is importable"
    return python


def _post(url: str, rows: list[dict]) -> tuple[int, dict]:
    request = urllib.request.Request(
        url, json.dumps({"dataframe_records": rows}).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_a_logged_policy_is_served_without_the_project(tiny_policy_dir, household_suite, tmp_path):
    c = MlflowClient(f"sqlite:///{tmp_path}/m.db")
    run_id = c.create_run(c.create_experiment("p", artifact_location=str(tmp_path / "art"))).info.run_id
    env = household_suite.make()
    obs, info = env.reset(household_suite.tasks("test", "easy", 1)[0])
    row = {"goal": info.get("goal", ""), "observation": obs, "admissible": list(info["admissible_commands"])}
    mlflow_runs.log_policy(c, run_id, tiny_policy_dir, 0, DECODING, row)
    model = mlflow_runs.policy_models(c, run_id)[0]
    mlflow.set_tracking_uri(c.tracking_uri)
    local = Path(mlflow.artifacts.download_artifacts(f"models:/{model.model_id}", dst_path=str(tmp_path / "model")))
    spec = yaml.safe_load((local / "MLmodel").read_text())
    assert spec["signature"]["inputs"] and spec["saved_input_example_info"]["type"] == "dataframe"
    assert (local / "code" / "horizonrl" / "engines" / "hf.py").is_file() and (local / "code" / "methods").is_dir()
    assert not list(local.rglob("optimizer.pt")) and not list(local.rglob("*.pkl"))
    requirements = (local / "requirements.txt").read_text().split()
    assert all("==" in r for r in requirements) and {r.split("==")[0] for r in requirements} >= {"mlflow", "torch"}

    python, port = _without_the_project(tmp_path / "fresh"), free_port()
    server = subprocess.Popen(
        [str(python), "-m", "mlflow", "models", "serve", "-m", str(local), "--env-manager", "local"]
        + ["-h", "127.0.0.1", "-p", str(port)],
        cwd=tmp_path,
        env={**os.environ, "PATH": f"{python.parent}:{os.environ['PATH']}"},
        stdout=open(tmp_path / "serve.log", "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=5)
                break
            except OSError:
                assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()[-3000:]
                time.sleep(0.2)
        status, answer = _post(f"http://127.0.0.1:{port}/invocations", [row])
        assert status == 200 and answer["predictions"][0] in row["admissible"], answer
        status, answer = _post(f"http://127.0.0.1:{port}/invocations", [{**row, "admissible": None}])
        assert status == 400 and "row 0: 'admissible' is missing or empty" in json.dumps(answer), answer
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
