"""``horizonrl`` command line: local runs of the flows with progress on the terminal."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass


def _env_defaults() -> None:
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # the library's info lines (TextWorld game generation, ScienceWorld JVM starts) on the terminal and in Prefect
    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "horizonrl")
    logging.getLogger("horizonrl").setLevel(logging.INFO)
    # Prefect's temporary API server needs ~19 s on a fresh 2-core machine; its default wait is 20 s.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")


# Background loops of Prefect's server that a run's temporary server never needs (schedules, late and paused
# runs, workers' heartbeats, cancellation clean-up, automations): off there, so it takes fewer CPU seconds
# from the run it serves. Its event and task-run recorders stay on: the run's history is kept in its database.
TEMPORARY_SERVER_IDLE = tuple(
    f"PREFECT_SERVER_SERVICES_{name}_ENABLED"
    for name in (
        "SCHEDULER",
        "LATE_RUNS",
        "PAUSE_EXPIRATIONS",
        "FOREMAN",
        "REPOSSESSOR",
        "CANCELLATION_CLEANUP",
        "CLEANUP_RECONCILER",
        "TRIGGERS",
    )
)


def _choose_prefect_api() -> None:
    """Which Prefect server the command's flows report to: ``PREFECT_API_URL`` if set in the environment;
    else the local stack's (``horizonrl stack up`` in this folder, ``.stack/``) if it is up, a long-lived
    server that saves every run the start of a temporary one; else Prefect's own choice (a temporary server,
    unless the Prefect profile names one)."""
    if os.environ.get("PREFECT_API_URL"):
        return
    from pathlib import Path

    from horizonrl_stack import running_api

    api = running_api(Path(".stack"))
    if api is not None:
        os.environ["PREFECT_API_URL"] = api
        print(f"horizonrl: Prefect API {api}: the running stack's server (.stack/)", file=sys.stderr)


def _temporary_server_in_background() -> threading.Thread | None:
    """Start Prefect's temporary API server (what the flow would start on its first API call) in a thread,
    so that its boot, a process of its own, overlaps this process's imports of torch and transformers
    instead of following them, with its idle loops off (``TEMPORARY_SERVER_IDLE``). Prefect keeps one such
    server per process: the flow finds it running. None where ``PREFECT_API_URL`` names a server. A failed
    start is left to the flow's own, which reports it."""
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    if settings.api.url or not settings.server.ephemeral.enabled:
        return None
    from prefect.server.api.server import SubprocessASGIServer  # here, not in the thread: imports stay on one thread

    os.environ.update(dict.fromkeys(TEMPORARY_SERVER_IDLE, "false"))  # the server's environment is this one's

    def start() -> None:
        try:
            SubprocessASGIServer().start()
        except Exception:  # noqa: BLE001 - the flow starts it again and raises its error
            pass

    thread = threading.Thread(target=start, name="prefect-temporary-server", daemon=True)
    thread.start()
    return thread


