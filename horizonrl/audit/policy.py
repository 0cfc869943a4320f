"""What a credit audit audits: a policy, and where the batches that trained it are stored.

BLPO's memory is global: it carries what earlier batches taught it into every later advantage. The audit
scores it twice (docs/algorithms.md §8.1): cold (an empty memory) and warm, its memory rebuilt from the
batches the policy's own training run stored up to that checkpoint, as the run would have held it had it
trained with BLPO. Only a training run's checkpoint has such batches; a model with no run behind it (a
pretrained model, a model folder, a warm start's policy) is audited cold only.
"""

from __future__ import annotations

import json
from pathlib import Path

from mlflow.exceptions import MlflowException

from horizonrl.store import iteration_dir
from horizonrl.training.checkpoint import STATE_FILE, CheckpointRef
from mlflow import MlflowClient


def is_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a run's checkpoint folder (it holds the state a run writes with each one)."""
    return (Path(path).expanduser() / STATE_FILE).is_file()


def checkpoint_ref(path: str | Path) -> CheckpointRef:
    """The checkpoint in folder ``path``, with the iteration its state records."""
    state = json.loads((Path(path).expanduser() / STATE_FILE).read_text())
    return CheckpointRef(str(Path(path).expanduser()), int(state["iteration"]))


def training_run(ref: CheckpointRef, c: MlflowClient | None) -> Path | None:
    """The run folder whose stored batches trained ``ref``: the folder above ``checkpoints/`` for a run's own
    checkpoint, else (a policy downloaded from MLflow) the folder of the run its state names, looked up in
    ``c``; None where neither holds an iteration's rollouts."""
    path = Path(ref.path)
    if path.parent.name == "checkpoints":
        folder = path.parent.parent
    else:
        run_id = json.loads((path / STATE_FILE).read_text()).get("mlflow_run_id") if is_checkpoint(path) else None
        if c is None or not run_id:
            return None
        try:
            params = c.get_run(run_id).data.params
        except MlflowException:  # the run that wrote it is in another store
            return None
        if not {"data_dir", "experiment", "run_name"} <= params.keys():
            return None
        folder = Path(params["data_dir"]) / params["experiment"] / params["run_name"]
    return folder if stored_batches(folder, ref.iteration) else None


def stored_batches(run_dir: str | Path, iteration: int) -> list[Path]:
    """The iteration folders of ``run_dir`` whose rollouts went into checkpoint ``iteration``, 1 to ``iteration`` in
    order; none unless every one holds its episodes and turns (a memory rebuilt from some of them would be another
    run's)."""
    run = Path(run_dir)
    folders = [iteration_dir(run.parent.parent, run.parent.name, run.name, i) for i in range(1, iteration + 1)]
    whole = all((d / "episodes.parquet").is_file() and (d / "turns.parquet").is_file() for d in folders)
    return folders if whole else []
