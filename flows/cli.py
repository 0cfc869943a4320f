"""``horizonrl`` command line: local runs of the flows with progress on the terminal."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading


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


DESCRIPTION = (
    "horizonrl: train, evaluate and compare critic-free RL agents on long-horizon tasks; each command runs its "
    "Prefect flow here with progress on the terminal and logs to MLflow (README.md)."
)


def main(argv: list[str] | None = None) -> int:
    _env_defaults()
    parser = argparse.ArgumentParser(prog="horizonrl", description=DESCRIPTION)
    parser.add_argument("--version", action=_ShowVersion, nargs=0, help="show the version and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    tr = sub.add_parser("train", help="train one method (runs the Prefect 'train' flow)")
    tr.add_argument("--config", help="YAML config file")
    tr.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field, e.g. method=grpo"
    )
    ws = sub.add_parser(
        "warmstart", help="behaviour-clone the walkthroughs and register the policy (runs the Prefect 'warmstart' flow)"
    )
    ws.add_argument("--config", help="YAML config file (section warmstart: demonstrations, epochs, ...)")
    ws.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. warmstart.epochs=3",
    )
    sw = sub.add_parser("sweep", help="run a sweep file's grid as child train runs, then the comparison report")
    for p in (tr, ws, sw):
        p.add_argument(
            "--allow-change",
            action="append",
            default=[],
            metavar="FIELD",
            help="resume the run with this field (or section) changed; the change is recorded (docs/reliability.md)",
        )
    rc = sub.add_parser("recompute", help="compute a method's advantages over a stored run, without new rollouts")
    rc.add_argument("--run-dir", required=True, help="data/<experiment>/<run_name>")
    rc.add_argument(
        "--method",
        required=True,
        help="method (loop, grpo, drgrpo, rloo, reinforce_pp_baseline, gigpo, blpo, appo) or estimator name",
    )
    rc.add_argument("--param", action="append", default=[], metavar="KEY=VALUE", help="estimator parameter override")
    sw.add_argument("sweep_file", help="sweep YAML (configs/sweeps/)")
    sw.add_argument(
        "--here", action="store_true", help="run the cells in this process even if the file names a deployment"
    )
    rp = sub.add_parser(
        "report",
        help="compare the finished cells of a sweep (MLflow parent run + Prefect artifacts; --out: the results page)",
    )
    rp.add_argument("sweep_file", help="sweep YAML the sweep ran from")
    for p in (sw, rp):
        p.add_argument(
            "--instance", help="an instance of a scheduled sweep (<time>-<commit>, the parent run's name after '--')"
        )
        p.add_argument("--out", help="also write the results page here, figures beside it (e.g. docs/results.md)")
    sd = sub.add_parser(
        "study",
        help="compare a sweep's methods task by task: its record (per-task outcomes, progress, cells), its page",
    )
    sd.add_argument("sweep_file", help="sweep YAML the study ran from")
    sd.add_argument("--record", required=True, help="folder of the record's CSV files, committed beside the page")
    sd.add_argument("--out", required=True, help="the page (markdown), its figures beside it")
    sd.add_argument(
        "--offline", action="store_true", help="page from the record alone: no MLflow store or data folder read"
    )
    ev = sub.add_parser(
        "evaluate", help="evaluate a logged policy, or a model with no run behind it, on a split, in a new MLflow run"
    )
    what = ev.add_mutually_exclusive_group(required=True)
    what.add_argument("--source", help="MLflow run id, runs:/<run id>, or models:/<name>/<version>")
    what.add_argument(
        "--model",
        help="a model folder or a pretrained model's name (model.path), evaluated as --config says (a prompted "
        "baseline); its run is tagged with the model's lineage",
    )
    ev.add_argument("--config", help="with --model: the config (environment, prompt, decoding, eval.*) to play it with")
    ev.add_argument("--split", default="test", help="environment split (default test)")
    ev.add_argument(
        "--n-tasks", type=int, help="tasks evaluated (default: the source run's eval.n_tasks_ends, else eval.n_tasks)"
    )
    ev.add_argument("--samples", type=int, help="sampled attempts per task (default: the source run's eval.samples)")
    ev.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a field of the source run's config that evaluation uses (env.*, eval.*, seed, ...), "
        "e.g. env.games=~/tw/held-out; with --model, any field of --config",
    )
    sh = sub.add_parser("show", help="print a stored iteration's episodes, or one episode turn by turn (Parquet store)")
    sh.add_argument("run", help="run folder (data/<experiment>/<run_name>) or a run name under data/")
    sh.add_argument(
        "--iteration", type=int, required=True, help="the stored iteration (iter=<n>; 0 holds the first evaluation)"
    )
    sh.add_argument("--episode", type=int, help="rollout id; without it, the iteration's episodes are listed")
    sh.add_argument("--data-dir", default="data", help="where run names are looked up (default data/)")
    st = sub.add_parser("stack", help="local prefect server + process worker + mlflow server on 127.0.0.1")
    st.add_argument(
        "action",
        choices=["up", "down", "status"],
        help="up: start the servers and the worker (and print their addresses); down: stop them, the worker "
        "first; status: which are running",
    )
    st.add_argument("--home", default=".stack", help="pid files and logs (default .stack/)")
    st.add_argument(
        "--store",
        default="mlflow",
        help="MLflow store folder: artifacts, SQLite database or PostgreSQL cluster (default mlflow/)",
    )
    st.add_argument("--prefect-port", type=int, default=4200)
    st.add_argument("--mlflow-port", type=int, default=5000)
    st.add_argument("--pool", default="horizonrl", help="process work pool (prefect.yaml deploys to 'horizonrl')")
    st.add_argument(
        "--database",
        choices=["sqlite", "postgres"],
        default="sqlite",
        help="behind both servers: SQLite files, or a local PostgreSQL (many concurrent sweep workers) in "
        "<store>/postgres",
    )
    st.add_argument("--postgres-port", type=int, default=5432)
    md = sub.add_parser(
        "models", help="the pretrained models model.path can name: list them, or fetch and convert them"
    )
    md.add_argument("action", choices=["fetch", "list"])
    md.add_argument("names", nargs="*", help="models to fetch (horizonrl models list names them)")
    md.add_argument("--data-dir", default="data", help="the cache is <data-dir>/models/<name> (default data/)")
    _add_audit_commands(sub)
    args = parser.parse_args(argv)
    if args.command == "models":
        return _models(args)
    if args.command == "study":  # files and the store only: no Prefect
        return _study(args)
    if args.command not in ("stack", "show"):
        _choose_prefect_api()
    if args.command in _AUDIT_COMMANDS:
        return _AUDIT_COMMANDS[args.command](args)
    if args.command == "recompute":
        return _recompute(args)
    if args.command == "show":
        return _show(args)

    if args.command in ("sweep", "report", "evaluate", "stack"):
        return _SWEEP_COMMANDS[args.command](args)

    from horizonrl.config import load_config

    try:
        cfg = load_config(args.config, args.set)
    except ValueError as err:
        _print_lines(err)
        return 2
    from horizonrl.run import preflight

    try:  # what the user brings (model folder, environment, engine) and what a resume changes: before any run
        preflight.check_start(
            cfg, args.allow_change, "warmstart.epochs" if args.command == "warmstart" else "iterations"
        )
    except ValueError as err:
        print(f"horizonrl: run {cfg.run_name!r} not started: {err}", file=sys.stderr)
        return 2
    if args.command == "train":
        import psutil

        server = _temporary_server_in_background()
        from flows.train import STARTED_AT, train
        from horizonrl.run.runlock import RunInUse
        from horizonrl.store import StoreError
        from horizonrl.tracking.mlflow_runs import ArtifactStoreUnwritable, tracking_uri
        from horizonrl.training.checkpoint import CheckpointDamaged
        from tasks.run import known_failure

        os.environ[STARTED_AT] = str(psutil.Process().create_time())  # the flow logs time/startup_s from it
        if server is not None:
            server.join()
        try:  # a known failure's traceback is one line in the flow's log (tasks.run.one_line_failures), reported below
            summary = train(config=cfg.model_dump(), allow_change=args.allow_change)
        except (RunInUse, CheckpointDamaged, StoreError, ArtifactStoreUnwritable) as err:
            print(f"horizonrl: run {cfg.run_name!r} not started: {err}", file=sys.stderr)
            return 1
        except OSError as err:
            if not known_failure(err):
                raise
            print(
                f"horizonrl: run {cfg.run_name!r} failed: {err} (its MLflow run is marked FAILED; "
                "the same command resumes it once there is room)",
                file=sys.stderr,
            )
            return 1
        _stop_temporary_server()  # its "Stopping" line would follow the summary
        uri = tracking_uri(cfg.tracking_uri)
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
            f"--backend-store-uri {uri} --host 127.0.0.1"
        )
        print(f"data: {os.path.join(cfg.data_dir, cfg.experiment, cfg.run_name)}")
    if args.command == "warmstart":
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


def _print_lines(err: ValueError) -> None:
    """A refused config on stderr: each of its lines (``config: <field> <problem> (got <value>)``) once."""
    for text in str(err).splitlines():
        print(f"horizonrl: {text}", file=sys.stderr)


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


def _recompute(args: argparse.Namespace) -> int:
    import yaml

    import methods
    from flows.recompute import recompute_advantages
    from horizonrl.run import preflight
    from horizonrl.run.runlock import RunInUse
    from horizonrl.store import StoreError
    from methods.presets import estimator_of

    try:
        name = estimator_of(args.method)
    except ValueError as err:
        print(f"horizonrl: --method {err}", file=sys.stderr)
        return 2
    bad = [p for p in args.param if "=" not in p or not p.split("=", 1)[0].strip()]
    if bad:
        print(f"horizonrl: --param {bad[0]!r}: expected KEY=VALUE, e.g. --param gamma=0.95", file=sys.stderr)
        return 2
    params = {k.strip(): yaml.safe_load(v) for k, v in (p.split("=", 1) for p in args.param)}
    try:
        methods.ADVANTAGES.get(name).params_cls(**params)
    except (TypeError, ValueError) as err:
        print(f"horizonrl: --param for estimator {name!r}: {err}", file=sys.stderr)
        return 2
    try:  # every stored table before the flow: a bad one is named and nothing is created
        preflight.check_recompute(args.run_dir)
    except (StoreError, ValueError) as err:
        print(f"horizonrl: recompute: {err}; nothing was written", file=sys.stderr)
        return 2
    try:
        written = recompute_advantages(args.run_dir, args.method, params)
    except (StoreError, RunInUse, ValueError) as err:
        print(f"horizonrl: recompute: {err}; nothing was written", file=sys.stderr)
        return 1
    for it, path in sorted(written.items()):
        print(f"iteration {it}: {path}")
    return 0


def _models(args: argparse.Namespace) -> int:
    """Fetch (once; afterwards a digest check) or list the known pretrained models, without Prefect."""
    from horizonrl.models import pretrained

    if args.action == "list":
        for name, spec in sorted(pretrained.KNOWN.items()):
            cached = "cached" if pretrained.model_dir(name, args.data_dir).is_dir() else "not fetched"
            print(f"{name}\t{cached}\t{spec.about}")
        return 0
    if not args.names:
        print(
            "horizonrl: models fetch needs a model name; known: " + ", ".join(sorted(pretrained.KNOWN)), file=sys.stderr
        )
        return 2
    for name in args.names:
        try:
            print(pretrained.fetch(name, args.data_dir))
        except (ValueError, RuntimeError, OSError) as err:
            print(f"horizonrl: {err}", file=sys.stderr)
            return 2
    return 0


def _show(args: argparse.Namespace) -> int:
    from pathlib import Path

    from horizonrl.tracking import episode_view

    run_dir = Path(args.run)
    if not run_dir.is_dir():
        found = sorted(p for p in Path(args.data_dir).glob(f"*/{args.run}") if p.is_dir())
        if len(found) != 1:
            print(
                f"horizonrl: run {args.run!r}: not a folder, and {len(found)} runs of that name under {args.data_dir}/",
                file=sys.stderr,
            )
            return 2
        run_dir = found[0]
    try:
        text = (
            episode_view.iteration_text(run_dir, args.iteration)
            if args.episode is None
            else episode_view.episode_text(run_dir, args.iteration, args.episode)
        )
    except ValueError as err:
        print(f"horizonrl: {err}", file=sys.stderr)
        return 2
    print(text)
    return 0


def _sweep(args: argparse.Namespace) -> int:
    from flows.sweep import sweep
    from horizonrl.config.sweep import load_sweep
    from horizonrl.run import preflight

    try:
        _, cells = load_sweep(args.sweep_file, args.instance)
    except ValueError as err:
        print(f"horizonrl: bad sweep: {err}", file=sys.stderr)
        return 2
    try:  # every cell before the first starts
        for cell in cells:
            preflight.check_start(cell.config, args.allow_change)
    except ValueError as err:
        print(f"horizonrl: sweep not started: cell {cell.run_name!r}: {err}", file=sys.stderr)
        return 2
    sweep(args.sweep_file, in_process=args.here, instance=args.instance, out=args.out, allow_change=args.allow_change)
    return 0


def _report(args: argparse.Namespace) -> int:
    from flows.sweep import sweep_report
    from horizonrl.config.sweep import instance_name, load_sweep
    from horizonrl.tracking.mlflow_runs import tracking_uri

    try:
        spec, cells = load_sweep(args.sweep_file, args.instance)
    except ValueError as err:
        print(f"horizonrl: bad sweep: {err}", file=sys.stderr)
        return 2
    sweep_report(
        instance_name(spec.name, args.instance),
        cells[0].config.experiment,
        tracking_uri(cells[0].config.tracking_uri),
        args.sweep_file,
        args.out,
    )
    return 0


def _study(args: argparse.Namespace) -> int:
    from pathlib import Path

    from horizonrl.config.sweep import load_sweep
    from horizonrl.tracking import mlflow_runs, study_page, study_record

    try:
        spec, cells = load_sweep(args.sweep_file)
    except ValueError as err:
        print(f"horizonrl: bad sweep: {err}", file=sys.stderr)
        return 2
    record, out = Path(args.record), Path(args.out)
    if not args.offline:
        c = mlflow_runs.client(mlflow_runs.tracking_uri(cells[0].config.tracking_uri))
        counts = study_record.export(cells, c, record)
        print(f"record: {record} ({', '.join(f'{name} {n} rows' for name, n in counts.items())})")
    elif not (record / study_record.OUTCOMES).is_file():
        print(f"horizonrl: no study record in {record} (run without --offline to write it)", file=sys.stderr)
        return 2
    study_page.write(record, out, study_page.meta(spec.name, args.sweep_file, args.record, args.out, spec.tuning))
    print(f"page: {out}")
    return 0


def _evaluate(args: argparse.Namespace) -> int:
    from flows.evaluate import (
        checked_policy,
        evaluate_policy,
        evaluation_config,
        evaluation_store,
        model_evaluation_config,
        one_line,
    )
    from horizonrl.tracking import mlflow_runs
    from tasks.run import OneLineErrors

    try:  # before the flow, so that bad input is one line, not a flow's traceback, and no run is created
        if args.source is not None and args.config is not None:
            raise ValueError("--config goes with --model; a --source plays with its own run's config")
        uri = evaluation_store(args.set)  # --set tracking_uri=... is where the source is and the run goes
        if args.source is not None and not mlflow_runs.store_exists(uri):
            raise ValueError(f"source {args.source!r}: the tracking store {uri} does not exist")
        c = mlflow_runs.client(uri)
        if args.model is not None:
            model_uri = None
            cfg = model_evaluation_config(c, args.model, args.config, args.split, args.n_tasks, args.samples, args.set)
        else:
            _, model_uri, cfg = evaluation_config(c, args.source, args.split, args.n_tasks, args.samples, args.set)
        checked_policy(cfg, model_uri, args.split)
    except ValueError as err:
        print(f"horizonrl: evaluate: {one_line(err)}", file=sys.stderr)
        return 2
    try:
        with OneLineErrors():
            evaluate_policy(
                args.source,
                args.split,
                args.n_tasks,
                args.samples,
                overrides=args.set,
                model=args.model,
                config_path=args.config,
            )
    except Exception as err:  # noqa: BLE001 - a run-time failure: one line; the MLflow run is marked FAILED
        print(f"horizonrl: evaluate failed: {one_line(err)} (its MLflow run is marked FAILED)", file=sys.stderr)
        return 1
    return 0


def _stop_temporary_server() -> None:
    """Stop Prefect's temporary API server of this process, if it started one, once the flow is done: else
    it stops at exit and its "Stopping temporary server" line follows the command's summary."""
    from prefect.settings import get_current_settings

    if get_current_settings().api.url:  # a server of its own (the stack's, PREFECT_API_URL): nothing to stop
        return
    from prefect.server.api.server import SubprocessASGIServer

    SubprocessASGIServer().stop()


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
            print(f"horizonrl: stack up: {err}", file=sys.stderr)
            return 1
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