class Refused(Exception):
    """A command stops with its message on stderr, each line as ``horizonrl: <line>`` (a refused config: one
    line a problem), and exit status ``code``: 2 for input refused before any work, 1 for a run that could
    not start or failed."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Command:
    """A subcommand: its help, what it adds to its parser, what runs it, and whether it speaks to Prefect."""

    help: str
    arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    prefect: bool = True


DESCRIPTION = (
    "horizonrl: train, evaluate and compare critic-free RL agents on long-horizon tasks; each command runs its "
    "Prefect flow here with progress on the terminal and logs to MLflow (README.md)."
)


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and run its subcommand (``COMMANDS``); returns the exit status."""
    _env_defaults()
    parser = argparse.ArgumentParser(prog="horizonrl", description=DESCRIPTION)
    parser.add_argument("--version", action=_ShowVersion, nargs=0, help="show the version and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, command in COMMANDS.items():
        command.arguments(sub.add_parser(name, help=command.help))
    args = parser.parse_args(argv)
    command = COMMANDS[args.command]
    if command.prefect:
        _choose_prefect_api()
    try:
        return command.run(args)
    except Refused as err:
        for line in str(err).splitlines():
            print(f"horizonrl: {line}", file=sys.stderr)
        return err.code


class _ShowVersion(argparse.Action):
    """``--version``: asked only when given (it runs ``git``)."""

    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> None:
        print(f"horizonrl {_version()}")
        parser.exit()


def _version() -> str:
    """The installed distribution's version, and the checkout's commit where the code runs from one (an
    editable install)."""
    import subprocess
    from importlib import metadata
    from pathlib import Path

    version, root = metadata.version("horizonrl"), Path(__file__).resolve().parents[1]
    if not (root / ".git").exists():  # installed from a wheel: no checkout to ask
        return version
    try:
        done = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    except OSError:
        return version
    return f"{version} (commit {done.stdout.strip()})" if done.returncode == 0 else version


def _config_args(p: argparse.ArgumentParser, example: str, config: str = "YAML config file") -> None:
    p.add_argument("--config", help=config)
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help=f"override a config field, e.g. {example}"
    )
    _allow_change_arg(p)


def _allow_change_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--allow-change",
        action="append",
        default=[],
        metavar="FIELD",
        help="resume the run with this field (or section) changed; the change is recorded (docs/reliability.md)",
    )


def _checked_config(args: argparse.Namespace, length: str = "iterations"):
    """The config of ``--config`` and ``--set`` (a refused one: one line a problem), and what the user brings
    (model folder, environment, engine) and what a resume changes checked, ``length`` the field that says
    how long the run is: before any run."""
    from horizonrl.config import load_config
    from horizonrl.run import preflight

    try:
        cfg = load_config(args.config, args.set)
    except ValueError as err:
        raise Refused(str(err)) from err
    try:
        preflight.check_start(cfg, args.allow_change, length)
    except ValueError as err:
        raise Refused(f"run {cfg.run_name!r} not started: {err}") from err
    return cfg


def _train_args(p: argparse.ArgumentParser) -> None:
    _config_args(p, "method=grpo")


def _train(args: argparse.Namespace) -> int:
    import psutil

    cfg = _checked_config(args)
    server = _temporary_server_in_background()
    from flows.train import STARTED_AT, train
    from horizonrl.run.runlock import RunInUse
    from horizonrl.store import StoreError
    from horizonrl.tracking.mlflow_runs import ArtifactStoreUnwritable
    from horizonrl.training.checkpoint import CheckpointDamaged
    from tasks.failures import known_failure

    os.environ[STARTED_AT] = str(psutil.Process().create_time())  # the flow logs time/startup_s from it
    if server is not None:
        server.join()
    try:  # a known failure's traceback is one line in the flow's log (tasks.failures.one_line_failures)
        summary = train(config=cfg.model_dump(), allow_change=args.allow_change)
    except (RunInUse, CheckpointDamaged, StoreError, ArtifactStoreUnwritable) as err:
        raise Refused(f"run {cfg.run_name!r} not started: {err}", 1) from err
    except OSError as err:
        if not known_failure(err):
            raise
        why = "its MLflow run is marked FAILED; the same command resumes it once there is room"
        raise Refused(f"run {cfg.run_name!r} failed: {err} ({why})", 1) from err
    _stop_temporary_server()  # its "Stopping" line would follow the summary
    _print_run_summary(cfg, summary)
    return 0


