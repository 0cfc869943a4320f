"""Config: every shipped YAML validates, for every method; every bad input is a ValueError naming the
field or file; ``--set`` overrides are parsed as YAML and coerced to the field's type; method presets
and ``per_method`` sections say what the pipeline does for a method."""

from __future__ import annotations

import re
from pathlib import Path

import pydantic
import pytest
import yaml

from horizonrl.config import TrainConfig, load_config, train_config
from horizonrl.config.sweep import load_sweep
from horizonrl.training.trainer import UpdateSettings
from methods.appo import BranchingParams
from methods.presets import METHODS, estimator_of

CONFIG_DIR = Path(__file__).parents[1] / "configs"
CONFIGS = sorted(
    p for p in CONFIG_DIR.rglob("*.y*ml") if "sweeps" not in p.relative_to(CONFIG_DIR).parts
)  # train configs we ship (sweep files: test_sweep.py)


def test_configs_folder_is_found():
    assert CONFIG_DIR / "loop_household_easy.yaml" in CONFIGS


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.relative_to(CONFIG_DIR).as_posix())
def test_every_shipped_yaml_validates_and_sets_only_what_it_says(path):
    cfg = load_config(path)
    raw = yaml.safe_load(path.read_text())
    dumped = cfg.model_dump()
    for section, value in raw.items():  # each value in the file reaches the config unchanged
        assert _within({section: value}, dumped), section
    cfg.advantage_spec(), cfg.loss_spec()  # the method's params dataclasses accept the merged values


def _within(given: dict, dumped: dict) -> bool:
    """``given`` (from a file) is ``dumped`` (the validated config) up to the sections' unset defaults;
    the free-form params dictionaries must match exactly."""
    return all(
        k in dumped and (v == dumped[k] if k.endswith("_params") or not isinstance(v, dict) else _within(v, dumped[k]))
        for k, v in given.items()
    )


@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.relative_to(CONFIG_DIR).as_posix())
def test_every_method_validates_on_every_shipped_config(path, method):
    """One base config serves a sweep over every method: its LOOP tuning sits in ``per_method.loop``."""
    cfg = load_config(path, [f"method={method}"])
    tuned = yaml.safe_load(path.read_text()).get("per_method", {}).get("loop", {}).get("loss_params", {})
    name, params = cfg.loss_spec()
    preset = METHODS[method]
    assert name == preset.loss and all(
        getattr(params, k) == v for k, v in preset.loss_params.items() if method != "loop" or k != "eps"
    )
    assert cfg.advantage_spec()[0] == preset.advantage
    assert (cfg.branching() is not None) == preset.branches
    if method == "loop":  # the file's LOOP tuning (0.2 where it has one) over the preset's 0.1
        assert params.eps == tuned.get("eps", preset.loss_params["eps"])


