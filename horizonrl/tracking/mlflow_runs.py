"""MLflow bookkeeping: one run per training run, found again by name on resume.

Prefect runs tasks in worker threads and MLflow's active run is per thread, so everything here takes an
explicit run id and uses ``MlflowClient``. Metric names are ``<stage>/<name>`` with the iteration as step.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import importlib
import json
import os
import shutil
import sqlite3
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd
from mlflow.entities import Dataset, DatasetInput, InputTag, LoggedModel, LoggedModelStatus, Metric, Param, Run, RunTag
from mlflow.exceptions import MlflowException

import mlflow
from horizonrl.files import folder_digest, machine_cache, remove_temporary
from horizonrl.models import lora
from mlflow import MlflowClient

if TYPE_CHECKING:
    from horizonrl.training.checkpoint import CheckpointRef

RUN_NAME_TAG = "horizonrl.run_name"
FAILURE_TAG = "horizonrl.failure"  # why a run was marked FAILED (or KILLED), in one line
DEFAULT_STORE = "mlflow"


def tracking_uri(configured: str | None = None, create: bool = True) -> str:
    """Config value, else $MLFLOW_TRACKING_URI, else SQLite under ./mlflow (its folder created on first use,
    unless ``create`` is False: a check that must leave nothing behind)."""
    uri = configured or os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    if create:
        Path(DEFAULT_STORE).mkdir(exist_ok=True)
    return f"sqlite:///{DEFAULT_STORE}/mlflow.db"


def store_exists(uri: str) -> bool:
    """False for a SQLite store whose file is not there yet (it holds nothing, and opening it would create
    it); True for any other store (a server's is asked when used)."""
    return not uri.startswith("sqlite:///") or Path(uri.removeprefix("sqlite:///")).is_file()


def client(uri: str) -> MlflowClient:
    _create_sqlite_store_once(uri)
    return MlflowClient(tracking_uri=uri)


@functools.cache
def _create_sqlite_store_once(uri: str) -> None:
    """Open a SQLite store first under a file lock: MLflow creates its tables on first use, and two runs
    starting at once on a new store collide ("table _alembic_tmp_experiments already exists"). A new store
    is a copy of an empty one that MLflow migrated once per machine and MLflow version (``_empty_store``):
    running its ~60 schema migrations takes ~5 s at every new store otherwise."""
    if not uri.startswith("sqlite:///"):
        return
    path = Path(uri.removeprefix("sqlite:///"))
    path.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(path.with_name(path.name + ".lock")):
        if not path.exists():
            _copy_empty_store(path)
        MlflowClient(tracking_uri=uri).search_experiments(max_results=1)


@contextlib.contextmanager
def _file_lock(lock: Path) -> Iterator[None]:
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
        yield


def _empty_store() -> Path:
    """An empty store migrated by MLflow itself, cached as ``$XDG_CACHE_HOME/horizonrl/mlflow-<version>.db``
    (built on first use, under a lock: concurrent first runs build it once)."""
    cache = machine_cache()
    cache.mkdir(parents=True, exist_ok=True)
    template = cache / f"mlflow-{mlflow.__version__}.db"
    with _file_lock(cache / f"{template.name}.lock"):
        if not template.is_file():
            tmp = template.with_name(f"{template.name}.tmp-{os.getpid()}")
            tmp.unlink(missing_ok=True)
            MlflowClient(tracking_uri=f"sqlite:///{tmp}").search_experiments(max_results=1)
            tmp.rename(template)
    return template


def _copy_empty_store(path: Path) -> None:
    """A copy of the migrated empty store at ``path``, with its Default experiment (id 0) as MLflow would
    have made it here: artifacts in ./mlruns/0 of this process, created now. Written beside and renamed,
    so a reader never opens half a file."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    shutil.copyfile(_empty_store(), tmp)
    now = int(time.time() * 1000)
    with contextlib.closing(sqlite3.connect(tmp)) as db, db:
        db.execute(
            "UPDATE experiments SET artifact_location = ?, creation_time = ?, last_update_time = ? WHERE "
            "experiment_id = 0",
            (str(Path("mlruns", "0").resolve()), now, now),
        )
    tmp.rename(path)


def experiment_id(c: MlflowClient, name: str) -> str:
    exp = c.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    artifacts = None
    if c.tracking_uri.startswith("sqlite:///"):  # beside the database, wherever the process runs
        artifacts = (Path(c.tracking_uri.removeprefix("sqlite:///")).parent / "artifacts").resolve().as_uri()
    try:
        return c.create_experiment(name, artifact_location=artifacts)
    except mlflow.exceptions.MlflowException:
        exp = c.get_experiment_by_name(name)  # created by another run between our lookup and create
        if exp is None:
            raise
        return exp.experiment_id


class ArtifactStoreUnwritable(OSError):
    """The experiment's artifact folder cannot take a file (read-only, full, or missing permissions)."""


def check_artifact_store(c: MlflowClient, experiment: str) -> None:
    """Write and remove a small probe file in ``experiment``'s artifact folder when it is a local folder,
    so a read-only or full disk stops a run before it is created or resumed, with the folder named,
    instead of failing at its first artifact with MLflow's traceback. Remote stores are not probed."""
    location = c.get_experiment(experiment_id(c, experiment)).artifact_location
    if "://" in location and not location.startswith("file://"):
        return
    folder = Path(location.removeprefix("file://"))
    probe = folder / f".write-probe-{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"\0" * 4096)
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        raise ArtifactStoreUnwritable(
            err.errno,
            f"the MLflow artifact folder {folder} of experiment {experiment!r} cannot take a file "
            f"({os.strerror(err.errno or 0)}): make it writable or free space there, then run again",
        ) from err
    finally:
        remove_temporary(probe)


def find_run(c: MlflowClient, experiment: str, run_name: str) -> Run | None:
    """The newest run tagged with ``run_name`` in ``experiment``, or None."""
    exp = c.get_experiment_by_name(experiment)
    if exp is None:
        return None
    found = c.search_runs(
        [exp.experiment_id],
        filter_string=f"tags.`{RUN_NAME_TAG}` = {quoted(run_name)}",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    return found[0] if found else None


def quoted(value: str) -> str:
    """``value`` as a string literal of an MLflow filter string. The filter grammar has no escapes, so a
    value holding both quote characters cannot be searched for and is refused."""
    if "'" not in value:
        return f"'{value}'"
    if '"' not in value:
        return f'"{value}"'
    raise ValueError(f"{value!r} holds both quote characters and cannot go into an MLflow filter string")


def find_or_create_run(c: MlflowClient, experiment: str, run_name: str, tags: dict[str, str]) -> tuple[str, bool]:
    """Return (run_id, resumed): the newest run tagged with ``run_name`` (set RUNNING again, its failure tag
    removed), or a new one."""
    found = find_run(c, experiment, run_name)
    if found:
        run_id = found.info.run_id
        c.update_run(run_id, status="RUNNING")
        if FAILURE_TAG in found.data.tags:  # the cause of the last failure no longer holds
            c.delete_tag(run_id, FAILURE_TAG)
        return run_id, True
    return create_run(c, experiment, run_name, tags), False


def create_run(c: MlflowClient, experiment: str, run_name: str, tags: dict[str, str]) -> str:
    """A new run named ``run_name`` (tagged so ``find_run`` finds it); returns its id."""
    all_tags = {RUN_NAME_TAG: run_name, "mlflow.runName": run_name, **tags}
    return c.create_run(experiment_id(c, experiment), run_name=run_name, tags=all_tags).info.run_id


REPLACES_TAG = "horizonrl.replaces_failed_start"  # the run of a start that finished no iteration, set aside


def supersede_run(c: MlflowClient, run: Run, new_name: str, reason: str, carried: dict[str, str]) -> str:
    """Set ``run`` (a start that finished no iteration) aside for a fresh start under its name: renamed
    ``new_name``, FAILED, ``reason`` in its failure tag; and create the run that takes the name (no params
    yet: the start logs the new settings'), tagged with the old run's id and the ``carried`` tags (its links
    to a sweep). Returns the new run's id. MLflow cannot change a logged param, hence a new run."""
    old_id, name = run.info.run_id, run.data.tags.get(RUN_NAME_TAG, run.info.run_name)
    set_tags(c, old_id, {RUN_NAME_TAG: new_name, "mlflow.runName": new_name, FAILURE_TAG: reason[:4000]})
    if run.info.status in ("RUNNING", "SCHEDULED"):
        c.set_terminated(old_id, "FAILED")
    experiment = c.get_experiment(run.info.experiment_id).name
    return create_run(c, experiment, name, {**carried, REPLACES_TAG: old_id})


def log_params(c: MlflowClient, run_id: str, params: dict[str, str]) -> None:
    items = [Param(k, str(v)[:6000]) for k, v in sorted(params.items())]
    for i in range(0, len(items), 100):
        c.log_batch(run_id, params=items[i : i + 100])


def log_metrics(c: MlflowClient, run_id: str, stage: str, values: dict[str, float], step: int) -> None:
    """Log ``<stage>/<name>`` for every finite value at ``step``."""
    now = int(time.time() * 1000)
    metrics = [
        Metric(f"{stage}/{k}", float(v), now, step)
        for k, v in sorted(values.items())
        if v == v and abs(float(v)) != float("inf")
    ]
    for i in range(0, len(metrics), 1000):
        c.log_batch(run_id, metrics=metrics[i : i + 1000])


def log_parquet_input(
    c: MlflowClient, run_id: str, name: str, path: str | Path, digest: str, context: str = "training"
) -> None:
    """Record a Parquet file as a run input dataset (path plus content digest)."""
    ds = Dataset(
        name=name, digest=digest[:36], source_type="local", source=json.dumps({"uri": str(Path(path).resolve())})
    )
    inputs = [DatasetInput(ds, tags=[InputTag("mlflow.data.context", context)])]
    try:
        c.log_inputs(run_id, datasets=inputs)
    except MlflowException as e:
        # MLflow keeps one dataset per (experiment, name, digest), found or inserted without a lock: two runs
        # logging the same table at once (same config, other run names) race, and the loser's insert is
        # refused. Once more, it finds the winner's row and links this run to it.
        if "unique constraint" not in str(e).lower():
            raise
        c.log_inputs(run_id, datasets=inputs)


def recorded_digests(c: MlflowClient, run_id: str) -> dict[str, str]:
    """{dataset name: digest} of the run's input datasets (``log_parquet_input``)."""
    return {d.dataset.name: d.dataset.digest for d in c.get_run(run_id).inputs.dataset_inputs}


def log_table(c: MlflowClient, run_id: str, frame: pd.DataFrame, artifact_file: str) -> None:
    """Log ``frame`` as a table artifact, once: MLflow appends to a table that exists, so a retried
    stage logging it again would double its rows."""
    folder = os.path.dirname(artifact_file) or None
    if any(a.path == artifact_file for a in c.list_artifacts(run_id, folder)):
        return
    c.log_table(run_id, data=frame, artifact_file=artifact_file)


def git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


COMMITS_TAG = "horizonrl.git_commits"  # every commit a run ran at, in order, space-separated


def run_commits(tags: dict[str, str]) -> list[str]:
    """The commits a run ran at, from its tags (a run from before ``COMMITS_TAG``: its ``git_commit``)."""
    return tags.get(COMMITS_TAG, tags.get("git_commit", "")).split()


def record_commit(c: MlflowClient, run_id: str, commit: str) -> None:
    """Add ``commit`` to the run's ``COMMITS_TAG``: a run resumed after a pull runs its later iterations at
    newer code, and its ``git_commit`` tag names only the first start's."""
    had = run_commits(c.get_run(run_id).data.tags)
    if commit not in had:
        set_tags(c, run_id, {COMMITS_TAG: " ".join([*had, commit])})


# What a cell runs: a change here between two commits can change its numbers (docs, tests, scripts cannot).
CODE_PATHS = ("pyproject.toml", "horizonrl", "methods", "tasks", "flows", "configs")


def changed_code(commits: list[str]) -> list[str] | None:
    """Files under ``CODE_PATHS`` that differ between the first of ``commits`` and any other, sorted; None
    when git cannot compare them (a commit unknown here, or no repository)."""
    changed: set[str] = set()
    for other in commits[1:]:
        try:
            out = subprocess.run(
                ["git", "diff", "--name-only", commits[0], other, "--", *CODE_PATHS],
                capture_output=True,
                text=True,
                check=True,
                timeout=30,
            ).stdout
        except (OSError, subprocess.SubprocessError):
            return None
        changed.update(line for line in out.splitlines() if line)
    return sorted(changed)


def set_tags(c: MlflowClient, run_id: str, tags: dict[str, Any]) -> None:
    c.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in sorted(tags.items())])


