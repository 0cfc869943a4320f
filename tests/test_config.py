"""Config: every shipped YAML validates; every bad input is a ValueError naming the field or file;
``--set`` overrides are parsed as YAML and coerced to the field's type."""

from __future__ import annotations

import re
from pathlib import Path

import pydantic
import pytest
import yaml

from horizonrl.config import TrainConfig, load_config

CONFIG_DIR = Path(__file__).parents[1] / "configs"
CONFIGS = sorted(p for p in CONFIG_DIR.rglob("*.y*ml") if "sweeps" not in p.relative_to(CONFIG_DIR).parts)  # train configs we ship (sweep files: test_sweep.py)


def test_configs_folder_is_found():
    assert CONFIG_DIR / "loop_household_easy.yaml" in CONFIGS


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.relative_to(CONFIG_DIR).as_posix())
def test_every_shipped_yaml_validates_and_sets_only_what_it_says(path):
    cfg = load_config(path)
    raw = yaml.safe_load(path.read_text())
    dumped = cfg.model_dump()
    for section, value in raw.items():  # each value in the file reaches the config unchanged
        if isinstance(value, dict) and section not in ("advantage_params", "loss_params"):
            assert {k: dumped[section][k] for k in value} == value
        else:
            assert dumped[section] == value
    cfg.advantage_spec(), cfg.loss_spec()  # the method's params dataclasses accept the merged values


def test_main_config_values_and_derived_values():
    cfg = load_config(CONFIG_DIR / "loop_household_easy.yaml")
    assert (cfg.method, cfg.rollout.group_size, cfg.update.lr, cfg.time_budget_s) == ("loop", 8, 2e-3, 600.0)
    name, params = cfg.loss_spec()
    assert name == "ppo_clip" and (params.clip_mode, params.eps) == ("loop", 0.2)  # file overrides the preset's 0.1
    assert cfg.epochs == 4  # the file overrides LOOP's preset of 2
    assert load_config(None, ["method=grpo"]).epochs == 1  # the preset, when update.epochs is not set


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("override,names", [
    ("method=ppo9", ["method", "unknown method 'ppo9'"]),
    ("rollout.group_size=1", ["rollout.group_size = 1", "'loop' needs at least 2"]),
    ("update.lr=-3e-4", ["update.lr", "greater than 0"]),
    ("update.lr=0", ["update.lr", "greater than 0"]),
    ("colour=blue", ["colour", "Extra inputs are not permitted"]),
    ("rollout.beam=4", ["rollout.beam", "Extra inputs are not permitted"]),
    ("rollout.group_size=many", ["rollout.group_size", "valid integer"]),
    ("rollout.group_size=[4]", ["rollout.group_size", "valid integer"]),
    ("rollout=3", ["rollout", "valid dictionary"]),
    ("rollout.context=sliding", ["rollout.context", "'window' or 'full'"]),
    ("advantage_params.temperature=2", ["advantage_params.temperature is not a field of LOOParams"]),
    ("loss_params.clipping=0.3", ["loss_params.clipping is not a field of PPOLossParams"]),
    ("loss_params.aggregation=sum", ["loss_params", "PPOLossParams.aggregation is invalid: 'sum'"]),
    ("env.name=minecraft", ["env.name = 'minecraft' is unknown"]),
])
def test_bad_values_name_the_field(override, names):
    with pytest.raises(ValueError) as err:
        load_config(None, [override])
    for name in names:
        assert name in str(err.value)


def test_group_size_one_is_fine_for_a_method_that_needs_one():
    assert load_config(None, ["method=blpo", "rollout.group_size=1"]).rollout.group_size == 1


def test_model_path_must_exist_unless_it_is_a_hub_id(tmp_path):
    missing = tmp_path / "no-model"
    with pytest.raises(ValueError, match=re.escape("model.path") + r"[\s\S]*" + re.escape(repr(str(missing)))):
        load_config(None, [f"model.path={missing}"])
    with pytest.raises(ValueError, match="model.path"):
        load_config(None, ["model.path=not-a-dir"])  # no slash: a local name, not 'org/name'
    assert load_config(None, [f"model.path={tmp_path}"]).model.path == str(tmp_path)
    assert load_config(None, ["model.path=Qwen/Qwen2.5-0.5B-Instruct"]).model.path == "Qwen/Qwen2.5-0.5B-Instruct"