def _print_run_summary(cfg, summary: dict[str, float]) -> None:
    """What a finished train run tells the terminal: the held-out gain, paired by task, and where to look."""
    from horizonrl.tracking.mlflow_runs import tracking_uri

    print("\n== horizonrl: run finished ==")
    print(
        f"held-out success (sampled, {cfg.eval.tasks_at(end=True)} tasks): {summary['initial_success_rate']:.3f} "
        f"-> {summary['final_success_rate']:.3f} "
        f"({summary['improvement'] * 100:+.1f} points) after {int(summary['iterations'])} iterations"
    )
    if "paired_change" in summary:
        low, high = (summary.get(f"paired_change_{end}") for end in ("low", "high"))  # none from one task
        interval = (
            f", 95% interval [{100 * low:+.1f}, {100 * high:+.1f}]" if low is not None and high is not None else ""
        )
        print(
            f"paired by held-out task ({int(summary['paired_tasks'])} tasks): "
            f"{summary['paired_change'] * 100:+.1f} points{interval}"
        )
    print(
        f"MLflow: experiment {cfg.experiment!r}, run {cfg.run_name!r}; open the UI with: mlflow ui "
        f"--backend-store-uri {tracking_uri(cfg.tracking_uri)} --host 127.0.0.1"
    )
    print(f"data: {os.path.join(cfg.data_dir, cfg.experiment, cfg.run_name)}")


def _warmstart_args(p: argparse.ArgumentParser) -> None:
    _config_args(p, "warmstart.epochs=3", "YAML config file (section warmstart: demonstrations, epochs, ...)")


def _warmstart(args: argparse.Namespace) -> int:
    cfg = _checked_config(args, "warmstart.epochs")
    from flows.warmstart import warmstart

    summary = warmstart(config=cfg.model_dump(), allow_change=args.allow_change)
    _stop_temporary_server()
    print("\n== horizonrl: warm start finished ==")
    print(
        f"held-out success (sampled, {cfg.eval.tasks_at(end=True)} tasks): {summary['initial_success_rate']:.3f} "
        f"-> {summary['final_success_rate']:.3f} "
        f"after {int(summary['iterations'])} epochs on {cfg.warmstart.demonstrations} demonstrations"
    )
    print(
        f"registered: {summary['model_uri']}; train from it with: horizonrl train --config <config> --set "
        f"model.path={summary['model_uri']}"
    )
    print(f"demonstrations: {os.path.join(cfg.data_dir, cfg.experiment, cfg.run_name, 'demonstrations')}")
    return 0