def resolve_policy(c: MlflowClient, source: str, what: str = "source") -> tuple[str, str]:
    """(source run id, model URI) of a run id, ``runs:/<id>`` or ``models:/<name>/<version>``; a source
    the store does not hold raises ``ValueError`` naming it (as ``what``: ``source``, ``model.path =``) and
    the store."""
    mlflow.set_tracking_uri(c.tracking_uri)  # the fluent API (logged models) reads the global URI
    if source.startswith("models:/"):
        name, _, version = source.removeprefix("models:/").partition("/")
        if not version:
            raise ValueError(f"{what} {source!r}: give models:/<name>/<version>")
        try:
            return c.get_model_version(name, version).run_id, source
        except mlflow.exceptions.MlflowException as err:
            raise ValueError(
                f"{what} {source!r}: no version {version} of a registered model {name!r} in {c.tracking_uri}"
            ) from err
    run_id = source.removeprefix("runs:/").split("/")[0]
    try:
        c.get_run(run_id)
    except mlflow.exceptions.MlflowException as err:
        raise ValueError(f"{what} {source!r}: no run with id {run_id!r} in {c.tracking_uri}") from err
    models = policy_models(c, run_id)
    if not models:
        raise ValueError(
            f"{what} {source!r}: run {run_id} has no logged policy model (it logs one when its training finishes)"
        )
    return run_id, f"models:/{models[0].model_id}"


