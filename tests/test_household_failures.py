"""scripts/household_failures.py: the figures of one episode (the script is not a package: loaded from its file)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "household_failures.py"


def _script():
    spec = importlib.util.spec_from_file_location("household_failures", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_household_failure_figures_of_one_episode():
    """Wrong objects are those of another type than the goal's target; an action repeats from its second time."""
    module = _script()
    target = "bowl"  # the target of "look at bowl under the desklamp"
    actions = ["go to desk 1", "take pen 1 from desk 1", "go to desk 1", "take bowl 2 from shelf 1", "go to desk 1"]
    assert module.episode_figures(actions, target) == {
        "takes": 2,
        "wrong_take": True,
        "first_take_wrong": True,
        "repeat_share": 2 / 5,
    }
    assert module.episode_figures(["take bowl 1 from desk 1", "use desklamp 1"], target) == {
        "takes": 1,
        "wrong_take": False,
        "first_take_wrong": False,
        "repeat_share": 0.0,
    }
