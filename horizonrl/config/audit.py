"""The credit audit's own settings (``horizonrl audit``, docs/algorithms.md §8): how many points, continuations
and groups, and how its figures are computed. The policy plays as its train config says (``TrainConfig``:
group size, prompt, action mode, context, engine, seed); these are what the audit adds."""

from __future__ import annotations

from pydantic import ConfigDict, Field

from horizonrl.config.schema import Strict


class AuditConfig(Strict):
    model_config = ConfigDict(use_attribute_docstrings=True)  # each field's docstring is its --flag's help

    tasks: int = Field(32, ge=1)
    """Tasks of the split played, one group of ``rollout.group_size`` episodes each: the groups every estimator
    scores, and the episodes the decision points are drawn from."""
    split: str = "train"
    """Where the tasks come from: the split training collects from (``train``), or another."""
    points: int = Field(150, ge=2)
    """Decision points drawn (fewer if the groups hold fewer decisions)."""
    continuations: int = Field(8, ge=2)
    """M: continuations per point and arm (a_t fixed; a fresh action). The two halves of the noise ceiling
    take every other one of each arm."""
    anchor_share: float = Field(0.3, ge=0, le=1)
    """Share of the points drawn at anchor states (one observation several episodes of a group reached and
    left by different actions), for the ordering test; the rest are stratified over task family, phase (early,
    middle, late) and outcome (won or not)."""
    block_points: int = Field(8, ge=1)
    """Points whose 2M continuations play as one engine batch and are stored together (what a resumed audit
    does not play again). It bounds memory: the transformers engine holds a KV cache per continuation. The
    continuations' sampling seeds depend on it: keep it fixed within a comparison."""
    bootstrap: int = Field(2000, ge=100)
    """Bootstrap resamples of the 95% intervals."""
    sign_z: float = Field(2.0, gt=0)
    """Sign agreement counts the points whose |A_MC| exceeds this many standard errors."""