def policy_models(c: MlflowClient, run_id: str) -> list[LoggedModel]:
    """The models run ``run_id`` logged completely (status READY), newest first. One whose upload failed
    half way (a full disk) is left FAILED by MLflow with some of its files: never used, and the run logs
    its policy again when it is run again."""
    mlflow.set_tracking_uri(c.tracking_uri)  # the fluent API (logged models) reads the global URI
    models = mlflow.search_logged_models(
        experiment_ids=[c.get_run(run_id).info.experiment_id],
        filter_string=f"source_run_id = {quoted(run_id)}",
        order_by=[{"field_name": "creation_time", "ascending": False}],
        output_format="list",
    )
    return [m for m in models if m.status == LoggedModelStatus.READY]


INIT_MODEL_TAG = "horizonrl.init.model"  # lineage of a run that starts from a logged policy
INIT_SOURCE_TAG = "horizonrl.init.source_run_id"
INIT_FOLDER_TAG = "horizonrl.init.folder"  # the model folder a model path or name resolved to
INIT_DIGEST_TAG = "horizonrl.init.folder_digest"


def lineage_tags(c: MlflowClient, model_path: str | None, folder: str | Path | None = None) -> dict[str, str]:
    """Tags naming where a run's starting policy comes from (``models:/<name>/<version>`` or
    ``runs:/<id>``, and the run that produced it). A model folder or a pretrained model's name is named
    by ``folder``, the local folder it resolved to, and that folder's digest (``files.folder_digest``),
    when the caller gives it; else, for a directory or hub id, there are no tags."""
    if model_path is None:
        return {}
    if model_path.startswith(("models:/", "runs:/")):
        source_run_id, _ = resolve_policy(c, model_path)
        return {INIT_MODEL_TAG: model_path, INIT_SOURCE_TAG: source_run_id}
    if folder is None:
        return {}
    return {
        INIT_MODEL_TAG: model_path,
        INIT_FOLDER_TAG: str(Path(folder).resolve()),
        INIT_DIGEST_TAG: folder_digest(folder),
    }


