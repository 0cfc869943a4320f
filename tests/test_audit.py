"""``horizonrl audit`` end to end (issue 48): the real flow (the session's Prefect harness), MLflow on SQLite,
Parquet, real models and the household environment, at tiny counts: on a tiny run's checkpoint (BLPO audited
cold and warm from the run's stored batches, a rerun resuming from the store, the page generated from it) and
on SmolLM2-135M-Instruct (transformers engine). Bad input is refused in one line before any run exists.

The audit's statistics are proven on a chain with a closed-form truth in tests/test_audit_proof.py."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.compute as pc
import pytest
from flowkit import run_of, tiny_config

import methods
from flows.audit import audit
from flows.cli import main
from horizonrl import store
from horizonrl.audit.page import recorded_audits, write_page
from horizonrl.audit.policy import training_run
from horizonrl.models import pretrained
from horizonrl.training.checkpoint import checkpoint_dir
from mlflow import MlflowClient
from tasks.audit import audited_policy
from tasks.audit_settings import audit_settings

ROOT = Path(__file__).resolve().parents[1]
SMALL = {"tasks": 3, "points": 6, "continuations": 2, "block_points": 4, "bootstrap": 100}
LABELS = {*methods.ADVANTAGES.names(), "blpo_cold", "blpo_warm", "appo_at_branches"} - {"blpo"}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, prefect_harness) -> dict:
    """A tiny LOOP run of 2 iterations (its rollouts stored), and an audit of its last checkpoint."""
    from flows.train import train

    root = tmp_path_factory.mktemp("audit")
    uri = f"sqlite:///{root}/mlflow.db"
    cfg = tiny_config(root, uri, "tiny-loop", iterations=2)
    cfg["eval"] = {"every": 2, "n_tasks": 1, "greedy": False}
    train(config=cfg)
    run = root / "data" / "test" / "tiny-loop"
    policy = str(checkpoint_dir(run, 2))
    settings = audit_settings(policy, None, ["env.max_turns=6", "rollout.group_size=3"], SMALL, None)
    first = audit(config=settings[0].model_dump(), settings=settings[1].model_dump(), name=settings[2], policy=policy)
    return {"root": root, "uri": uri, "policy": policy, "settings": settings, "scores": first}


@pytest.mark.slow
def test_the_audit_of_a_runs_checkpoint_scores_every_estimator_and_blpo_cold_and_warm(trained):
    cfg, settings, name = trained["settings"]
    assert name == "tiny-loop-iter2--audit-household-easy-s3"
    scores = trained["scores"]
    assert set(scores["estimators"]) == LABELS and scores["order"][0] == "loo"
    assert all(set(e) == {"spearman", "sign_agreement", "ordering"} for e in scores["estimators"].values())
    assert scores["trained_by"].endswith("tiny-loop") and scores["policy_iteration"] == 2
    folder = Path(cfg.data_dir) / cfg.experiment / name
    cold, warm = (json.loads((folder / f"estimator_state-blpo_{k}.json").read_text()) for k in ("cold", "warm"))
    weight = {k: sum(r["W"] for r in m["records"]) for k, m in (("cold", cold), ("warm", warm))}
    assert weight["warm"] > weight["cold"] > 0, f"the warm memory holds the run's two batches too: {weight}"
    assert (folder / "advantages-blpo_warm.parquet").is_file() and (folder / "advantages-appo.parquet").is_file()
    points = store.read_table(folder / "points.parquet", "audit")
    assert points.num_rows == scores["points"] == 6 and all(len(q) == 2 for q in points["v_returns"].to_pylist())
    blocks = sorted((folder / "continuations").glob("*-episodes.parquet"))
    continuations = store.read_table(blocks[0], "episodes")
    assert len(blocks) == 2 and set(continuations["kind"].to_pylist()) == {"audit"}
    appo = store.read_table(folder / "appo-episodes.parquet", "episodes")
    assert pc.sum(pc.equal(appo["kind"], "branch")).as_py() == 9, "APPO's branches: group_size per group"


@pytest.mark.slow
def test_the_audit_logs_its_figures_table_and_figure_to_an_mlflow_run_of_its_own(trained):
    c = MlflowClient(trained["uri"])
    run = run_of(c, trained["settings"][2])
    assert run.info.status == "FINISHED" and run.data.tags["horizonrl.kind"] == "audit"
    assert run.data.params["audit.continuations"] == "2" and run.data.params["audit.policy"] == trained["policy"]
    assert {f"audit/{label}/spearman_n" for label in LABELS} <= run.data.metrics.keys()
    assert {"audit/points", "audit/seconds_per_point", "time/play_s", "time/continuations_s"} <= run.data.metrics.keys()
    artifacts = {a.path for a in c.list_artifacts(run.info.run_id, "audit")}
    assert artifacts == {"audit/points.parquet", "audit/scores.json", "audit/audit.png"}


@pytest.mark.slow
def test_a_rerun_resumes_from_the_store_and_the_page_is_generated_from_it(trained, tmp_path):
    cfg, settings, name = trained["settings"]
    folder = Path(cfg.data_dir) / cfg.experiment / name
    stamps = {p: p.stat().st_mtime_ns for p in folder.glob("continuations/*.parquet")}
    (folder / "points.parquet").unlink()  # the truth again, from the stored continuations
    again = audit(config=cfg.model_dump(), settings=settings.model_dump(), name=name, policy=trained["policy"])
    assert {p: p.stat().st_mtime_ns for p in folder.glob("continuations/*.parquet")} == stamps, "nothing played"
    assert again["estimators"] == json.loads(json.dumps(trained["scores"]["estimators"]))
    page = tmp_path / "credit-audit.md"
    assert main(["audit-report", str(folder), "--out", str(page)]) == 0
    text = page.read_text()
    assert f"## {name}" in text and "**Noise ceiling**" in text and "| BLPO, warm memory |" in text
    assert (tmp_path / "credit-audit" / f"{name}.png").is_file() and "No audit has been run" not in text
    assert recorded_audits(page) == [tmp_path / "credit-audit" / name]
    recorded, written = (json.loads((f / "scores.json").read_text()) for f in (page.with_suffix("") / name, folder))
    assert json.dumps(recorded, sort_keys=True) == json.dumps(written, sort_keys=True), "the page's record"


@pytest.mark.slow
def test_a_logged_policy_brings_its_runs_config_and_its_runs_batches(trained, monkeypatch):
    """``--policy runs:/<id>`` with no ``--config``: the run's own config, its logged policy downloaded, and the
    run's folder found from the checkpoint's state (so BLPO can be audited warm)."""
    c = MlflowClient(trained["uri"])
    monkeypatch.setenv("MLFLOW_TRACKING_URI", trained["uri"])
    run_id = run_of(c, "tiny-loop").info.run_id
    cfg, _, name = audit_settings(f"runs:/{run_id}", None, [], SMALL, None)
    assert cfg.run_name == "tiny-loop" and name == f"{run_id}--audit-household-easy-s3"
    policy = audited_policy(cfg, f"runs:/{run_id}")
    assert policy.iteration == 2 and training_run(policy, c) == trained["root"] / "data" / "test" / "tiny-loop"


def test_the_shipped_page_is_the_generated_one(tmp_path):
    """docs/credit-audit.md is what ``horizonrl audit-report`` writes from the audits' scores recorded beside it
    (docs/credit-audit/<name>/scores.json, in the page's order): never typed."""
    shipped = ROOT / "docs" / "credit-audit.md"
    page = write_page(recorded_audits(shipped), tmp_path / "credit-audit.md")
    assert shipped.read_text() == page.read_text()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--points", "1"], "--points 1: Input should be greater than or equal to 2"),
        (["--continuations", "1", "--config", "configs/loop_household_easy.yaml"], "--continuations 1:"),
        (["--policy", "no-such-model", "--config", "configs/loop_household_easy.yaml"], "no-such-model"),
        (["--policy", "smollm2-135m-instruct"], "--config: give the config the policy plays by"),
        (
            ["--config", "configs/loop_household_easy.yaml", "--set", "rollout.group_size=1"],
            "rollout.group_size is too small",
        ),
        (["--config", "configs/loop_household_easy.yaml", "--name", "../x"], "--name '../x'"),
    ],
)
def test_bad_input_is_refused_in_one_line_before_any_run(args, says, capsys, tmp_path):
    assert main(["audit", *args, "--set", f"data_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err
    assert not any(tmp_path.iterdir()), "nothing written"


def test_the_report_refuses_a_folder_that_holds_no_finished_audit(capsys, tmp_path):
    assert main(["audit-report", str(tmp_path), "--out", str(tmp_path / "page.md")]) == 2
    assert "holds no scores.json" in capsys.readouterr().err and not (tmp_path / "page.md").exists()


@pytest.mark.slow
def test_the_audit_of_smollm2_on_the_transformers_engine(prefect_harness, tmp_path):
    """The real pretrained model through the whole audit, at the smallest counts (seconds per point logged)."""
    model = pretrained.fetch("smollm2-135m-instruct", ROOT / "data")  # the suite's cache (make setup-test fills it)
    overrides = ["engine.name=transformers", "rollout.max_staleness=0", "env.max_turns=3", "rollout.group_size=2",
                 f"model.path={model}", f"data_dir={tmp_path}",
                 f"tracking_uri=sqlite:///{tmp_path}/mlflow.db"]  # fmt: skip
    given = {**SMALL, "tasks": 2, "points": 3}
    cfg, settings, name = audit_settings(None, "configs/smollm2_household_easy.yaml", overrides, given, None)
    scores = audit(config=cfg.model_dump(), settings=settings.model_dump(), name=name)
    assert name == "smollm2-135m-instruct--audit-household-easy-s0" and scores["points"] == 3
    assert set(scores["estimators"]) == LABELS - {"blpo_warm"}, "a pretrained model has no run: BLPO cold only"
    assert scores["seconds_per_point"] > 0 and scores["config"]["engine"] == "transformers"
