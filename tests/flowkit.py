"""Helpers shared by the end-to-end tests: a tiny run config, MLflow look-ups, and the local stack's
ports, CLI and leftover processes."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

from mlflow import MlflowClient

from horizonrl.tracking import RUN_NAME_TAG

REPO = Path(__file__).resolve().parents[1]


def tiny_config(tmp_path: Path, tracking_uri: str, run_name: str = "e2e", iterations: int = 2) -> dict:
    return {
        "run_name": run_name,
        "experiment": "test",
        "seed": 3,
        "method": "loop",
        "iterations": iterations,
        "env": {"name": "household", "tier": "easy", "max_turns": 4, "train_pool": 50},
        "model": {"tiny": {"hidden_size": 32, "intermediate_size": 64, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1}},
        "rollout": {"tasks_per_iteration": 2, "group_size": 2},
        "update": {"minibatch_size": 2},
        "eval": {"every": 1, "n_tasks": 3},
        "data_dir": str(tmp_path / "data"),
        "tracking_uri": tracking_uri,
    }


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
    path.write_text(yaml.safe_dump({"name": name, "base": "base.yaml", "grid": {"method": ["loop", "grpo"], "seed": [0, 1]},
                                    "deployment": "train/train", **options}))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prefect_cli(env: dict[str, str], *args: str, timeout: float) -> subprocess.CompletedProcess:
    """``prefect <args>`` from the repository root (prefect.yaml's pull step runs flows in ``{{ $PWD }}``)."""
    done = subprocess.run([str(Path(sys.executable).parent / "prefect"), "--no-prompt", *args], cwd=REPO, env={**env, "PWD": str(REPO)},
                          capture_output=True, text=True, timeout=timeout)
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
