"""Faults the first rounds did not try (issue 33): resume exactness for the methods that carry more than
LOOP (BLPO's memory, GiGPO's anchor states, APPO's branches), a deleted Parquet file of a finished
iteration, and a SIGKILL in the middle of ``recompute`` and of ``warmstart``, each command then run again.

The kills are real: the CLI runs in its own process with ``HORIZONRL_FAULT`` and SIGKILLs itself at the
named point (``horizonrl/faults.py``); the runs are the tiny household config, in-process for the runs
that are not killed.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from flowkit import CLIProcess, cli_run, flat, newest_checkpoint, run_of, steps, tiny_config
from safetensors.torch import load_file

from horizonrl import faults, store
from horizonrl.training.checkpoint import checkpoint_dir
from mlflow import MlflowClient

TIMING = ["gen_s", "env_s"]  # wall-clock columns, the only ones allowed to differ


def _config(root: Path, run_name: str, method: str = "loop", iterations: int = 2) -> dict:
    cfg = tiny_config(root, f"sqlite:///{root}/mlflow.db", run_name, iterations)
    cfg["method"] = method
    cfg["eval"] = {"every": 2, "n_tasks": 2, "greedy": False}
    cfg["advantage_params"] = {"kl_lambda": 0.5} if method == "loop" else {}
    return cfg


def _cli(args: list[str], log_dir: Path, fault: str | None = None) -> subprocess.CompletedProcess:
    """``horizonrl <args>`` in a process of its own, on the session's Prefect API, optionally faulted."""
    from prefect.settings import PREFECT_API_URL

    env = {k: v for k, v in os.environ.items() if k != faults.ENV}
    env["PREFECT_API_URL"] = PREFECT_API_URL.value()
    if fault:
        env[faults.ENV] = fault
    return cli_run(args, env, log_dir / "cli-logs")


def _train_args(cfg: dict) -> list[str]:
    return ["train", *(f"--set={k}={v}" for k, v in flat(cfg).items())]


def _same_tables(a: Path, b: Path, name: str) -> None:
    ta, tb = pq.read_table(a / name), pq.read_table(b / name)
    drop = [c for c in ("run_name", *TIMING) if c in ta.column_names]
    assert tb.drop_columns(drop).equals(ta.drop_columns(drop)), (a, name)


@pytest.mark.slow
@pytest.mark.parametrize(
    "method,fault",
    [("blpo", "update:2"), ("gigpo", "advantage:2"), ("appo", "collect:2")],
    ids=["blpo-memory", "gigpo-anchors", "appo-branches"],
)
def test_resume_is_exact_for_stateful_and_branching_methods(prefect_harness, tmp_path, method, fault):
    """Killed in iteration 2 (BLPO after its advantages and memory are stored, GiGPO after its advantages,
    APPO half-way through storing its initial and branch rollouts) and run again, the run ends with the
    same rollouts, advantages, estimator state and weights as one never killed, and every metric step once."""
    from flows.train import train

    cfg = _config(tmp_path, "killed", method)
    if method == "appo":
        cfg["rollout"]["group_size"] = 2
    straight = {**cfg, "run_name": "straight"}
    killed = _cli(_train_args(cfg), tmp_path, fault)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert newest_checkpoint(tmp_path / "data" / "test" / "killed").iteration == 1
    train(config=cfg)
    train(config=straight)
    for it in (1, 2):
        a, b = (store.iteration_dir(tmp_path / "data", "test", n, it) for n in ("straight", "killed"))
        assert sorted(p.name for p in b.iterdir()) == sorted(p.name for p in a.iterdir())
        for name in ("episodes.parquet", "turns.parquet", f"advantages-{method}.parquet"):
            _same_tables(a, b, name)
        if method == "blpo":
            assert (b / "estimator_state-blpo.json").read_text() == (a / "estimator_state-blpo.json").read_text()
        if method == "appo":
            kinds = pq.read_table(b / "episodes.parquet")["kind"].to_pylist()
            assert "branch" in kinds, "no branch was played: the test would check only initial rollouts"
    wa, wb = (
        load_file(checkpoint_dir(tmp_path / "data" / "test" / n, 2) / "model.safetensors")
        for n in ("straight", "killed")
    )
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    c = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    for name in ("straight", "killed"):
        run = run_of(c, name)
        assert run.info.status == "FINISHED"
        for key in run.data.metrics:
            got = [m.step for m in c.get_metric_history(run.info.run_id, key)]
            assert len(got) == len(set(got)) or key == "time/startup_s", (name, key, got)


