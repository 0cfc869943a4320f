"""What a study's cells of one seed share: one warm start (``warmstart.share_as``), one starting evaluation
(``horizonrl.shared_eval``), and never a reference model of another cell's start (``Learner.reference``)."""

from __future__ import annotations

from pathlib import Path

import pyarrow.compute as pc
import pytest
import torch
from flowkit import run_of, tiny_config

from horizonrl import store
from horizonrl.config import TrainConfig, run_dir, warm_start_config
from horizonrl.models.loading import load_policy
from horizonrl.run.owners import build_run
from horizonrl.tracking import mlflow_runs
from horizonrl.training.checkpoint import CheckpointRef, policy_digest, save_checkpoint
from mlflow import MlflowClient


def _cfg(tmp_path: Path, tracking_uri: str, **fields) -> TrainConfig:
    cfg = tiny_config(tmp_path, tracking_uri, run_name=f"study--method={fields.get('method', 'loop')}")
    cfg["warmstart"] = {"before_rl": True, "share_as": "study-ws"}
    return TrainConfig.model_validate({**cfg, **fields})


def test_a_shared_warm_start_is_one_per_seed_whatever_the_method(tmp_path, tracking_uri):
    loop = warm_start_config(_cfg(tmp_path, tracking_uri, method="loop"))
    grpo = warm_start_config(_cfg(tmp_path, tracking_uri, method="grpo", iterations=7, loss_params={"kl_coef": 0.1}))
    seed1 = warm_start_config(_cfg(tmp_path, tracking_uri, method="grpo", seed=1))
    assert loop.run_name == grpo.run_name == "study-ws-seed3" and seed1.run_name == "study-ws-seed1"
    assert loop.model_dump() == grpo.model_dump(), "a method's fields never reach its seed's warm start"
    assert loop.warmstart.model_name == "study-ws-seed3" and not loop.warmstart.before_rl
    other_lr = warm_start_config(_cfg(tmp_path, tracking_uri, method="grpo", warmstart={"lr": 1e-2, "share_as": "x"}))
    assert other_lr.warmstart.lr == 1e-2, "what the warm start reads stays: a cell that differs is refused on resume"


def _checkpoint_zero(run_dir: Path, policy_dir: Path, scale: float) -> CheckpointRef:
    model, tokenizer = load_policy(policy_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale)
    return save_checkpoint(run_dir, 0, model, tokenizer, None, {"mlflow_run_id": str(run_dir)})


def test_two_runs_with_different_starts_get_their_own_reference(tmp_path, tracking_uri, tiny_policy_dir):
    """In one process (an in-process sweep) each run's KL reference is its own checkpoint 0: a run's learner is
    built for that run at its start (``horizonrl.run.owners``), so no later run is served an earlier one's
    start (when one learner served the process, the first run's start served every later run)."""
    cfgs = {name: _cfg(tmp_path, tracking_uri, method="grpo", run_name=name) for name in ("a", "b", "c")}
    starts = {name: _checkpoint_zero(run_dir(cfgs[name]), tiny_policy_dir, scale) for name, scale in
              (("a", 1.0), ("b", 0.5), ("c", 1.0))}  # fmt: skip
    assert policy_digest(starts["a"]) == policy_digest(starts["c"]) != policy_digest(starts["b"])
    learners = {name: build_run(cfg).learner for name, cfg in cfgs.items()}
    ref_a, ref_b = learners["a"].reference(), learners["b"].reference()
    weights = {name: p.detach().clone() for name, p in ref_a.named_parameters()}
    for name, p in ref_b.named_parameters():
        assert torch.allclose(p, 0.5 * weights[name]), name
    assert learners["c"].reference() is not ref_a, "one run's start is never another run's copy"
    assert learners["a"].reference() is ref_a, "loaded once per run"
    assert not any(p.requires_grad for p in ref_b.parameters())


@pytest.mark.slow
def test_a_study_shares_its_seed_s_start_and_compares_its_methods_task_by_task(prefect_harness, tmp_path, tracking_uri):
    """A two-method sweep with a shared warm start: one warm start run and one registered version; the second
    cell starts from the same model and reads the first cell's iteration-0 evaluation (the same episodes),
    tagged with who played it; each trains and evaluates its own end. Its record (``horizonrl study``) holds
    every evaluated episode, and the page made from the record alone pairs the two methods by task."""
    import yaml

    from flows.cli import main
    from flows.sweep import sweep
    from horizonrl.tracking import study_record

    base = _cfg(tmp_path, tracking_uri, iterations=1).model_dump()
    base["rollout"]["context"] = "full"
    base["warmstart"] |= {"demonstrations": 4, "epochs": 1, "minibatch_size": 2, "lr": 3e-3}
    base["eval"] = {"every": 1, "n_tasks": 3, "greedy": False}
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump({"name": "study", "base": "base.yaml", "grid": {"method": ["loop", "grpo"]}}))
    sweep(str(path), in_process=True)

    c = MlflowClient(tracking_uri)
    assert [int(v.version) for v in c.search_model_versions("name = 'study-ws-seed3'")] == [1]
    loop, grpo = run_of(c, "study--method=loop"), run_of(c, "study--method=grpo")
    for run in (loop, grpo):
        assert run.data.tags[mlflow_runs.INIT_MODEL_TAG] == "models:/study-ws-seed3/1"
        assert run.data.tags["horizonrl.eval0.eval.played_by"] == "study--method=loop"
        assert sorted(m.step for m in c.get_metric_history(run.info.run_id, "eval/success_rate")) == [0, 1]
    data = Path(base["data_dir"]) / "test"
    first = [store.read_table(data / f"study--method={m}" / "iter=00000" / "eval-episodes.parquet", "episodes")
             for m in ("loop", "grpo")]  # fmt: skip
    assert first[0].num_rows == 3 and first[0].equals(first[1])
    assert pc.sum(first[0]["n_turns"]).as_py() > 0
    assert len(list((data / "shared-evals").iterdir())) == 1

    parent = run_of(c, "study")
    assert {f"compare/loop-vs-grpo/paired_{k}" for k in ("mean", "low", "high")} <= set(parent.data.metrics)
    assert "study/page.md" in {f.path for f in c.list_artifacts(parent.info.run_id, "study")}

    record, page = tmp_path / "record", tmp_path / "page.md"
    assert main(["study", str(path), "--record", str(record), "--out", str(page)]) == 0
    outcomes, progress, cells = study_record.load(record)
    assert len(outcomes) == 2 * (3 + 3) and set(outcomes["method"]) == {"loop", "grpo"}
    assert list(cells["method"]) == ["loop", "grpo", "warmstart"] and set(cells["status"]) == {"FINISHED"}
    assert (progress.groupby("method")["iteration"].max() == 1).all()
    text = page.read_text()
    last = outcomes[outcomes["iteration"] == 1].pivot(index="task", columns="method", values="won")
    diff = 100 * (last["loop"] - last["grpo"]).mean() + 0.0
    assert f"| loop | grpo | {diff:+.1f} [" in text
    (record / "outcomes.csv").unlink()
    assert main(["study", str(path), "--record", str(record), "--out", str(page), "--offline"]) == 2


