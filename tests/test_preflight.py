"""What a user brings from outside the config (issue 41): a model folder, an environment's package, a vLLM
interpreter or server, a rollout batch's memory. Each is refused by the ``horizonrl`` command in one line
naming the field, file or command, exit 2, before a Prefect flow or an MLflow run exists. On main each of
these passed the config check, started a flow, created an MLflow run, retried a task and exited 1 with
three tracebacks and a FAILED run.

Every command runs from an empty folder with the default ``data/`` and ``mlflow/``, so anything created by
mistake shows; the suite's after-session check also finds no MLflow run started during these tests.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import time
from pathlib import Path

import pytest
import yaml

from flows.cli import main
from horizonrl.config import TrainConfig
from horizonrl.run import preflight

pytestmark = pytest.mark.refuses_input


def _refused(args: list[str], capsys, *names: str) -> str:
    assert main(args) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    for name in names:
        assert name in err, err
    return err


def _model_copy(src: Path, dest: Path, files: list[str] | None = None) -> Path:
    dest.mkdir()
    for f in src.iterdir():
        if f.is_file() and (files is None or f.name in files):
            shutil.copyfile(f, dest / f.name)
    return dest


def test_a_truncated_weights_file_is_named_before_anything_starts(tiny_policy_dir, tmp_path, monkeypatch, capsys):
    """A download cut short: the safetensors header declares more bytes than the file holds."""
    monkeypatch.chdir(tmp_path)
    model = _model_copy(Path(tiny_policy_dir), tmp_path / "m")
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    err = _refused(["train", "--set=model.path=./m"], capsys, "model.path: m/model.safetensors", "truncated")
    assert err.startswith("horizonrl: run 'loop-household-easy' not started: model.path: ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_weights_without_a_tokenizer_are_named(tiny_policy_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    _model_copy(Path(tiny_policy_dir), tmp_path / "m", ["config.json", "model.safetensors"])
    _refused(["train", "--set=model.path=./m"], capsys, "model.path", "its tokenizer does not load", "save_pretrained")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_a_whole_model_folder_passes_and_headers_are_read_exactly(tiny_policy_dir, tmp_path):
    """The check itself: a whole folder passes, and a LoRA policy's (adapters and tokenizer, the model in its
    base folder); one byte more or less in the weights is named."""
    from horizonrl.config import LoraConfig
    from horizonrl.models.loading import initial_adapter_dir

    preflight.check_model_folder(tiny_policy_dir, "model.path")
    preflight.check_model_folder(initial_adapter_dir(tmp_path, tiny_policy_dir, LoraConfig(), 0), "the policy")
    weights = _model_copy(Path(tiny_policy_dir), tmp_path / "m") / "model.safetensors"
    assert preflight.safetensors_problem(weights) is None
    weights.write_bytes(weights.read_bytes() + b"\0")
    assert "extra bytes" in preflight.safetensors_problem(weights)
    weights.write_bytes(b"\x05")
    assert "shorter than a safetensors header" in preflight.safetensors_problem(weights)


def test_an_environment_whose_package_is_missing_is_named(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path / "no-alfworld-data"))
    _refused(["train", "--set=env.name=alfworld"], capsys, "env.name = 'alfworld'", "pip install alfworld")
    assert list(tmp_path.iterdir()) == []


def test_a_missing_vllm_interpreter_and_a_silent_server_are_named(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    _refused(
        ["train", "--set=engine.name=vllm", "--set=engine.vllm.python=/nonexistent/python"],
        capsys,
        "engine.vllm.python = '/nonexistent/python': no such interpreter",
        "make vllm-venv",
    )
    _refused(
        ["train", "--set=engine.name=vllm", "--set=engine.vllm.url=http://127.0.0.1:9"],
        capsys,
        "engine.vllm.url = 'http://127.0.0.1:9' does not answer GET /v1/models",
    )
    assert list(tmp_path.iterdir()) == []


def test_a_rollout_batch_too_large_for_memory_names_the_setting(tmp_path, monkeypatch, capsys):
    """The OOM killer ends a process without a word; the estimate (KV cache and logits of every episode
    played at once) against the free memory names the setting first."""
    monkeypatch.chdir(tmp_path)
    _refused(
        ["train", "--set=rollout.tasks_per_iteration=4000000"],
        capsys,
        "rollout.tasks_per_iteration = 4000000: 32000000 episodes at once need about",
        "GiB is free; lower it",
    )
    assert list(tmp_path.iterdir()) == []
    preflight.check_rollout_memory(TrainConfig())  # the default batch fits


def test_every_sweep_cell_is_checked_before_the_first_starts(tmp_path, monkeypatch, capsys):
    """The second cell's batch cannot fit: the sweep is refused before its first, good, cell starts."""
    monkeypatch.chdir(tmp_path)
    Path("base.yaml").write_text("iterations: 1\n")
    grid = {"rollout.tasks_per_iteration": [2, 4000000]}
    Path("sweep.yaml").write_text(yaml.safe_dump({"name": "s", "base": "base.yaml", "grid": grid}))
    _refused(
        ["sweep", "sweep.yaml", "--here"],
        capsys,
        "horizonrl: sweep not started: cell 's--rollout.tasks_per_iteration=4000000': rollout.tasks_per_iteration",
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base.yaml", "sweep.yaml"]


def test_recompute_over_a_folder_without_iterations_is_refused_before_its_flow(tmp_path, capsys):
    _refused(
        ["recompute", "--run-dir", str(tmp_path), "--method", "grpo"],
        capsys,
        f"--run-dir {str(tmp_path)!r} holds no stored iteration",
        "nothing was written",
    )
    assert list(tmp_path.iterdir()) == []


def test_a_resume_with_changed_settings_is_refused_naming_each_change(tmp_path, monkeypatch, capsys):
    """The run folder's config.yaml is what the run last ran with: a changed field is named with both values,
    unless it only extends the run; an ``--allow-change`` that names no field is refused too."""
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "data" / "horizonrl" / "r"
    (run / "checkpoints" / "iter=00001").mkdir(parents=True)  # it finished an iteration: a start is a resume
    ran = TrainConfig(run_name="r", iterations=1).model_dump()
    (run / "config.yaml").write_text(yaml.safe_dump(ran))
    _refused(
        ["train", "--set=run_name=r", "--set=iterations=2", "--set=update.lr=0.5", "--set=seed=4"],
        capsys,
        "run 'r' resumes with changed settings: seed 0 -> 4; update.lr 0.001 -> 0.5",
        "--allow-change seed --allow-change update.lr",
    )
    _refused(
        ["train", "--set=run_name=r", "--set=update.lr=0.5", "--allow-change=update.lrr"],
        capsys,
        "--allow-change update.lrr: not a field or section of the config",
    )
    assert yaml.safe_load((run / "config.yaml").read_text()) == ran
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "config.yaml"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]