@pytest.mark.slow
def test_a_deleted_parquet_file_of_a_finished_iteration_is_named_with_the_way_back(prefect_harness, tmp_path, capsys):
    """A finished iteration's ``turns.parquet`` deleted: running the command again does not go on with a store
    that lacks it. It stops (exit 1, one line) naming the file and its recorded digest and how to recover,
    and the run is not left RUNNING; the file restored, the command finishes again and logs nothing twice."""
    from flows.cli import main

    cfg = _config(tmp_path, "lost", iterations=1)
    assert main(_train_args(cfg)) == 0
    d = store.iteration_dir(tmp_path / "data", "test", "lost", 1)
    kept = (d / "turns.parquet").read_bytes()
    (d / "turns.parquet").unlink()
    capsys.readouterr()
    assert main(_train_args(cfg)) == 1
    everything = capsys.readouterr().err
    assert "Traceback" not in everything, everything[-3000:]
    err = everything.strip().splitlines()[-1]
    assert err.startswith("horizonrl: run 'lost' not started: ") and str(d / "turns.parquet") in err, err
    assert "stored rollouts of finished iterations are missing" in err and "move" in err, err
    c = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    assert run_of(c, "lost").info.status != "RUNNING"
    (d / "turns.parquet").write_bytes(kept)
    assert main(_train_args(cfg)) == 0
    run = run_of(c, "lost")
    assert run.info.status == "FINISHED"
    assert [m.step for m in c.get_metric_history(run.info.run_id, "summary/final_success_rate")] == [1]


@pytest.mark.slow
def test_a_warmstart_killed_after_an_epoch_resumes_to_the_same_policy(prefect_harness, tmp_path):
    """``warmstart`` SIGKILLed after epoch 1's checkpoint, before its losses are logged, then run again:
    the same demonstrations and final weights as a warm start never killed, each loss step logged once,
    one registered version per run."""
    from flows.warmstart import warmstart

    def ws(name: str) -> dict:
        cfg = _config(tmp_path, name, iterations=1)
        cfg["env"].pop("max_turns")  # whole walkthroughs
        cfg["warmstart"] = {"demonstrations": 3, "epochs": 2, "minibatch_size": 2, "model_name": f"m-{name}"}
        cfg["eval"] = {"every": 2, "n_tasks": 2, "greedy": False}
        return cfg

    killed = _cli(["warmstart", *(f"--set={k}={v}" for k, v in flat(ws("killed")).items())], tmp_path, "clone:1")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    a, b = tmp_path / "data" / "test" / "straight", tmp_path / "data" / "test" / "killed"
    assert newest_checkpoint(b).iteration == 1
    c = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    assert not c.get_metric_history(run_of(c, "killed").info.run_id, "clone/epoch_loss")
    assert warmstart(config=ws("killed"))["model_uri"] == "models:/m-killed/1"
    warmstart(config=ws("straight"))
    for name in ("episodes.parquet", "turns.parquet"):
        _same_tables(a / "demonstrations", b / "demonstrations", name)
    wa, wb = (load_file(checkpoint_dir(d, 2) / "model.safetensors") for d in (a, b))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    run = run_of(c, "killed")
    assert run.info.status == "FINISHED"
    for key in ("clone/loss", "clone/epoch_loss", "eval/success_rate"):
        got = [m.step for m in c.get_metric_history(run.info.run_id, key)]
        want = [m.step for m in c.get_metric_history(run_of(c, "straight").info.run_id, key)]
        assert sorted(got) == sorted(want) and len(got) == len(set(got)), key
    assert [str(v.version) for v in c.search_model_versions("name = 'm-killed'")] == ["1"]