def test_main_config_values_and_derived_values():
    cfg = load_config(CONFIG_DIR / "loop_household_easy.yaml")
    assert (
        cfg.method,
        cfg.rollout.tasks_per_iteration,
        cfg.rollout.group_size,
        cfg.update.minibatch_size,
        cfg.update.lr,
    ) == ("loop", 32, 8, 64, 2e-3)
    assert (cfg.iterations, cfg.time_budget_s) == (70, None)  # bounded by iterations, not the machine's speed
    name, params = cfg.loss_spec()
    assert name == "ppo_clip" and (params.clip_mode, params.eps) == ("loop", 0.2)  # file overrides the preset's 0.1
    assert cfg.epochs == 4  # the file overrides LOOP's preset of 2
    assert load_config(None, ["method=grpo"]).epochs == 1  # the preset, when update.epochs is not set


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "override,names",
    [
        ("method=ppo9", ["config: method is not a method; known: appo, blpo,", "(got 'ppo9' from --set)"]),
        (
            "rollout.group_size=1",
            ["config: rollout.group_size is too small: method 'loop' needs at least 2 rollouts per task (got 1 from"],
        ),
        ("update.lr=-3e-4", ["config: update.lr must be greater than 0 (got -0.0003 from --set)"]),
        ("update.lr=0", ["config: update.lr must be greater than 0 (got 0 from --set)"]),
        ("colour=blue", ["config: colour is not a field of the config; fields there: advantage_params,", "'blue'"]),
        ("rollout.beam=4", ["config: rollout.beam is not a field of rollout; fields there: action_mode,"]),
        ("rollout.grup_size=4", ["config: rollout.grup_size is not a field of rollout; did you mean 'group_size'?"]),
        ("rollout.group_size=many", ["config: rollout.group_size is not an integer", "(got 'many' from --set)"]),
        ("rollout.group_size=[4]", ["config: rollout.group_size is not an integer", "(got [4] from --set)"]),
        ("rollout=3", ["config: rollout must be a section (a mapping of its fields) (got 3 from --set)"]),
        ("rollout.context=sliding", ["config: rollout.context must be 'window' or 'full' (got 'sliding' from --set)"]),
        ("advantage_params.temperature=2", ["config: advantage_params.temperature is not a field of LOOParams"]),
        ("loss_params.clipping=0.3", ["config: loss_params.clipping is not a field of PPOLossParams"]),
        ("loss_params.aggregation=sum", ["config: loss_params is refused by PPOLossParams", "aggregation", "'sum'"]),
        ("env.name=minecraft", ["config: env.name is not an environment; known: alfworld,", "(got 'minecraft' from"]),
        (
            "per_method.appo.loss_params.eps=0.2",
            ["config: per_method.appo.loss_params.eps is not a field of FutureKLParams"],
        ),
    ],
)
def test_bad_values_name_the_field(override, names):
    """Each problem is one line, ``config: <field> <problem> (got <value> from ...)``: no pydantic URL, no
    dump of the input."""
    with pytest.raises(ValueError) as err:
        load_config(None, [override])
    assert len(str(err.value).splitlines()) == 1 and "pydantic" not in str(err.value), err.value
    for name in names:
        assert name in str(err.value)


def test_every_field_problem_is_its_own_line_naming_the_file_line(tmp_path):
    """Several bad fields of one file: one line each (in the config's order of fields), each with its file
    and line or its ``--set``; a YAML syntax error (a tab) is one line with the file, line and column, and no
    ``^`` marker."""
    path = _write(tmp_path, "iterations: 0\nupdate:\n  lr: -1\n  lrr: 3\n")
    with pytest.raises(ValueError) as err:
        load_config(path, ["seed=true"])
    assert str(err.value).splitlines() == [
        "config: seed is not an integer: write integers without quotes or decimal point (true/false are not "
        "integers) (got True from --set)",
        f"config: iterations must be greater than or equal to 1 (got 0 in {path} line 1)",
        f"config: update.lr must be greater than 0 (got -1 in {path} line 3)",
        f"config: update.lrr is not a field of update; did you mean 'lr'? (got 3 in {path} line 4)",
    ]
    tabbed = _write(tmp_path, "rollout:\n\tgroup_size: 4\n")
    with pytest.raises(ValueError) as err:
        load_config(tabbed)
    assert str(err.value) == (
        f"config: file '{tabbed}' line 2, column 1: found character '\\t' that cannot start any token (while "
        "scanning for the next token)"
    )


def test_group_size_one_is_fine_for_a_method_that_needs_one():
    assert load_config(None, ["method=blpo", "rollout.group_size=1"]).rollout.group_size == 1


@pytest.mark.parametrize("name", ["household", "scienceworld-boil", "alfworld"])
def test_games_folder_is_only_for_textworld_suites(tmp_path, name):
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"env.games is only for the TextWorld suites (textworld-coin, textworld-treasure, "
            f"textworld-cooking); env.name = {name!r}"
        ),
    ):
        load_config(None, [f"env.name={name}", f"env.games={tmp_path}"])