def _sweep_file_args(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("sweep_file", help=what)
    p.add_argument(
        "--instance", help="an instance of a scheduled sweep (<time>-<commit>, the parent run's name after '--')"
    )
    p.add_argument("--out", help="also write the results page here, figures beside it (e.g. docs/results.md)")


def _loaded_sweep(path: str, instance: str | None = None):
    """The sweep file's spec and cells, or the command refused naming what is wrong with it."""
    from horizonrl.config.sweep import load_sweep

    try:
        return load_sweep(path, instance)
    except ValueError as err:
        raise Refused(f"bad sweep: {err}") from err


def _sweep_args(p: argparse.ArgumentParser) -> None:
    _sweep_file_args(p, "sweep YAML (configs/sweeps/)")
    p.add_argument(
        "--here", action="store_true", help="run the cells in this process even if the file names a deployment"
    )
    _allow_change_arg(p)


def _sweep(args: argparse.Namespace) -> int:
    from flows.sweep import sweep
    from horizonrl.run import preflight

    _, cells = _loaded_sweep(args.sweep_file, args.instance)
    for cell in cells:  # every cell before the first starts
        try:
            preflight.check_start(cell.config, args.allow_change)
        except ValueError as err:
            raise Refused(f"sweep not started: cell {cell.run_name!r}: {err}") from err
    sweep(args.sweep_file, in_process=args.here, instance=args.instance, out=args.out, allow_change=args.allow_change)
    return 0


def _report(args: argparse.Namespace) -> int:
    from flows.sweep import sweep_report
    from horizonrl.config.sweep import instance_name

    spec, cells = _loaded_sweep(args.sweep_file, args.instance)
    cfg0 = cells[0].config
    sweep_report(instance_name(spec.name, args.instance), cfg0.experiment, cfg0.tracking_uri, args.sweep_file, args.out)
    return 0


def _study_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("sweep_file", help="sweep YAML the study ran from")
    p.add_argument(
        "--record",
        help="folder of the record's CSV files, committed beside the page (default: the sweep file's record)",
    )
    p.add_argument("--out", required=True, help="the page (markdown), its figures beside it")
    p.add_argument(
        "--offline", action="store_true", help="page from the record alone: no MLflow store or data folder read"
    )


def _recompute_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", required=True, help="data/<experiment>/<run_name>")
    p.add_argument(
        "--method",
        required=True,
        help="method (loop, grpo, drgrpo, rloo, reinforce_pp_baseline, gigpo, blpo, appo) or estimator name",
    )
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE", help="estimator parameter override")


def _recompute(args: argparse.Namespace) -> int:
    from flows.recompute import recompute_advantages
    from horizonrl.run import preflight
    from horizonrl.run.runlock import RunInUse
    from horizonrl.store import StoreError

    params = _estimator_params(args.method, args.param)
    try:  # every stored table before the flow: a bad one is named and nothing is created
        preflight.check_recompute(args.run_dir)
    except (StoreError, ValueError) as err:
        raise Refused(f"recompute: {err}; nothing was written") from err
    try:
        written = recompute_advantages(args.run_dir, args.method, params)
    except (StoreError, RunInUse, ValueError) as err:
        raise Refused(f"recompute: {err}; nothing was written", 1) from err
    for it, path in sorted(written.items()):
        print(f"iteration {it}: {path}")
    return 0


def _estimator_params(method: str, given: list[str]) -> dict:
    """``--param KEY=VALUE`` pairs as the estimator of ``method``'s params, checked against its dataclass."""
    import yaml

    import methods
    from methods.presets import estimator_of

    try:
        name = estimator_of(method)
    except ValueError as err:
        raise Refused(f"--method {err}") from err
    bad = [p for p in given if "=" not in p or not p.split("=", 1)[0].strip()]
    if bad:
        raise Refused(f"--param {bad[0]!r}: expected KEY=VALUE, e.g. --param gamma=0.95")
    params = {k.strip(): yaml.safe_load(v) for k, v in (p.split("=", 1) for p in given)}
    try:
        methods.ADVANTAGES.get(name).params_cls(**params)
    except (TypeError, ValueError) as err:
        raise Refused(f"--param for estimator {name!r}: {err}") from err
    return params


def _study(args: argparse.Namespace) -> int:
    from pathlib import Path

    from horizonrl.tracking import study_page, study_record
    from horizonrl.tracking.mlflow_runs import tracking_uri

    spec, cells = _loaded_sweep(args.sweep_file)
    record = Path(args.record) if args.record else spec.record_folder(args.sweep_file)
    if record is None:
        raise Refused(f"sweep file {args.sweep_file!r} names no record: give --record <folder>")
    out = Path(args.out)
    if not args.offline:
        counts = study_record.export(cells, tracking_uri(cells[0].config.tracking_uri), record)
        print(f"record: {record} ({', '.join(f'{name} {n} rows' for name, n in counts.items())})")
    elif not (record / study_record.OUTCOMES).is_file():
        raise Refused(f"no study record in {record} (run without --offline to write it)")
    study_page.write(record, out, study_page.meta(spec.name, args.sweep_file, str(record), args.out, spec.tuning))
    print(f"page: {out}")
    return 0


def _evaluate_args(p: argparse.ArgumentParser) -> None:
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--source", help="MLflow run id, runs:/<run id>, or models:/<name>/<version>")
    what.add_argument(
        "--model",
        help="a model folder or a pretrained model's name (model.path), evaluated as --config says (a prompted "
        "baseline); its run is tagged with the model's lineage",
    )
    p.add_argument("--config", help="with --model: the config (environment, prompt, decoding, eval.*) to play it with")
    p.add_argument("--split", default="test", help="environment split (default test)")
    p.add_argument(
        "--n-tasks", type=int, help="tasks evaluated (default: the source run's eval.n_tasks_ends, else eval.n_tasks)"
    )
    p.add_argument("--samples", type=int, help="sampled attempts per task (default: the source run's eval.samples)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a field of the source run's config that evaluation uses (env.*, eval.*, seed, ...), "
        "e.g. env.games=~/tw/held-out; with --model, any field of --config",
    )


def _evaluate(args: argparse.Namespace) -> int:
    from flows.evaluate import evaluate_policy
    from tasks.evaluation_run import evaluation_inputs, one_line
    from tasks.failures import OneLineErrors

    inputs = (args.source, args.model, args.config, args.split, args.n_tasks, args.samples, args.set)
    try:  # before the flow, so that bad input is one line, not a flow's traceback, and no run is created
        evaluation_inputs(*inputs)
    except ValueError as err:
        raise Refused(f"evaluate: {one_line(err)}") from err
    try:
        with OneLineErrors():
            evaluate_policy(
                args.source, args.split, args.n_tasks, args.samples, overrides=args.set, model=args.model,
                config_path=args.config,
            )  # fmt: skip
    except Exception as err:  # noqa: BLE001 - a run-time failure: one line; the MLflow run is marked FAILED
        raise Refused(f"evaluate failed: {one_line(err)} (its MLflow run is marked FAILED)", 1) from err
    return 0


def _show_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", help="run folder (data/<experiment>/<run_name>) or a run name under data/")
    p.add_argument(
        "--iteration", type=int, required=True, help="the stored iteration (iter=<n>; 0 holds the first evaluation)"
    )
    p.add_argument("--episode", type=int, help="rollout id; without it, the iteration's episodes are listed")
    p.add_argument("--data-dir", default="data", help="where run names are looked up (default data/)")


def _show(args: argparse.Namespace) -> int:
    from pathlib import Path

    from horizonrl.tracking import episode_view

    run_dir = Path(args.run)
    if not run_dir.is_dir():
        found = sorted(p for p in Path(args.data_dir).glob(f"*/{args.run}") if p.is_dir())
        if len(found) != 1:
            raise Refused(f"run {args.run!r}: not a folder, and {len(found)} runs of that name under {args.data_dir}/")
        run_dir = found[0]
    try:
        if args.episode is None:
            print(episode_view.iteration_text(run_dir, args.iteration))
        else:
            print(episode_view.episode_text(run_dir, args.iteration, args.episode))
    except ValueError as err:
        raise Refused(str(err)) from err
    return 0


def _models_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["fetch", "list"])
    p.add_argument("names", nargs="*", help="models to fetch (horizonrl models list names them)")
    p.add_argument("--data-dir", default="data", help="the cache is <data-dir>/models/<name> (default data/)")


