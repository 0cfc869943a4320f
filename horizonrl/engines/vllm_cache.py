"""vLLM's own cache, shared by every server the project starts on this machine: ``horizonrl/vllm`` under the
machine's cache folder (``files.machine_cache``: ``$XDG_CACHE_HOME``, else ``~/.cache``), each server's
``VLLM_CACHE_ROOT``.

What vLLM keeps there is keyed by content (a model module's file hash, a compiled graph's hash), so it
holds for any run and data folder. On its first start for an architecture vLLM inspects the model class in
a subprocess that imports vLLM again, and caches the answer in ``modelinfos/``: measured on the 2-core test
machine under load, a server start took 64-77 s without it and 34 s with it. Kept under each run's data
folder (before issue 51), every new data folder paid it again, every test's included; ``make setup-test``
now pays it once per machine (``warm``), for the architectures the project's models have.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from horizonrl.files import machine_cache

ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM", "Gemma3ForCausalLM")
"""The tiny models' (word tokenizer: Qwen2; Qwen3; Llama 3) and the pretrained ones' (SmolLM2: Llama;
Gemma 3) architectures."""

INSPECT = """
import sys
from vllm.model_executor.models.registry import ModelRegistry
for arch in sys.argv[1:]:
    if ModelRegistry._try_inspect_model_cls(arch) is None:  # inspected in a subprocess, cached in modelinfos/
        raise SystemExit(f"vLLM cannot inspect {arch}")
"""


def cache_root() -> Path:
    """The folder every server's ``VLLM_CACHE_ROOT`` names."""
    return machine_cache() / "vllm"


def warm(python: str | Path, architectures: tuple[str, ...] = ARCHITECTURES) -> None:
    """Fill the cache's model information for ``architectures`` with the vLLM that ``python`` imports; nothing
    to do (not even importing vLLM) where every one has its file already (a server whose vLLM finds one of
    another vLLM version inspects again, once)."""
    if all(list((cache_root() / "modelinfos").glob(f"*-{arch}.json")) for arch in architectures):
        return
    env = {**os.environ, "VLLM_CACHE_ROOT": str(cache_root()), "HF_HUB_OFFLINE": "1"}
    subprocess.run([str(python), "-c", INSPECT, *architectures], env=env, check=True, timeout=1800)


if __name__ == "__main__":  # ``python -m horizonrl.engines.vllm_cache warm PYTHON``: what ``make setup-test`` runs
    if sys.argv[1:2] != ["warm"] or len(sys.argv) != 3:
        raise SystemExit("usage: python -m horizonrl.engines.vllm_cache warm <vLLM's python>")
    warm(sys.argv[2])
    print(f"vLLM's model information for {', '.join(ARCHITECTURES)} cached in {cache_root()}")