def test_games_folder_is_checked_at_load_naming_it(tmp_path):
    """Before any work: a missing folder, an empty one, a pattern matching nothing (no TextWorld needed)."""
    missing, empty = tmp_path / "missing", tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=re.escape(f"env.games = {str(missing)!r}: no such folder")):
        load_config(None, ["env.name=textworld-cooking", f"env.games={missing}"])
    with pytest.raises(
        ValueError, match=re.escape(f"env.games = {str(empty)!r}: the folder {empty} holds no game file")
    ):
        load_config(None, ["env.name=textworld-coin", f"env.games={empty}"])
    with pytest.raises(
        ValueError, match=re.escape(f"env.games = {str(empty / '**/*.z8')!r}: the pattern matches no game file")
    ):
        load_config(None, ["env.name=textworld-coin", f"env.games={empty / '**/*.z8'}"])
    assert load_config(None, ["env.name=textworld-coin"]).env.games is None  # unset: challenge games, as before


def test_model_path_must_exist_unless_it_is_a_hub_id(tmp_path):
    missing = tmp_path / "no-model"
    with pytest.raises(ValueError, match=re.escape("model.path") + r"[\s\S]*" + re.escape(repr(str(missing)))):
        load_config(None, [f"model.path={missing}"])
    with pytest.raises(ValueError, match="model.path"):
        load_config(None, ["model.path=not-a-dir"])  # no slash: a local name, not 'org/name'
    with pytest.raises(ValueError, match=re.escape(repr(str(tmp_path / "config.json")))):
        load_config(None, [f"model.path={tmp_path}"])  # a folder, but not a transformers model's
    (tmp_path / "config.json").write_text("{}")
    assert load_config(None, [f"model.path={tmp_path}"]).model.path == str(tmp_path)
    assert load_config(None, ["model.path=Qwen/Qwen2.5-0.5B-Instruct"]).model.path == "Qwen/Qwen2.5-0.5B-Instruct"


def test_bad_files_name_the_file(tmp_path):
    missing = tmp_path / "absent.yaml"
    with pytest.raises(ValueError, match=re.escape(f"config: file {str(missing)!r} does not exist")):
        load_config(missing)
    malformed = _write(tmp_path, "method: loop\nrollout: [group_size: 8\n")
    with pytest.raises(ValueError, match=re.escape(f"config: file {str(malformed)!r} line 3, column 1: expected")):
        load_config(malformed)
    listing = _write(tmp_path, "- method\n- loop\n")
    with pytest.raises(ValueError, match=re.escape(f"config: file {str(listing)!r} must hold a mapping")):
        load_config(listing)


def test_bad_field_in_a_file_names_the_field(tmp_path):
    with pytest.raises(ValueError, match=r"^config: update\.lr must be greater than 0 \(got -0\.1 in .* line 2\)$"):
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
    cfg = load_config(
        base,
        [
            "update.lr=3e-4",
            "rollout.group_size=4",
            "eval.greedy=false",
            "rollout.context=full",
            "time_budget_s=90",
            "loss_params.eps=2e-1",
            "advantage_params.kl_lambda=1e-2",
            "update.epochs=null",
        ],
    )
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


def test_per_method_sections_apply_only_to_their_method_and_top_level_wins(tmp_path):
    base = _write(
        tmp_path,
        "per_method:\n  loop:\n    loss_params: {eps: 0.3}\n    advantage_params: {normalize_std: true}\n"
        "  appo:\n    loss_params: {weight_b: 0.5}\n    branching_params: {gamma: 0.9}\n",
    )
    loop = load_config(base)
    assert (
        loop.loss_spec()[1].eps == 0.3 and loop.advantage_spec()[1].normalize_std is True and loop.branching() is None
    )
    appo = load_config(base, ["method=appo"])
    assert appo.loss_spec()[1].weight_b == 0.5 and appo.branching() == BranchingParams(gamma=0.9)
    assert appo.loss_spec()[1].kl_coef == 0.001  # the preset's value under the section's
    grpo = load_config(base, ["method=grpo"])
    assert (
        grpo.loss_spec()[1] == load_config(None, ["method=grpo"]).loss_spec()[1]
    )  # LOOP's and APPO's sections do not reach it
    assert (
        load_config(base, ["loss_params.eps=0.25"]).loss_spec()[1].eps == 0.25
    )  # top level (a grid key, --set) over the section


