"""Name -> function registries, so that a config or a sweep picks an estimator or a loss by string.

Every advantage estimator has the signature::

    fn(batch: StepBatch, params: P, state: object | None) -> AdvantageResult

where ``P`` is the estimator's own frozen params dataclass (registered with it). A stateful estimator
(BLPO) also registers ``load_state(json_dict, params)``; its state has ``to_json_dict()``. Every policy loss has::

    fn(logp, old_logp, adv, mask, turn_id, params: P, *, ref_logp=None, n_rows_div=None, n_tokens_div=None,
       positions=None) -> LossTerms

over padded (B, T) tensors (see ``methods/losses.py``); ``positions`` are the tokens' response positions
(observation tokens between turns counted), for losses that discount over distance (APPO). Its params
satisfy ``LossParams``, the part of them the trainer reads. A second registration under a taken name
raises, and so does a params class that lacks an attribute its registry requires.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class Entry:
    name: str
    fn: Callable[..., Any]
    params_cls: type
    load_state: Callable[[dict, Any], Any] | None = None  # stateful estimators: (json dict, params) -> state


class LossParams(Protocol):
    """What the trainer reads from every policy loss's params (the loss reads the rest)."""

    @property
    def kl_coef(self) -> float:
        """Weight of the KL term to the reference policy: > 0 makes the trainer load that policy."""

    @property
    def ratio_level(self) -> str:
        """One importance ratio, and one loss term, per "token", "turn" or "trajectory"."""


class Registry:
    """A named table of functions with their params dataclass; refuses duplicates and params classes
    whose defaults lack one of the ``requires`` attributes."""

    def __init__(self, kind: str, requires: tuple[str, ...] = ()) -> None:
        self.kind = kind
        self.requires = requires
        self._entries: dict[str, Entry] = {}

    def register(
        self, name: str, params_cls: type, load_state: Callable[[dict, Any], Any] | None = None
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            missing = [a for a in self.requires if not hasattr(params_cls(), a)]
            if missing:
                raise TypeError(f"{self.kind} {name!r}: {params_cls.__name__} has no {', '.join(missing)}")
            self._entries[name] = Entry(name, fn, params_cls, load_state)
            return fn

        return decorator

    def get(self, name: str) -> Entry:
        if name not in self._entries:
            known = ", ".join(sorted(self._entries))
            raise KeyError(f"unknown {self.kind} {name!r}; known: {known}")
        return self._entries[name]

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries


ADVANTAGES = Registry("advantage estimator")
LOSSES = Registry("policy loss", requires=("kl_coef", "ratio_level"))  # LossParams