def test_a_study_record_keeps_what_a_new_machine_s_store_lacks(prefect_harness, tmp_path, tracking_uri):
    """On a new machine the repository holds the study's record but the MLflow store and data folder are
    gone: refreshing the record keeps every cell it shows finished (rows unchanged), drops the unfinished
    cell's lost progress, and the sweep runs only the cells the record does not show finished."""
    import pandas as pd
    import yaml
    from prefect import flow

    from flows.sweep import sweep
    from horizonrl.config.sweep import load_sweep
    from horizonrl.tracking import study_record
    from tasks.sweep import unfinished_cells

    base = _cfg(tmp_path, tracking_uri, iterations=1).model_dump()
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    spec = {"name": "study", "base": "base.yaml", "record": "record", "grid": {"method": ["loop", "grpo", "blpo"]}}
    (tmp_path / "study.yaml").write_text(yaml.safe_dump(spec))
    spec, cells = load_sweep(tmp_path / "study.yaml")
    record = spec.record_folder(tmp_path / "study.yaml")
    assert record == tmp_path / "record"
    won = {"loop": [0, 1, 1, 1], "grpo": [0, 1]}
    record.mkdir()
    pd.DataFrame(
        [
            {"seed": 3, "method": m, "iteration": 2 * (i // 2), "task": f"t{i % 2}", "won": w, "turns": 4 - w}
            for m, ws in won.items()
            for i, w in enumerate(ws)
        ]
    ).to_csv(record / study_record.OUTCOMES, index=False)
    pd.DataFrame(
        [
            {"seed": 3, "method": m, "iteration": i, "env_steps": 10.0 * i}
            for m, n in (("loop", 2), ("grpo", 1))
            for i in range(n)
        ]
    ).to_csv(record / study_record.PROGRESS, index=False)
    pd.DataFrame(
        [
            {"run_name": "study--method=loop", "seed": 3, "method": "loop", "status": "FINISHED", "iterations": 1},
            {"run_name": "study--method=grpo", "seed": 3, "method": "grpo", "status": "RUNNING", "iterations": 0},
            {"run_name": "study--method=blpo", "seed": 3, "method": "blpo", "status": "NOT STARTED"},
            {"run_name": "study-ws-seed3", "seed": 3, "method": "warmstart", "status": "FINISHED", "wall_s": 7.5},
        ]
    ).to_csv(record / study_record.CELLS, index=False)
    before = study_record.load(record)

    @flow
    def to_run(with_record: bool) -> list[str]:
        return [c.run_name for c in unfinished_cells(cells, record if with_record else None)]

    assert study_record.finished_runs(record) == {"study--method=loop": 1}
    assert to_run(True) == ["study--method=grpo", "study--method=blpo"]
    assert len(to_run(False)) == 3, "without the record, the store alone decides"

    study_record.export(cells, tracking_uri, record)  # the new machine's store: empty
    outcomes, progress, status = study_record.load(record)
    assert list(status["run_name"]) == ["study--method=loop", "study--method=grpo", "study--method=blpo",
                                        "study-ws-seed3"]  # fmt: skip
    assert list(status["status"]) == ["FINISHED", "NOT STARTED", "NOT STARTED", "FINISHED"]
    for new, old in ((outcomes, before[0]), (progress, before[1])):
        pd.testing.assert_frame_equal(new, old[old["method"] == "loop"].reset_index(drop=True), check_dtype=False)
    assert status.iloc[[0, 3]].equals(before[2].iloc[[0, 3]])

    status.loc[[1, 2], ["status", "iterations"]] = ["FINISHED", 1]  # every cell done, in the record only
    status.to_csv(record / study_record.CELLS, index=False)
    assert sweep(str(tmp_path / "study.yaml"), in_process=True) == [], "nothing to run, and no store report"
    c = MlflowClient(tracking_uri)
    assert [r.info.run_name for r in c.search_runs(c.get_experiment_by_name("test").experiment_id)] == ["study"]
