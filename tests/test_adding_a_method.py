"""docs/adding-a-method.md, followed: the files it names are the ones GiGPO touches, and a toy estimator
added through its steps 1 to 3 (in copies of the registry and the presets, restored after each test) is
accepted by the config and runs through the advantage stage of a run and of ``horizonrl recompute`` over
real stored rollouts."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from horizonrl import store
from horizonrl.config import TrainConfig
from horizonrl.rollout.loop import SamplingSettings, collect
from methods.presets import METHODS, MethodPreset
from methods.registry import ADVANTAGES
from methods.types import AdvantageResult, StepBatch
from tasks.advantage import compute_advantages, recompute_iteration
from tasks.collect import RolloutRef

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "docs" / "adding-a-method.md"
BASELINE = 0.5  # the toy estimator's


def test_the_recipe_names_the_files_gigpo_touches():
    text = RECIPE.read_text()
    paths = set(re.findall(r"`((?:methods|horizonrl|flows|docs|tests)/[\w/]+\.(?:py|md))`", text))
    assert {"methods/gigpo.py", "methods/__init__.py", "methods/presets.py", "docs/algorithms.md"} <= paths
    assert [p for p in sorted(paths) if not (ROOT / p).is_file()] == []
    # steps 1-4 done for GiGPO: registered, imported by the package, a preset, a section of the specification
    assert "gigpo" in ADVANTAGES and METHODS["gigpo"].advantage == "gigpo"
    assert re.search(r"^from methods import .*\bgigpo\b", (ROOT / "methods" / "__init__.py").read_text(), re.M)
    assert "### 4.3 GiGPO" in (ROOT / "docs" / "algorithms.md").read_text()


@dataclass(frozen=True)
class ToyParams:
    """Step 1's params: defaults, checked on construction."""

    scale: float = 1.0

    def __post_init__(self) -> None:
        if self.scale <= 0:
            raise ValueError(f"ToyParams.scale must be positive, got {self.scale}")


def toy_advantage(batch: StepBatch, params: ToyParams, state: object | None = None) -> AdvantageResult:
    """Step 1's estimator: every row's advantage is its episode's return against a fixed baseline, scaled
    (REINFORCE with a constant baseline; the baseline keeps every expected advantage away from 0)."""
    return AdvantageResult(
        adv=params.scale * (batch.episode_return - BASELINE),
        keep=np.ones(len(batch), dtype=bool),
        stats={"rows_seen": float(len(batch))},
    )


@pytest.fixture()
def toy_method(monkeypatch) -> str:
    """Steps 1 to 3 for ``toy``: registered (step 2's import is this module's own) and given a preset."""
    monkeypatch.setattr(ADVANTAGES, "_entries", dict(ADVANTAGES._entries))
    ADVANTAGES.register("toy", ToyParams)(toy_advantage)
    preset = MethodPreset(
        title="Toy", advantage="toy", loss="ppo_clip", loss_params={"eps": 0.1}, min_group_size=1, epochs=1
    )
    monkeypatch.setitem(METHODS, "toy", preset)
    return "toy"


def test_a_method_added_by_the_recipe_runs_through_the_advantage_stage(
    toy_method, tiny_policy, household_suite, tmp_path
):
    cfg = TrainConfig(method=toy_method, advantage_params={"scale": 2.0})
    name, params = cfg.advantage_spec()
    assert (name, params) == ("toy", ToyParams(2.0)) and cfg.loss_spec()[0] == "ppo_clip"
    with pytest.raises(ValueError, match="bogus"):
        TrainConfig(method=toy_method, advantage_params={"bogus": 1.0})

    _, _, fmt, engine = tiny_policy
    settings = SamplingSettings("admissible", "window", 2, 3, 8, 1.0, 0)
    records = collect(household_suite, household_suite.tasks("train", "easy", 2), 2, engine, fmt, settings)
    d = tmp_path / "iter=00001"
    d.mkdir()
    store.write_table(store.turns_table(records), d / "turns.parquet", "turns")
    store.write_table(store.episodes_table(records, "toy", 1, 0), d / "episodes.parquet", "episodes")
    returns = {(r.rollout_id, t.turn): r.episode_return for r in records for t in r.turns}

    # a run's advantage stage: the config's estimator over the stored iteration
    ref = RolloutRef(1, str(d / "episodes.parquet"), str(d / "turns.parquet"))
    table, state, stats = compute_advantages(ref, name, params, None, 0)
    rows = table.to_pylist()
    assert {(r["rollout_id"], r["turn"]): r["adv"] for r in rows} == {
        k: 2.0 * (v - BASELINE) for k, v in returns.items()
    }
    assert all(r["keep"] for r in rows) and state is None and stats["rows_seen"] == len(returns)

    # horizonrl recompute: the method's name, through its preset, with its own params
    path, _, _ = recompute_iteration.fn(str(d), toy_method, {"scale": 3.0}, None)
    assert Path(path) == d / "advantages-toy.parquet"
    recomputed = store.read_table(path, "advantages").to_pylist()
    assert {(r["rollout_id"], r["turn"]): r["adv"] for r in recomputed} == {
        k: 3.0 * (v - BASELINE) for k, v in returns.items()
    }