def _models(args: argparse.Namespace) -> int:
    """Fetch (once; afterwards a digest check) or list the known pretrained models, without Prefect."""
    from horizonrl.models import pretrained

    if args.action == "list":
        for name, spec in sorted(pretrained.KNOWN.items()):
            cached = "cached" if pretrained.model_dir(name, args.data_dir).is_dir() else "not fetched"
            print(f"{name}\t{cached}\t{spec.about}")
        return 0
    if not args.names:
        raise Refused("models fetch needs a model name; known: " + ", ".join(sorted(pretrained.KNOWN)))
    for name in args.names:
        try:
            print(pretrained.fetch(name, args.data_dir))
        except (ValueError, RuntimeError, OSError) as err:
            raise Refused(str(err)) from err
    return 0


def _stack_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "action",
        choices=["up", "down", "status"],
        help="up: start the servers and the worker (and print their addresses); down: stop them, the worker "
        "first; status: which are running",
    )
    p.add_argument("--home", default=".stack", help="pid files and logs (default .stack/)")
    p.add_argument(
        "--store",
        default="mlflow",
        help="MLflow store folder: artifacts, SQLite database or PostgreSQL cluster (default mlflow/)",
    )
    p.add_argument("--prefect-port", type=int, default=4200)
    p.add_argument("--mlflow-port", type=int, default=5000)
    p.add_argument("--pool", default="horizonrl", help="process work pool (prefect.yaml deploys to 'horizonrl')")
    p.add_argument(
        "--database",
        choices=["sqlite", "postgres"],
        default="sqlite",
        help="behind both servers: SQLite files, or a local PostgreSQL (many concurrent sweep workers) in "
        "<store>/postgres",
    )
    p.add_argument("--postgres-port", type=int, default=5432)


