"""What ``horizonrl audit`` brings, checked before the flow starts (the CLI calls ``audit_settings``, so bad input
is one line and no run is created): the policy, the train config it plays by, the audit's settings and its
name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ValidationError

from horizonrl.audit.policy import checkpoint_ref, is_checkpoint
from horizonrl.config import (
    CONFIG_FILE,
    MODEL_URI_PREFIXES,
    NAME_PATTERN,
    AuditConfig,
    TrainConfig,
    apply_overrides,
    load_config,
    override_keys,
    validated,
)
from horizonrl.run import preflight
from horizonrl.tracking import mlflow_runs
from tasks.audit import audited_policy
from tasks.evaluation_run import config_of_run


def audit_settings(
    policy: str | None, config_path: str | None, overrides: list[str], given: dict[str, Any], name: str | None
) -> tuple[TrainConfig, AuditConfig, str]:
    """(train config, audit settings, audit name) of ``horizonrl audit``, checked: the policy (a model folder, a
    pretrained model's name, ``models:/<name>/<version>``, ``runs:/<run id>``, a run's checkpoint folder; None:
    the config's model), the config (``--config``, else the checkpoint's run's or the logged policy's run's),
    the overrides, the settings (``given``, flags by field), what the policy plays (``preflight``). Every
    problem is a one-line ``ValueError`` naming the flag or field."""
    try:
        settings = AuditConfig(**{k: v for k, v in given.items() if v is not None})
    except ValidationError as err:
        first = err.errors()[0]
        raise ValueError(f"--{str(first['loc'][0]).replace('_', '-')} {first['input']}: {first['msg']}") from err
    sets = [*overrides, "warmstart.before_rl=false"]  # the audited policy is the one to play: no warm start first
    if policy is not None and not is_checkpoint(policy):
        sets.append(f"model.path={policy}")
    raw = (load_config(config_path) if config_path else _config_of(policy)).model_dump()
    cfg = validated(apply_overrides(raw, sets), where=dict.fromkeys(override_keys(sets), "from --set"))
    if cfg.rollout.group_size < 2:
        raise ValueError("rollout.group_size = 1: the group estimators need at least 2 episodes of a task")
    name = name or default_name(policy, cfg)
    if not NAME_PATTERN.fullmatch(name):
        raise ValueError(f"--name {name!r}: up to 200 letters, digits and . _ = + , @ -, not starting with a dot")
    ref = audited_policy(cfg, policy)
    preflight.check_run(cfg, ref.path)
    preflight.check_commands(cfg, ref.path, settings.split)
    return cfg, settings, name


def _config_of(policy: str | None) -> TrainConfig:
    """The config a policy brings: its run's ``config.yaml`` (a checkpoint folder inside its run's folder), or
    a logged policy's source run's (its artifact); else ``--config`` is needed."""
    if policy is not None and is_checkpoint(policy):
        found = Path(policy).expanduser().parent.parent / CONFIG_FILE
        if found.is_file():
            return load_config(found)
    if policy is not None and policy.startswith(MODEL_URI_PREFIXES):
        c = mlflow_runs.client(mlflow_runs.tracking_uri())
        return config_of_run(c, mlflow_runs.resolve_policy(c, policy)[0])
    raise ValueError("--config: give the config the policy plays by (environment, prompt, decoding, engine)")


def default_name(policy: str | None, cfg: TrainConfig) -> str:
    """``<policy>--audit-<env>-<tier>-s<seed>``, the policy named by its folder, run and iteration, or logged
    name: the same command finds the same audit again (and resumes it)."""
    if policy is None:
        label = Path(cfg.model.path).name if cfg.model.path else "tiny"
    elif is_checkpoint(policy):
        path = Path(policy).expanduser()
        label = f"{path.parent.parent.name}-iter{checkpoint_ref(path).iteration}"
    elif policy.startswith(MODEL_URI_PREFIXES):
        label = policy.partition(":/")[2].strip("/").replace("/", "-")
    else:
        label = Path(policy).name
    return f"{label}--audit-{cfg.env.name}-{cfg.env.tier}-s{cfg.seed}"
