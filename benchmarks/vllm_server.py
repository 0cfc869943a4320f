"""The ``vllm`` section (only where ``.venv-vllm`` exists, ``make vllm-venv``): the vLLM engine against a real
server, on the README's main run settings (tiny Qwen2, household easy, admissible actions, full context).

* start-up: the server started to ``/health`` (the CPU build on a CPU machine: imports dominate);
* rollout ratio: ``rollout.collect`` of ``tasks x group`` episodes with the vLLM engine against the same
  with the transformers engine in this process (time_transformers / time_vllm; > 1: vLLM faster);
* requests per admissible action: completions the server counted (its ``vllm:request_success_total``) per
  action played, and per token with a choice: the per-step path asks once per branching token;
* weight sync: a moved checkpoint reloaded in place (``/collective_rpc reload_weights`` on the untied serving
  copy, prefix cache reset, probe checked) against a restart of the server on it; the probe's max log-prob
  difference from the learner after each.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from benchmarks.report import Figure
from horizonrl.config import TrainConfig
from horizonrl.engines.hf import TransformersEngine
from horizonrl.engines.vllm import VLLMLaunch
from horizonrl.engines.vllm_server import free_port
from horizonrl.envs import make_suite
from horizonrl.models.loading import load_policy
from horizonrl.models.probe import probe_of
from horizonrl.rollout.loop import SamplingSettings, collect
from horizonrl.rollout.prompting import ChatFormat
from horizonrl.run.learner import initial_model_dir

VLLM_PYTHON = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"


def available() -> bool:
    """The section runs only where vLLM's environment exists."""
    return VLLM_PYTHON.is_file()


def served_config(cfg: TrainConfig, out: Path) -> TrainConfig:
    """``cfg`` with the vLLM engine: a server of ``.venv-vllm`` on a free port, its files under ``out``."""
    vllm = cfg.engine.vllm.model_copy(update={"python": str(VLLM_PYTHON), "port": free_port()})
    return cfg.model_copy(
        update={"engine": cfg.engine.model_copy(update={"name": "vllm", "vllm": vllm}), "data_dir": str(out)}
    )


def run(cfg: TrainConfig, tasks_n: int, group: int, out: Path, seed: int = 0) -> list[Figure]:
    suite = make_suite(cfg.env.name, cfg.env.suite_seed, cfg.env.games, cfg.data_dir)
    model_dir = initial_model_dir(cfg, suite)
    model, tokenizer = load_policy(model_dir)
    fmt = ChatFormat.for_tokenizer(tokenizer)
    end_ids = list(fmt.stop_ids)
    hf = TransformersEngine(model, tokenizer.pad_token_id, end_ids)
    sampling = SamplingSettings.from_config(cfg, suite, seed)
    tasks = suite.tasks("train", cfg.env.tier, tasks_n)
    vcfg = served_config(cfg, out)
    t0 = time.perf_counter()
    engine = VLLMLaunch.from_config(vcfg).engine(str(model_dir), end_ids)
    startup_s = time.perf_counter() - t0
    try:
        collect(suite, tasks[:1], 2, engine, fmt, sampling)  # warm-up: the first requests initialise lazily
        collect(suite, tasks[:1], 2, hf, fmt, sampling)
        before = engine.client.metrics()["vllm:request_success_total"]
        t0 = time.perf_counter()
        played = collect(suite, tasks, group, engine, fmt, sampling)
        vllm_s = time.perf_counter() - t0
        requests = engine.client.metrics()["vllm:request_success_total"] - before
        t0 = time.perf_counter()
        collect(suite, tasks, group, hf, fmt, sampling)
        hf_s = time.perf_counter() - t0
        actions = sum(len(r.turns) for r in played)
        choices = sum(sum(t.gen.policy_mask) for r in played for t in r.turns)

        moved, _ = load_policy(model_dir)
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in moved.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
        ckpt = out / "moved"
        moved.save_pretrained(ckpt, safe_serialization=True)
        tokenizer.save_pretrained(ckpt)
        probe = probe_of(moved.eval(), len(tokenizer))
        engine.sync(str(ckpt), probe)
        in_place = engine.last_sync
        engine.reload_in_place = False
        engine.sync(str(model_dir), probe_of(model.eval(), len(tokenizer)))
        restart = engine.last_sync
    finally:
        engine.close()
    return [
        Figure("vllm/startup_s", startup_s, "s", "", None, "server started to /health"),
        Figure(
            "vllm/rollout_ratio",
            hf_s / vllm_s,
            "x",
            "",
            None,
            f"transformers {hf_s:.1f} s / vLLM {vllm_s:.1f} s, {tasks_n}x{group} episodes",
        ),
        Figure(
            "vllm/requests_per_action",
            requests / max(actions, 1),
            "req",
            "",
            None,
            f"{requests:.0f} requests, {actions} actions, {choices} tokens with a choice",
        ),
        Figure(
            "vllm/weight_sync_in_place_s",
            in_place.seconds,
            "s",
            "<= 1",
            in_place.path == "in_place" and in_place.seconds <= 1.0,
            f"{in_place.path}; probe max diff {in_place.probe_max_diff:.1e}",
        ),
        Figure(
            "vllm/weight_sync_restart_s",
            restart.seconds,
            "s",
            "",
            None,
            f"{restart.path}; probe max diff {restart.probe_max_diff:.1e}",
        ),
    ]