def _stack(args: argparse.Namespace) -> int:
    from pathlib import Path

    import horizonrl_stack as stack

    s = stack.Stack(
        Path(args.home),
        Path(args.store),
        args.prefect_port,
        args.mlflow_port,
        args.pool,
        database=args.database,
        postgres_port=args.postgres_port,
    )
    if args.action == "up":
        try:
            urls = stack.up(s)
        except (RuntimeError, TimeoutError) as err:
            raise Refused(f"stack up: {err}", 1) from err
        database = f"PostgreSQL on 127.0.0.1:{s.postgres_port} ({s.pg_data})" if s.database == "postgres" else "SQLite"
        print(
            f"prefect UI {urls['prefect_ui']}, MLflow UI {urls['mlflow']}, work pool {s.pool!r}, database {database}; "
            f"logs in {s.home}/"
        )
        print(f"export PREFECT_API_URL={s.prefect_api} MLFLOW_TRACKING_URI={s.mlflow_uri}")
    elif args.action == "down":
        print("stopped:", ", ".join(stack.down(s)) or "nothing was running")
    else:
        for name, pgid in stack.status(s).items():
            print(f"{name}: {'running, process group ' + str(pgid) if pgid else 'not running'}")
    return 0


def _audit_args(p: argparse.ArgumentParser) -> None:
    """``audit``'s flags: the policy, the config it plays by, and the fields of ``AuditConfig``."""
    from horizonrl.config import AuditConfig

    p.description = (
        "The credit audit (docs/algorithms.md §8): play groups as training collects them, draw decision points, "
        "estimate A_MC = Q(s_t, a_t) - V(s_t) at each from continuations that replay the episode, and score every "
        "estimator of methods.ADVANTAGES against it, in an MLflow run of its own. The same command resumes it."
    )
    p.add_argument(
        "--policy",
        help="a model folder, a pretrained model's name, models:/<name>/<version>, runs:/<run id>, or a run's "
        "checkpoint folder (data/<experiment>/<run>/checkpoints/iter=<n>: BLPO is then also audited warm, from the "
        "run's batches before it); default: the config's model",
    )
    p.add_argument("--config", help="the train config the policy plays by (default: the policy's run's config)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a field of the config")
    p.add_argument("--name", help="the audit's name (default <policy>--audit-<env>-<tier>-s<seed>)")
    for field, info in AuditConfig.model_fields.items():
        about = " ".join(info.description.replace("``", "").replace("%", "%%").split())
        p.add_argument(f"--{field.replace('_', '-')}", type=info.annotation, help=f"{about} (default {info.default})")


def _audit(args: argparse.Namespace) -> int:
    from flows.audit import audit
    from horizonrl.config import AuditConfig
    from tasks.audit_settings import audit_settings
    from tasks.evaluation_run import one_line
    from tasks.failures import OneLineErrors

    given = {field: getattr(args, field) for field in AuditConfig.model_fields}
    try:  # before the flow: bad input is one line and no run is created
        cfg, settings, name = audit_settings(args.policy, args.config, args.set, given, args.name)
    except ValueError as err:
        raise Refused(f"audit: {one_line(err)}") from err
    try:
        with OneLineErrors():
            scores = audit(config=cfg.model_dump(), settings=settings.model_dump(), name=name, policy=args.policy)
    except Exception as err:  # noqa: BLE001 - a run-time failure: one line; the MLflow run is marked FAILED
        why = f"{one_line(err)} (its MLflow run is marked FAILED; the same command resumes it)"
        raise Refused(f"audit failed: {why}", 1) from err
    print(f"\n== horizonrl: audit {name} finished: {scores['points']} decision points ==")
    print(f"noise ceiling {scores['noise_ceiling']['value']:.2f}; Spearman with A_MC:")
    for label in scores["order"]:
        e = scores["estimators"][label]["spearman"]
        print(f"  {label:24s} {e['value']:+.2f} [{e['low']:+.2f}, {e['high']:+.2f}]")
    print(f"data: {os.path.join(cfg.data_dir, cfg.experiment, name)}; page: horizonrl audit-report <that folder>")
    return 0


