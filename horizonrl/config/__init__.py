"""The run's typed configuration (``schema``) and how it is read from YAML and ``--set`` (``loader``).

Importers take names from here (``from horizonrl.config import TrainConfig, load_config``)."""

from horizonrl.config.audit import AuditConfig
from horizonrl.config.loader import CONFIG_FILE, apply_overrides, load_config, override_keys, train_config, validated
from horizonrl.config.problems import ConfigError, FieldProblem
from horizonrl.config.schema import (
    CPU_HEAD_DIMS,
    MODEL_URI_PREFIXES,
    NAME_PATTERN,
    EngineConfig,
    EnvConfig,
    EvalConfig,
    LoraConfig,
    MethodParams,
    ModelConfig,
    RayConfig,
    RolloutConfig,
    TinyModelConfig,
    TraceConfig,
    TrainConfig,
    UpdateConfig,
    VLLMConfig,
    WarmStartConfig,
    model_head_dim,
    run_dir,
    warm_start_config,
)

__all__ = [
    "AuditConfig",
    "CPU_HEAD_DIMS",
    "model_head_dim",
    "CONFIG_FILE",
    "ConfigError",
    "FieldProblem",
    "validated",
    "apply_overrides",
    "override_keys",
    "MODEL_URI_PREFIXES",
    "NAME_PATTERN",
    "EngineConfig",
    "EnvConfig",
    "EvalConfig",
    "LoraConfig",
    "MethodParams",
    "ModelConfig",
    "RayConfig",
    "RolloutConfig",
    "TinyModelConfig",
    "TraceConfig",
    "TrainConfig",
    "UpdateConfig",
    "VLLMConfig",
    "WarmStartConfig",
    "load_config",
    "run_dir",
    "train_config",
    "warm_start_config",
]
