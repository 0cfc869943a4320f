"""A sweep file: a grid of train configs (methods x seeds x any overrides), every cell's config validated
before any work starts.

A sweep file (``configs/sweeps/``)::

    name: ablation              # parent run name; cell runs are <name>--method=loop--seed=0
    base: ../loop_household_easy.yaml   # train config, relative to the sweep file
    set: [iterations=20]        # overrides for every cell (``--set`` syntax)
    grid: {method: [loop, grpo], seed: [0, 1, 2], loss_params.eps: [0.1, 0.2]}
    deployment: train/train     # fan out to this deployment; omit to run cells in process
    concurrency: 2              # cells in flight at once when fanned out
    register_best: horizonrl-household   # registered model name for the best cell's policy (optional)
    baselines: baselines-household       # MLflow experiment of `horizonrl evaluate --model` runs (optional)
    record: ../../docs/study-x  # a study's committed record (`horizonrl study`): its finished cells never rerun
"""

from __future__ import annotations

import itertools
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from horizonrl.config.loader import load_config
from horizonrl.config.problems import FieldProblem, validation_lines, yaml_line
from horizonrl.config.schema import TrainConfig


class SweepConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    """Parent run name and prefix of the cells' run names."""
    base: str
    """Train config the cells start from, relative to the sweep file."""
    set: list[str] = []
    """Overrides applied to every cell, ``key.sub=value``."""
    grid: dict[str, list[Any]] | list[dict[str, list[Any]]]
    """Dotted config key -> values; the cells are the product of all lists. A list of such grids is the
    union of their products (e.g. every method, plus one method's ablations)."""
    deployment: str | None = None
    """``flow/deployment`` of ``train`` to fan cells out to; None runs them here, one after another."""
    concurrency: int = Field(1, ge=1)
    """Fanned-out cells in flight at once."""
    register_best: str | None = None
    """Register the best cell's policy under this model name (MLflow model registry)."""
    tuning: str | None = None
    """What was tuned before the sweep, and on which methods: printed on the results page, since a
    comparison is only as fair as the tuning behind it."""
    baselines: str | None = None
    """MLflow experiment (same store) of the prompted baselines: its finished ``horizonrl evaluate --model
    ... --config ...`` runs are listed on the results page beside the trained cells."""

    record: str | None = None
    """A study's committed record folder (``horizonrl study --record``), relative to the sweep file. A cell it
    shows finished is not run again even where the MLflow store and the data folder are gone (a new machine
    has the repository, not the store), and ``horizonrl study`` refreshes it there by default."""

    def record_folder(self, sweep_file: str | Path) -> Path | None:
        """The record's folder, ``record`` read from the sweep file's folder; None without one."""
        return None if self.record is None else Path(os.path.normpath(Path(sweep_file).parent / self.record))

    @field_validator("grid")
    @classmethod
    def _non_empty(
        cls, grid: dict[str, list[Any]] | list[dict[str, list[Any]]]
    ) -> dict[str, list[Any]] | list[dict[str, list[Any]]]:
        for g in grid if isinstance(grid, list) else [grid]:
            if not g:
                raise ValueError("is empty: give at least one key with a list of values, e.g. method: [loop, grpo]")
            for key, values in g.items():
                if not values:
                    raise FieldProblem(f"grid.{key}", "has no values", values)
        return grid

    def grids(self) -> list[dict[str, list[Any]]]:
        return self.grid if isinstance(self.grid, list) else [self.grid]


@dataclass(frozen=True)
class Cell:
    coords: dict[str, Any]
    config: TrainConfig

    @property
    def run_name(self) -> str:
        return self.config.run_name


def load_sweep(path: str | Path, instance: str | None = None) -> tuple[SweepConfig, list[Cell]]:
    """Read and validate a sweep file and every cell's config before any work starts; errors name the
    file and the field (``grid``, ``grid.method``, or the cell and its config field). An ``instance``
    (a scheduled firing) names the sweep and its cells ``<name>--<instance>...``."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"sweep file {str(p)!r} does not exist")
    try:
        spec = SweepConfig.model_validate(yaml.safe_load(p.read_text()) or {})
    except yaml.YAMLError as err:
        raise ValueError(yaml_line(f"sweep file {str(p)!r}", err).removeprefix("config: ")) from err
    except ValidationError as err:
        lines = [text.removeprefix("config: ") for text in validation_lines(err, SweepConfig)]
        raise ValueError(f"sweep file {str(p)!r}: {'; '.join(lines)}") from err
    if instance is not None and not re.fullmatch(r"[A-Za-z0-9_.-]+", instance):
        raise ValueError(f"sweep instance {instance!r}: use letters, digits, '_', '.' and '-' only")
    prefix = instance_name(spec.name, instance)
    cells = []
    for coords in (dict(zip(g, values)) for g in spec.grids() for values in itertools.product(*g.values())):
        name = "--".join([prefix, *(f"{k}={v}" for k, v in coords.items())])
        sets = [*spec.set, *(f"{k}={json.dumps(v)}" for k, v in coords.items()), f"run_name={json.dumps(name)}"]
        try:
            cells.append(Cell(coords, load_config(p.parent / spec.base, sets)))
        except ValueError as err:
            raise ValueError(f"sweep file {str(p)!r}, grid cell {coords}: {'; '.join(str(err).splitlines())}") from err
    duplicates = sorted({c.run_name for c in cells if sum(d.run_name == c.run_name for d in cells) > 1})
    if duplicates:
        raise ValueError(f"sweep file {str(p)!r}: the grids repeat cells {duplicates}")
    for field in ("experiment", "tracking_uri"):
        if len({getattr(c.config, field) for c in cells}) > 1:
            raise ValueError(
                f"sweep file {str(p)!r}: grid varies {field!r}; a sweep's runs share one experiment and store"
            )
    return spec, cells


def instance_name(sweep_name: str, instance: str | None) -> str:
    """The parent run's name: the sweep's, or ``<sweep>--<instance>`` for an instance."""
    return sweep_name if instance is None else f"{sweep_name}--{instance}"