@contextlib.contextmanager
def no_progress_bar() -> Iterator[None]:
    """MLflow's artifact progress bar off for the block: a download before a command's work (a run's config,
    the policy an evaluation checks) would print a dozen bar lines on the terminal of a one-line refusal."""
    bar = os.environ.get("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR")
    os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] = "false"
    try:
        yield
    finally:
        if bar is None:
            os.environ.pop("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", None)
        else:
            os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] = bar


def download_policy(model_uri: str, cache: Path) -> CheckpointRef:
    """The checkpoint packed in the pyfunc model (artifact ``policy``), downloaded once per model."""
    from mlflow.models import Model
    from mlflow.models.model import MLMODEL_FILE_NAME

    from horizonrl.training.checkpoint import STATE_FILE, CheckpointRef  # here: the checkpoint module imports torch

    dest = cache / model_uri.removeprefix("models:/").replace("/", "-")
    if not (dest / MLMODEL_FILE_NAME).is_file():
        dest.mkdir(parents=True, exist_ok=True)
        with no_progress_bar():
            mlflow.artifacts.download_artifacts(artifact_uri=model_uri, dst_path=str(dest))
    path = dest / Model.load(dest / MLMODEL_FILE_NAME).flavors["python_function"]["artifacts"]["policy"]["path"]
    return CheckpointRef(str(path), int(json.loads((path / STATE_FILE).read_text())["iteration"]))