def test_bad_files_name_the_file(tmp_path):
    missing = tmp_path / "absent.yaml"
    with pytest.raises(ValueError, match=re.escape(f"config file {str(missing)!r} does not exist")):
        load_config(missing)
    malformed = _write(tmp_path, "method: loop\nrollout: [group_size: 8\n")
    with pytest.raises(ValueError, match=re.escape(f"config file {str(malformed)!r} is not valid YAML")):
        load_config(malformed)
    listing = _write(tmp_path, "- method\n- loop\n")
    with pytest.raises(ValueError, match=re.escape(f"config file {str(listing)!r} must hold a mapping")):
        load_config(listing)


def test_bad_field_in_a_file_names_the_field(tmp_path):
    with pytest.raises(ValueError, match=r"update\.lr\n"):
        load_config(_write(tmp_path, "update:\n  lr: -0.1\n"))
    with pytest.raises(ValueError, match=r"advantage_params\.bogus is not a field"):
        load_config(_write(tmp_path, "advantage_params:\n  bogus: 1\n"))


@pytest.mark.parametrize("item", ["update.lr", "update.lr 3e-4", "=3", "update..lr=1", ".lr=1", "update.lr=[1"])
def test_bad_set_syntax(item):
    with pytest.raises(ValueError, match=re.escape(f"--set {item!r}")):
        load_config(None, [item])


def test_set_into_a_value_that_is_not_a_section():
    with pytest.raises(ValueError, match=re.escape("--set update.lr: 'update' is not a section")):
        load_config(None, ["update=3", "update.lr=1"])


def test_set_values_are_coerced_to_the_field_types(tmp_path):
    base = _write(tmp_path, "seed: 1\nupdate:\n  lr: 0.01\n  minibatch_size: 8\nloss_params:\n  eps: 0.3\n")
    cfg = load_config(base, ["update.lr=3e-4", "rollout.group_size=4", "eval.greedy=false", "rollout.context=full",
                             "time_budget_s=90", "loss_params.eps=2e-1", "advantage_params.kl_lambda=1e-2", "update.epochs=null"])
    assert type(cfg.update.lr) is float and cfg.update.lr == 3e-4
    assert type(cfg.rollout.group_size) is int and cfg.rollout.group_size == 4
    assert cfg.eval.greedy is False and cfg.rollout.context == "full" and cfg.update.epochs is None
    assert type(cfg.time_budget_s) is float and cfg.time_budget_s == 90.0
    # untyped dicts keep YAML's value: '2e-1' must be the float 0.2 (YAML 1.2), not the string
    assert cfg.loss_params == {"eps": 0.2} and cfg.advantage_params == {"kl_lambda": 0.01}
    assert (cfg.seed, cfg.update.minibatch_size) == (1, 8)  # the file's other values stay
    assert cfg.loss_spec()[1].eps == 0.2 and cfg.advantage_spec()[1].kl_lambda == 0.01


def test_exponent_floats_in_a_file_are_floats(tmp_path):
    cfg = load_config(_write(tmp_path, "update:\n  lr: 3e-4\nloss_params:\n  eps: 1E-1\nrun_name: 'e5'\n"))
    assert cfg.update.lr == 3e-4 and cfg.loss_params == {"eps": 0.1} and cfg.run_name == "e5"


def test_saved_config_reloads_to_the_same_config(tmp_path):
    cfg = load_config(None, ["update.lr=3e-4", "loss_params.eps=1e-8", "rollout.context=full"])
    reloaded = load_config(_write(tmp_path, yaml.safe_dump(cfg.model_dump(), sort_keys=True)))
    assert reloaded == cfg and reloaded.digest() == cfg.digest()
    assert load_config(None, ["update.lr=1e-4"]).digest() != TrainConfig().digest()


def test_config_is_frozen():
    with pytest.raises(pydantic.ValidationError):
        TrainConfig().update.lr = 1.0