@pytest.mark.slow
def test_a_recompute_killed_half_way_is_run_again_to_the_same_tables(prefect_harness, tmp_path):
    """``recompute --method blpo`` over a BLPO run's stored rollouts, SIGKILLed after iteration 1's table is
    written, then run again: the recomputed tables equal the ones the training wrote (BLPO's memory chained
    from an empty start, as in the run), and each iteration's figures are logged once."""
    from flows.train import train

    train(config=_config(tmp_path, "src", "blpo"))
    d = tmp_path / "data" / "test" / "src"
    trained = {it: (d / f"iter={it:05d}" / "advantages-blpo.parquet").read_bytes() for it in (1, 2)}
    args = ["recompute", "--run-dir", str(d), "--method", "blpo"]
    killed = _cli(args, tmp_path, "recompute:1")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert _cli(args, tmp_path).returncode == 0
    for it in (1, 2):
        again = pq.read_table(d / f"iter={it:05d}" / "advantages-blpo.parquet")
        assert again.equals(pq.read_table(pa_buffer(trained[it]))), it
    c = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    run = run_of(c, "src--recompute-blpo")
    assert run.info.status == "FINISHED"
    assert sorted(m.step for m in c.get_metric_history(run.info.run_id, "advantage/trajectories")) == [1, 2]


def pa_buffer(data: bytes):
    import pyarrow as pa

    return pa.BufferReader(data)


@pytest.mark.slow
def test_evaluate_beside_two_trainings_on_one_sqlite_store(prefect_harness, tmp_path):
    """``evaluate`` of a finished run and two new trainings, three processes at once on one SQLite store and
    data folder: all three finish whole, with no lock error and no traceback, and no run is left RUNNING."""
    from flows.train import train

    train(config=_config(tmp_path, "source", iterations=1))
    c = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    source = run_of(c, "source").info.run_id
    from prefect.settings import PREFECT_API_URL

    env = {k: v for k, v in os.environ.items() if k != faults.ENV}
    env.update(PREFECT_API_URL=PREFECT_API_URL.value(), MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path}/mlflow.db")
    commands = {
        "a": _train_args(_config(tmp_path, "a")),
        "b": _train_args(_config(tmp_path, "b")),
        "eval": ["evaluate", "--source", source, "--set=eval.n_tasks=2"],
    }
    logs = {name: tmp_path / f"{name}.log" for name in commands}
    procs = {name: CLIProcess(args, env, logs[name]) for name, args in commands.items()}
    for name, proc in procs.items():
        rc, out = proc.wait(timeout=900), logs[name].read_text()
        assert rc == 0, (name, out[-3000:])
        assert "locked" not in out and "Traceback" not in out, out[-3000:]
    runs = c.search_runs([e.experiment_id for e in c.search_experiments()])
    assert sorted(r.info.status for r in runs) == ["FINISHED"] * 4
    assert {run_of(c, n).info.status for n in ("a", "b")} == {"FINISHED"}


@pytest.mark.slow
def test_a_sweep_killed_with_a_cell_half_done_is_run_again_to_the_same_cells(prefect_harness, tmp_path):
    """``sweep --here`` SIGKILLed inside its first cell's iteration 2 (``update:2``), then run again: the half
    done cell resumes and ends with the weights of the same config trained straight, the other cell runs,
    the report is made, every run (the parent's included) ends FINISHED, and no metric step is logged twice."""
    import yaml

    from flows.sweep import sweep
    from flows.train import train

    base = _config(tmp_path, "unused")
    for key in ("run_name", "seed"):
        base.pop(key)
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    path = tmp_path / "pair.yaml"
    path.write_text(yaml.safe_dump({"name": "pair", "base": "base.yaml", "grid": {"seed": [3, 4]}}))
    killed = _cli(["sweep", str(path), "--here"], tmp_path, "update:2")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    cell = tmp_path / "data" / "test" / "pair--seed=3"
    assert newest_checkpoint(cell).iteration == 1
    sweep(str(path), in_process=True)
    train(config={**_config(tmp_path, "straight"), "seed": 3})
    wa, wb = (
        load_file(checkpoint_dir(d, 2) / "model.safetensors") for d in (tmp_path / "data" / "test" / "straight", cell)
    )
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    for it in (1, 2):
        a, b = (store.iteration_dir(tmp_path / "data", "test", n, it) for n in ("straight", "pair--seed=3"))
        for name in ("episodes.parquet", "turns.parquet", "advantages-loop.parquet"):
            _same_tables(a, b, name)
    c = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = c.search_runs([e.experiment_id for e in c.search_experiments()])
    assert [r.info.run_name for r in runs if r.info.status != "FINISHED"] == []
    for name in ("pair--seed=3", "pair--seed=4"):
        run = run_of(c, name)
        got = [m.step for m in c.get_metric_history(run.info.run_id, "update/steps")]
        assert sorted(got) == [1, 2], (name, got)