@pytest.mark.parametrize(
    "text,names",
    [
        (
            "per_method:\n  appo:\n    loss_params: {eps: 0.2}\n",
            ["per_method.appo.loss_params.eps is not a field of FutureKLParams"],
        ),
        ("per_method:\n  ppo9:\n    loss_params: {eps: 0.2}\n", ["per_method.ppo9 is not a method; known: appo,"]),
        (
            "per_method:\n  loop:\n    branching_params: {gamma: 0.9}\n",
            ["per_method.loop.branching_params is for a method that branches; 'loop' does not"],
        ),
        (
            "per_method:\n  loop:\n    clip: 0.2\n",
            ["config: per_method.loop.clip is not a field of per_method.loop; fields there: advantage_params,"],
        ),
        ("branching_params: {gamma: 0.9}\n", ["branching_params is for a method that branches; 'loop' does not"]),
        ("method: appo\nbranching_params: {gama: 0.9}\n", ["branching_params.gama is not a field of BranchingParams"]),
        (
            "method: appo\nbranching_params: {omega_fallback: sometimes}\n",
            ["branching_params", "unknown omega_fallback 'sometimes'"],
        ),
    ],
)
def test_bad_method_params_name_the_section_and_field(tmp_path, text, names):
    """Every ``per_method`` section is checked whichever method runs, so a typo fails every cell of a sweep."""
    with pytest.raises(ValueError) as err:
        load_config(_write(tmp_path, text))
    for name in names:
        assert name in str(err.value)


def test_appo_branching_params_come_from_the_config_file(tmp_path):
    cfg = load_config(_write(tmp_path, "method: appo\nbranching_params:\n  gamma: 0.95\n  omega_fallback: none\n"))
    assert cfg.branching() == BranchingParams(gamma=0.95, omega_fallback="none")
    assert load_config(None, ["method=appo"]).branching() == BranchingParams()  # the paper's defaults


def test_presets_say_what_the_update_needs():
    """Reference model, row divisor and ratio level come from the preset's loss settings, never the name."""
    pad = 0
    loop = UpdateSettings.from_config(load_config(None, ["method=loop"]), pad, sampled_here=True)
    assert (loop.needs_reference, loop.fixed_row_divisor, loop.loss_params.ratio_level, loop.epochs) == (
        False,
        True,
        "token",
        2,
    )
    appo = UpdateSettings.from_config(load_config(None, ["method=appo"]), pad, sampled_here=True)
    assert (appo.needs_reference, appo.fixed_row_divisor, appo.loss_params.ratio_level) == (True, False, "token")
    assert UpdateSettings.from_config(load_config(None, ["method=grpo"]), pad, sampled_here=True).needs_reference
    assert not UpdateSettings.from_config(
        load_config(None, ["method=grpo", "loss_params.kl_coef=0"]), pad, sampled_here=True
    ).needs_reference
    rpp = UpdateSettings.from_config(load_config(None, ["method=reinforce_pp_baseline"]), pad, sampled_here=True)
    assert (rpp.loss_name, rpp.loss_params.kl_kind, rpp.loss_params.kl_coef, rpp.loss_params.aggregation) == (
        "ppo_clip",
        "mse",
        0.001,
        "token-mean",
    )
    assert (
        estimator_of("reinforce_pp_baseline") == "reinforce_pp_baseline"
        and estimator_of("loop") == "loo"
        and estimator_of("loo") == "loo"
    )
    with pytest.raises(ValueError, match=r"'ppo9' is neither a method \(appo, .*\) nor an estimator"):
        estimator_of("ppo9")