def test_the_pinned_vllm_version_is_the_makefiles():
    """The preflight expects the vLLM release `make vllm-venv` installs: the two pins are one decision."""
    makefile = (Path(__file__).resolve().parents[1] / "Makefile").read_text()
    [pinned] = re.findall(r"^VLLM_VERSION \?= (\S+)$", makefile, flags=re.MULTILINE)
    assert preflight.VLLM_VERSION == pinned


def _retyped(src: Path, dest: Path, model_type: str) -> Path:
    """A copy of the tiny Qwen2 model whose config says another architecture (a config from another model,
    or a ``model_type`` edited), its weights unchanged."""
    _model_copy(src, dest)
    config = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    return dest


@pytest.mark.parametrize(
    "model_type,names",
    [
        (
            "llama",
            ["(LlamaForCausalLM, model_type 'llama')", "6 it has no place for (model.layers.0.self_attn.k_proj.bias"],
        ),
        ("qwen3", ["4 of its tensors missing (model.layers.0.self_attn.k_norm.weight", "6 it has no place for"]),
        ("nonsense", ["its config.json does not describe a causal LM transformers can build", "`nonsense`"]),
    ],
)
def test_a_config_that_does_not_fit_its_weights_is_named(
    tiny_policy_dir, tmp_path, monkeypatch, capsys, model_type, names
):
    """The architecture the config names is built on the meta device and its tensors' names and shapes
    compared with the safetensors headers; on main a changed ``model_type`` passed the preflight and failed
    inside transformers (exit 1, three tracebacks, a FAILED MLflow run)."""
    monkeypatch.chdir(tmp_path)
    _retyped(Path(tiny_policy_dir), tmp_path / "m", model_type)
    err = _refused(["train", "--set=model.path=./m"], capsys, "model.path: m: its ", *names)
    assert "download or save the model again" in err or model_type == "nonsense"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_random_bytes_are_not_a_safetensors_file(tiny_policy_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    weights = _model_copy(Path(tiny_policy_dir), tmp_path / "m") / "model.safetensors"
    weights.write_bytes(random.Random(0).randbytes(100_000))
    _refused(["train", "--set=model.path=./m"], capsys, "m/model.safetensors: not a safetensors file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


@pytest.fixture()
def hub(monkeypatch):
    """A model hub on loopback (``HF_ENDPOINT``) that has ``org/there`` and nothing else."""
    import http.server
    import threading

    class Hub(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/api/models/org/there" else 404)
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True).start()  # a prompt shutdown()
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    yield server
    server.shutdown()


def test_a_missing_folder_is_named_with_both_readings_when_the_hub_lacks_it_or_cannot_be_reached(
    hub, tmp_path, monkeypatch, capsys
):
    """``mymodels/tiny`` is a folder that is not here or a hub id: asked once, with a short timeout and no
    retries; on main it was taken for a hub id and retried five times (about 100 s), then exit 1 with six
    tracebacks, a FAILED run and a config.yaml written."""
    from horizonrl.engines.vllm_server import free_port

    monkeypatch.chdir(tmp_path)
    forms = "give a model folder (./path), a known pretrained model (gemma3-270m, smollm2-135m-instruct)"
    _refused(
        ["train", "--set=model.path=mymodels/tiny"],
        capsys,
        "model.path = 'mymodels/tiny': no folder 'mymodels/tiny' here, and the hub at http://127.0.0.1:",
        "has no such model (HTTP 404",
        forms,
    )
    assert preflight.hub_status("org/there") is None  # a hub id the hub has passes
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    started = time.monotonic()
    _refused(["train", "--set=model.path=mymodels/tiny"], capsys, "cannot be reached", forms)
    assert time.monotonic() - started < 30
    assert list(tmp_path.iterdir()) == []


def test_a_logged_policy_the_store_does_not_hold_is_named(tmp_path, monkeypatch, capsys):
    """``runs:/<id>`` and ``models:/<name>/<version>`` are looked up in the tracking store before anything is
    created; on main an unknown run id ended with exit 1, six tracebacks and the data folder and its lock
    created. A store that does not exist is not created to be asked."""
    from horizonrl.tracking.mlflow_runs import client

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # the default store, ./mlflow: not there
    run = "runs:/0123456789abcdef0123456789abcdef"
    _refused(
        ["train", f"--set=model.path={run}"], capsys, f"model.path = '{run}': the tracking store", "does not exist"
    )
    assert list(tmp_path.iterdir()) == []
    uri = f"sqlite:///{tmp_path}/store/mlflow.db"
    client(uri)  # an existing store without them
    capsys.readouterr()
    _refused(
        ["train", f"--set=model.path={run}", f"--set=tracking_uri={uri}"],
        capsys,
        f"model.path = '{run}': no run with id '0123456789abcdef0123456789abcdef' in {uri}",
    )
    _refused(
        ["train", "--set=model.path=models:/nothing/1", f"--set=tracking_uri={uri}"],
        capsys,
        f"model.path = 'models:/nothing/1': no version 1 of a registered model 'nothing' in {uri}",
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]
