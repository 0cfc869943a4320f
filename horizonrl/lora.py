"""LoRA training (peft): a frozen base model plus low-rank adapters, the only weights that train.

A LoRA policy directory holds the adapter (``adapter_config.json`` + ``adapter_model.safetensors``) and the
tokenizer, never the base weights: the adapter config names the base model's directory, so a checkpoint
of a 7 B model costs megabytes. ``models.load_policy`` recognises such a directory and rebuilds base +
adapter, so every path that loads a checkpoint (the holder, the reference policy, the MLflow model)
works unchanged. vLLM serves the same directory as a LoRA adapter (``engines/vllm.py``).

The initial adapter is built once per (base, settings, seed) under ``<data_dir>/models/`` like the tiny
model. peft initialises B = 0, so the initial policy is exactly the base model.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch

from horizonrl.config import LoraConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def peft_config(cfg: LoraConfig):
    """The peft ``LoraConfig`` for a causal LM from our settings."""
    import peft

    return peft.LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=list(cfg.target_modules), bias="none", task_type="CAUSAL_LM")


def attach(model: torch.nn.Module, cfg: LoraConfig, seed: int) -> torch.nn.Module:
    """Wrap ``model`` with fresh adapters (A from ``seed``, B = 0); base weights are frozen."""
    import peft

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return peft.get_peft_model(model, peft_config(cfg))


def is_adapter_dir(path: str | Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def base_model_path(adapter_dir: str | Path) -> str:
    """The base model directory (or hub id) the adapter was trained on, as written in its config."""
    return json.loads((Path(adapter_dir) / ADAPTER_CONFIG).read_text())["base_model_name_or_path"]


def load_adapter_policy(adapter_dir: str | Path, base: torch.nn.Module) -> torch.nn.Module:
    """``base`` with the adapter of ``adapter_dir`` loaded, adapters trainable (the holder trains it)."""
    import peft

    return peft.PeftModel.from_pretrained(base, str(adapter_dir), is_trainable=True)


def initial_adapter_dir(data_dir: str | Path, base_dir: str | Path, cfg: LoraConfig, seed: int) -> Path:
    """Build (once) and return a policy directory with fresh adapters over ``base_dir``."""
    from horizonrl.models import load_policy

    base = str(Path(base_dir).resolve()) if Path(base_dir).is_dir() else str(base_dir)  # absolute: checkpoints move
    spec = {"base": base, "lora": cfg.model_dump(), "seed": seed}
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    out = Path(data_dir) / "models" / f"lora-{Path(base).name}-{key}"
    if (out / ADAPTER_WEIGHTS).is_file():
        return out
    model, tokenizer = load_policy(base)
    model = attach(model, cfg, seed)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(out)
    except OSError:  # another process built it first; keep theirs
        shutil.rmtree(tmp)
        if not (out / ADAPTER_WEIGHTS).is_file():
            raise
    return out


def log_adapter(tracking_uri: str, run_id: str, checkpoint: str | Path, iteration: int) -> None:
    """Log a checkpoint's adapter files to the MLflow run under ``adapters/iter=<n>/``."""
    from horizonrl.tracking import client

    c = client(tracking_uri)
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        c.log_artifact(run_id, str(Path(checkpoint) / name), artifact_path=f"adapters/iter={iteration:05d}")