@pytest.mark.slow
def test_a_read_only_then_full_disk_under_the_mlflow_artifacts(prefect_harness, tmp_path, capsys):
    """The MLflow artifact folder on a real tmpfs (the tests run as root, so a read-only folder has to be a
    read-only mount), through ``horizonrl train``. Read-only: the run is refused before it is created, in
    one line naming the folder. Writable but with room for the config and the evaluation tables and not
    for the policy model logged at the end (~55 KB of weights): the run fails at its end (exit 1, one line,
    no traceback), marked FAILED with the cause, its tables and checkpoint intact. With room again, the
    same command only finishes it: nothing trained or logged twice."""
    from flows.cli import main

    cfg = _config(tmp_path, "disk", iterations=1)
    cfg["eval"] = {"every": 1, "n_tasks": 2, "greedy": False}

    def train_cli() -> tuple[int, str]:
        capsys.readouterr()
        rc = main(_train_args(cfg))
        return rc, capsys.readouterr().err

    artifacts = tmp_path / "artifacts"  # beside mlflow.db: where the project's SQLite stores keep artifacts
    artifacts.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32k,ro", "tmpfs", str(artifacts)], check=True)
    try:
        rc, err = train_cli()
        assert rc == 1 and "Traceback" not in err, err[-3000:]
        assert err.strip().splitlines()[-1] == (
            f"horizonrl: run 'disk' not started: [Errno 30] the MLflow artifact folder {artifacts} of experiment "
            "'test' cannot take a file (Read-only file system): make it writable or free space there, then run again"
        ), err[-3000:]
        c = MlflowClient(cfg["tracking_uri"])
        assert c.search_runs([c.get_experiment_by_name("test").experiment_id]) == [], "refused before it exists"
        assert not (tmp_path / "data" / "test" / "disk" / "checkpoints").exists()

        subprocess.run(["mount", "-o", "remount,rw", str(artifacts)], check=True)
        rc, err = train_cli()
        assert rc == 1 and "Traceback" not in err, err[-3000:]
        last = err.strip().splitlines()[-1]
        assert last.startswith("horizonrl: run 'disk' failed: [Errno 28] No space left on device") and (
            str(artifacts) in last
        ), last
        run = run_of(c, "disk")
        assert run.info.status == "FAILED" and "No space left on device" in run.data.tags["horizonrl.failure"]
        d = tmp_path / "data" / "test" / "disk"
        assert newest_checkpoint(d).iteration == 1
        tables = {p: p.read_bytes() for p in (d / "iter=00001").glob("*.parquet")}
        assert tables, "the iteration's tables were stored before the disk filled"
        evals = steps(c, run.info.run_id, "eval/success_rate")

        subprocess.run(["mount", "-o", "remount,size=4m", str(artifacts)], check=True)
        assert train_cli()[0] == 0
        run = run_of(c, "disk")
        assert run.info.status == "FINISHED" and "horizonrl.failure" not in run.data.tags
        assert steps(c, run.info.run_id, "eval/success_rate") == evals == [0, 1]
        assert steps(c, run.info.run_id, "update/steps") == [1]
        assert {p: p.read_bytes() for p in (d / "iter=00001").glob("*.parquet")} == tables
    finally:
        gc.collect()
        subprocess.run(["umount", str(artifacts)], check=True)
