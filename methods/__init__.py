"""Pure math of the methods: advantage estimators and policy losses behind name registries.

Importing the package registers every estimator and loss. No I/O, Prefect, MLflow or environment code.
"""

from __future__ import annotations

from typing import Any

from methods import advantages, appo, blpo, gigpo, losses  # noqa: F401  (registration side effects)
from methods.registry import ADVANTAGES, LOSSES
from methods.types import AdvantageResult, StepBatch


def state_to_json(state: Any) -> dict | None:
    """A stateful estimator's state (e.g. BLPO memory) as a JSON-serialisable dict; None stays None."""
    return None if state is None else state.to_json_dict()


def state_from_json(name: str, data: dict | None, params: Any) -> Any:
    """Inverse of ``state_to_json`` for estimator ``name`` with ``params``; None (no state yet) stays None."""
    if data is None:
        return None
    load_state = ADVANTAGES.get(name).load_state
    if load_state is None:
        raise ValueError(f"advantage estimator {name!r} keeps no state, but a state was given")
    return load_state(data, params)


__all__ = ["ADVANTAGES", "LOSSES", "AdvantageResult", "StepBatch", "state_from_json", "state_to_json"]