_SWEEP_COMMANDS = {"sweep": _sweep, "report": _report, "evaluate": _evaluate, "stack": _stack}


def _add_audit_commands(sub: argparse._SubParsersAction) -> None:
    """``audit`` (the credit audit, its flags the fields of ``AuditConfig``) and ``audit-report`` (its page)."""
    from horizonrl.config import AuditConfig

    au = sub.add_parser(
        "audit",
        help="score every advantage estimator against Monte Carlo returns from the same states (credit audit)",
        description="The credit audit (docs/algorithms.md §8): play groups as training collects them, draw decision "
        "points, estimate A_MC = Q(s_t, a_t) - V(s_t) at each from continuations that replay the episode, and score "
        "every estimator of methods.ADVANTAGES against it, in an MLflow run of its own. The same command resumes it.",
    )
    au.add_argument(
        "--policy",
        help="a model folder, a pretrained model's name, models:/<name>/<version>, runs:/<run id>, or a run's "
        "checkpoint folder (data/<experiment>/<run>/checkpoints/iter=<n>: BLPO is then also audited warm, from the "
        "run's batches before it); default: the config's model",
    )
    au.add_argument("--config", help="the train config the policy plays by (default: the policy's run's config)")
    au.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a field of the config")
    au.add_argument("--name", help="the audit's name (default <policy>--audit-<env>-<tier>-s<seed>)")
    for field, info in AuditConfig.model_fields.items():
        about = " ".join(info.description.replace("``", "").replace("%", "%%").split())
        au.add_argument(f"--{field.replace('_', '-')}", type=info.annotation, help=f"{about} (default {info.default})")
    ar = sub.add_parser(
        "audit-report", help="write the credit audit's page from audit folders (generated, never typed)"
    )
    ar.add_argument("audits", nargs="*", help="audit folders (data/<experiment>/<name>); none: a page that says so")
    ar.add_argument("--out", default="docs/credit-audit.md", help="the page (default docs/credit-audit.md)")