def _audit_report_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("audits", nargs="*", help="audit folders (data/<experiment>/<name>); none: a page that says so")
    p.add_argument("--out", default="docs/credit-audit.md", help="the page (default docs/credit-audit.md)")


def _audit_report(args: argparse.Namespace) -> int:
    from pathlib import Path

    from horizonrl.audit.page import SCORES_FILE, write_page

    missing = [a for a in args.audits if not (Path(a) / SCORES_FILE).is_file()]
    if missing:
        raise Refused(
            f"audit-report: {missing[0]} holds no {SCORES_FILE} (not an audit folder, or the audit has not "
            "finished: run the same `horizonrl audit` again)"
        )
    print(write_page([Path(a) for a in args.audits], Path(args.out)))
    return 0


def _stop_temporary_server() -> None:
    """Stop Prefect's temporary API server of this process, if it started one, once the flow is done: else
    it stops at exit and its "Stopping temporary server" line follows the command's summary."""
    from prefect.settings import get_current_settings

    if get_current_settings().api.url:  # a server of its own (the stack's, PREFECT_API_URL): nothing to stop
        return
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.server.api.server import SubprocessASGIServer

    # The flow's last logs and events go to the server before it stops: left queued, they were sent at exit
    # to a server no longer there, retried for about a minute after the summary had been printed.
    for worker in (APILogWorker, EventsWorker):
        worker.drain_all(timeout=10)
    SubprocessASGIServer().stop()


COMMANDS: dict[str, Command] = {
    "train": Command("train one method (runs the Prefect 'train' flow)", _train_args, _train),
    "warmstart": Command(
        "behaviour-clone the walkthroughs and register the policy (runs the Prefect 'warmstart' flow)",
        _warmstart_args,
        _warmstart,
    ),
    "sweep": Command("run a sweep file's grid as child train runs, then the comparison report", _sweep_args, _sweep),
    "recompute": Command(
        "compute a method's advantages over a stored run, without new rollouts", _recompute_args, _recompute
    ),
    "report": Command(
        "compare the finished cells of a sweep (MLflow parent run + Prefect artifacts; --out: the results page)",
        lambda p: _sweep_file_args(p, "sweep YAML the sweep ran from"),
        _report,
    ),
    "study": Command(
        "compare a sweep's methods task by task: its record (per-task outcomes, progress, cells), its page",
        _study_args,
        _study,
        prefect=False,  # files and the store only
    ),
    "evaluate": Command(
        "evaluate a logged policy, or a model with no run behind it, on a split, in a new MLflow run",
        _evaluate_args,
        _evaluate,
    ),
    "show": Command(
        "print a stored iteration's episodes, or one episode turn by turn (Parquet store)", _show_args, _show, False
    ),
    "stack": Command("local prefect server + process worker + mlflow server on 127.0.0.1", _stack_args, _stack, False),
    "models": Command(
        "the pretrained models model.path can name: list them, or fetch and convert them", _models_args, _models, False
    ),
    "audit": Command(
        "score every advantage estimator against Monte Carlo returns from the same states (credit audit)",
        _audit_args,
        _audit,
    ),
    "audit-report": Command(
        "write the credit audit's page from audit folders (generated, never typed)",
        _audit_report_args,
        _audit_report,
    ),
}
"""The subcommands, in the order ``horizonrl --help`` lists them."""


if __name__ == "__main__":
    sys.exit(main())