POLICY_ITERATION_TAG = "horizonrl.iteration"  # on a logged policy model: the checkpoint it packs


SERVING_REQUIREMENTS = ("torch", "transformers", "tokenizers", "safetensors", "numpy", "pydantic", "pyyaml")
"""What the logged policy's code imports (``policy_model.py`` and the library under it), pinned at logging to
the versions it ran with (torch without its local build tag, so a GPU machine brings its own build); a LoRA
policy adds peft. mlflow, pandas and their dependencies come with MLflow's own requirement."""


def log_policy(
    c: MlflowClient,
    run_id: str,
    checkpoint: str | Path,
    iteration: int,
    model_config: dict[str, object] | None = None,
    example: dict[str, object] | None = None,
) -> None:
    """Log a checkpoint as the run's ``policy`` pyfunc model that serves anywhere: from code
    (``policy_model.py``), so it holds no pickle; the checkpoint's policy as its ``policy`` artifact (not the
    optimizer's state: ``copy_policy``), a LoRA policy's base model as ``base``; the library's code
    (``horizonrl``, ``methods``) in the model and its requirements pinned (``SERVING_REQUIREMENTS``), so a
    fresh environment with only those installed loads and serves it; ``model_config`` (the run's prompt and
    decoding: ``policy_model.CHAT_KEYS``, ``action_mode``, ``max_action_tokens``) and ``example`` (one
    input row: goal, observation, admissible) with its signature."""
    from importlib import metadata

    from horizonrl.tracking import policy_model
    from horizonrl.training.checkpoint import copy_policy

    adapter = lora.is_adapter_dir(checkpoint)
    pins = [
        f"{p}=={metadata.version(p).split('+')[0]}" for p in (*SERVING_REQUIREMENTS, *(["peft"] if adapter else []))
    ]
    with tempfile.TemporaryDirectory() as tmp:
        artifacts = {"policy": str(copy_policy(checkpoint, Path(tmp) / "policy"))}
        if adapter:
            artifacts["base"] = lora.base_model_path(checkpoint)
        code = [_code_copy(package, Path(tmp) / "code") for package in ("horizonrl", "methods")]
        mlflow.set_tracking_uri(c.tracking_uri)  # the fluent API (logged models) reads the global URI
        with mlflow.start_run(run_id=run_id), no_progress_bar():
            mlflow.pyfunc.log_model(
                name="policy",
                python_model=policy_model.__file__,
                artifacts=artifacts,
                code_paths=[str(p) for p in code],
                signature=policy_model.SIGNATURE,
                input_example=pd.DataFrame([example]) if example else None,
                pip_requirements=pins,
                tags={POLICY_ITERATION_TAG: str(iteration)},
                model_config=model_config or {},
            )


def _code_copy(package: str, dest: Path) -> Path:
    """The source of our top-level ``package`` (``horizonrl``, ``methods``) copied under ``dest``, without
    compiled files: the code a logged model carries."""
    source = Path(importlib.import_module(package).__file__).parent
    return Path(shutil.copytree(source, dest / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")))


def register_policy(c: MlflowClient, run_id: str, model_name: str) -> str:
    """Register the policy logged by run ``run_id`` under ``model_name``; returns the version (the existing
    one if this run's policy is already registered under that name, so a rerun registers nothing new)."""
    models = policy_models(c, run_id)
    if not models:
        raise ValueError(f"run {run_id} has no logged policy model")
    existing = c.search_model_versions(f"name = {quoted(model_name)} and run_id = {quoted(run_id)}")
    return str(
        existing[0].version if existing else mlflow.register_model(f"models:/{models[0].model_id}", model_name).version
    )


def log_adapter(c: MlflowClient, run_id: str, checkpoint: str | Path, iteration: int) -> None:
    """Log a checkpoint's adapter files to the MLflow run under ``adapters/iter=<n>/``."""
    for name in (lora.ADAPTER_CONFIG, lora.ADAPTER_WEIGHTS):
        c.log_artifact(run_id, str(Path(checkpoint) / name), artifact_path=f"adapters/iter={iteration:05d}")
