"""scripts/gpu_check.py's real-model check where it can run here: the session's tiny policy served by vLLM's CPU
build in float32 (on a GPU machine, ``make gpu-check`` runs it on SmolLM2 in bfloat16 with the CUDA build).
A real server, a real update and a real in-place reload; nothing is mocked."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a vLLM server start: CI's `make test`, not `make test-fast`

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"


def test_real_model_check_plays_updates_and_syncs_in_place_within_the_float32_tolerance(tiny_policy_dir, tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    found = gpu_check.real_model_check(Path(tiny_policy_dir), tmp_path, "cpu", 1e-4)
    assert found["sync_path"] == "in_place" and found["sync_s"] < 5
    assert found["gap_before"] <= 1e-4 and found["gap_after"] <= 1e-4
    assert found["passed"] and (tmp_path / "real-model-v1" / "model.safetensors").is_file()
