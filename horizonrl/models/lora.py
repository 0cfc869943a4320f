"""LoRA training (peft): a frozen base model plus low-rank adapters, the only weights that train.

A LoRA policy directory holds the adapter (``adapter_config.json`` + ``adapter_model.safetensors``) and the
tokenizer, never the base weights: the adapter config names the base model's directory, so a checkpoint
of a 7 B model costs megabytes. ``models.loading.load_policy`` recognises such a directory and rebuilds base +
adapter, so every path that loads a checkpoint (the holder, the reference policy, the MLflow model)
works unchanged. vLLM serves the same directory as a LoRA adapter (``engines/vllm.py``).

The initial adapter is built once per (base, settings, seed) under ``<data_dir>/models/`` like the tiny
model (``models.loading.initial_adapter_dir``). peft initialises B = 0, so the initial policy is exactly the base model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from horizonrl.config import LoraConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def peft_config(cfg: LoraConfig):
    """The peft ``LoraConfig`` for a causal LM from our settings."""
    import peft

    return peft.LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )


def attach(model: torch.nn.Module, cfg: LoraConfig, seed: int) -> torch.nn.Module:
    """Wrap ``model`` with fresh adapters (A from ``seed``, B = 0); base weights are frozen."""
    import peft

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return peft.get_peft_model(model, peft_config(cfg))


def settle_config(adapter_dir: str | Path) -> None:
    """peft writes ``target_modules`` from a set, in an order that changes from process to process (string
    hashing is salted per process): sorted here, so one adapter always has the same config bytes, and so the
    same policy digest (``checkpoint.policy_digest``: a starting evaluation is shared by that digest)."""
    path = Path(adapter_dir) / ADAPTER_CONFIG
    config = json.loads(path.read_text())
    if isinstance(config.get("target_modules"), list):
        config["target_modules"] = sorted(config["target_modules"])
    path.write_text(json.dumps(config, indent=2, sort_keys=True))


def is_adapter_dir(path: str | Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def base_model_path(adapter_dir: str | Path) -> str:
    """The base model directory (or hub id) the adapter was trained on, as written in its config."""
    return json.loads((Path(adapter_dir) / ADAPTER_CONFIG).read_text())["base_model_name_or_path"]


def load_adapter_policy(adapter_dir: str | Path, base: torch.nn.Module) -> torch.nn.Module:
    """``base`` with the adapter of ``adapter_dir`` loaded, adapters trainable (the holder trains it)."""
    import peft

    return peft.PeftModel.from_pretrained(base, str(adapter_dir), is_trainable=True)