def test_dr_grpo_length_constant_is_fixed_by_the_run_not_the_batch():
    """Dr.GRPO's L (docs/algorithms.md §0.3) is the most policy tokens a trajectory can hold, horizon x
    rollout.max_action_tokens, the same for every micro-batch and rank; the loss params may set it."""
    drgrpo = load_config(None, ["method=drgrpo", "rollout.max_action_tokens=12"])
    s = UpdateSettings.from_config(drgrpo, 0, sampled_here=True, horizon=8)
    assert (s.loss_params.aggregation, s.loss_params.norm_length) == ("seq-mean-token-sum-norm", 96)
    with pytest.raises(ValueError, match="fixed length L"):
        UpdateSettings.from_config(drgrpo, 0, sampled_here=True)
    given = load_config(None, ["method=drgrpo", "loss_params.norm_length=500"])
    assert UpdateSettings.from_config(given, 0, sampled_here=True, horizon=8).loss_params.norm_length == 500
    loop = UpdateSettings.from_config(load_config(None, ["method=loop"]), 0, sampled_here=True, horizon=8)
    assert loop.loss_params.norm_length is None  # the other aggregations have no length constant


def _sweep(tmp_path: Path, grid: dict) -> list:
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"name": "t", "base": str(CONFIG_DIR / "loop_household_easy.yaml"), "grid": grid}))
    return load_sweep(path)[1]


def test_loop_ablations_are_grid_keys_on_the_main_config(tmp_path):
    """LOOP's ablations (ratio per token / turn / trajectory; advantage with and without std
    normalisation) as a sweep grid over the base config, reaching the loss, the estimator and the update."""
    cells = _sweep(
        tmp_path,
        {"loss_params.ratio_level": ["token", "turn", "trajectory"], "advantage_params.normalize_std": [False, True]},
    )
    got = {(c.config.loss_spec()[1].ratio_level, c.config.advantage_spec()[1].normalize_std) for c in cells}
    assert got == {(r, n) for r in ("token", "turn", "trajectory") for n in (False, True)}
    assert {UpdateSettings.from_config(c.config, 0, sampled_here=True).loss_params.ratio_level for c in cells} == {
        "token",
        "turn",
        "trajectory",
    }
    assert all(c.config.loss_spec()[1].eps == 0.2 for c in cells)  # the base's LOOP tuning stays


def test_one_base_config_sweeps_every_method(tmp_path):
    """A grid over every method on the main config, with a LOOP-only grid key under ``per_method``."""
    cells = _sweep(tmp_path, {"method": sorted(METHODS), "per_method.loop.loss_params.ratio_level": ["token", "turn"]})
    assert {c.config.method for c in cells} == set(METHODS) and len(cells) == 2 * len(METHODS)
    loop = {c.config.loss_spec()[1].ratio_level for c in cells if c.config.method == "loop"}
    assert loop == {"token", "turn"}


def test_validation_for_a_failure_hook_reads_no_game_file(tmp_path, monkeypatch):
    """The train flow's failure hook revalidates the flow's parameters to find the run: it must not load
    every game of ``env.games`` again (slow, and the file may be what failed the run)."""
    import horizonrl.envs

    opened = []
    monkeypatch.setattr(horizonrl.envs, "check_games", lambda *a: opened.append(a))
    raw = {"env": {"name": "textworld-coin", "games": str(tmp_path / "games"), "max_turns": 10}}
    assert train_config(None, None, raw, read_files=False).env.games == str(tmp_path / "games") and opened == []
    train_config(None, None, raw)
    assert len(opened) == 1, "the normal path checks the games before any work starts"


def test_the_default_vllm_interpreter_is_the_projects_from_any_folder(tmp_path, monkeypatch):
    """``engine.vllm.python`` relative (the default ``.venv-vllm/bin/python``) is taken from the project's
    folder, not the current directory: a command run from elsewhere starts the project's vLLM."""
    from horizonrl.config import VLLMConfig
    from horizonrl.config.schema import PROJECT_DIR

    monkeypatch.chdir(tmp_path)
    assert VLLMConfig().interpreter() == Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"
    assert PROJECT_DIR == Path(__file__).resolve().parents[1]
    assert VLLMConfig(python="/opt/vllm/bin/python").interpreter() == Path("/opt/vllm/bin/python")
