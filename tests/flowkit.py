"""Helpers shared by the end-to-end tests: a tiny run config and MLflow look-ups."""

from __future__ import annotations

from pathlib import Path

from mlflow import MlflowClient

from horizonrl.tracking import RUN_NAME_TAG


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