def _audit(args: argparse.Namespace) -> int:
    from flows.audit import audit, audit_settings
    from flows.evaluate import one_line
    from horizonrl.config import AuditConfig
    from tasks.run import OneLineErrors

    given = {field: getattr(args, field) for field in AuditConfig.model_fields}
    try:  # before the flow: bad input is one line and no run is created
        cfg, settings, name = audit_settings(args.policy, args.config, args.set, given, args.name)
    except ValueError as err:
        print(f"horizonrl: audit: {one_line(err)}", file=sys.stderr)
        return 2
    try:
        with OneLineErrors():
            scores = audit(config=cfg.model_dump(), settings=settings.model_dump(), name=name, policy=args.policy)
    except Exception as err:  # noqa: BLE001 - a run-time failure: one line; the MLflow run is marked FAILED
        why = f"{one_line(err)} (its MLflow run is marked FAILED; the same command resumes it)"
        print(f"horizonrl: audit failed: {why}", file=sys.stderr)
        return 1
    print(f"\n== horizonrl: audit {name} finished: {scores['points']} decision points ==")
    print(f"noise ceiling {scores['noise_ceiling']['value']:.2f}; Spearman with A_MC:")
    for label in scores["order"]:
        e = scores["estimators"][label]["spearman"]
        print(f"  {label:24s} {e['value']:+.2f} [{e['low']:+.2f}, {e['high']:+.2f}]")
    print(f"data: {os.path.join(cfg.data_dir, cfg.experiment, name)}; page: horizonrl audit-report <that folder>")
    return 0


def _audit_report(args: argparse.Namespace) -> int:
    from pathlib import Path

    from horizonrl.audit.page import SCORES_FILE, write_page

    missing = [a for a in args.audits if not (Path(a) / SCORES_FILE).is_file()]
    if missing:
        print(f"horizonrl: audit-report: {missing[0]} holds no {SCORES_FILE} (not an audit folder, or the audit has "
              "not finished: run the same `horizonrl audit` again)", file=sys.stderr)  # fmt: skip
        return 2
    print(write_page([Path(a) for a in args.audits], Path(args.out)))
    return 0


_AUDIT_COMMANDS = {"audit": _audit, "audit-report": _audit_report}


if __name__ == "__main__":
    sys.exit(main())
