"""``horizonrl`` command line: local runs of the flows with progress on the terminal."""

from __future__ import annotations

import argparse
import os
import sys


def _env_defaults() -> None:
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Prefect's temporary API server needs ~19 s on a fresh 2-core machine; its default wait is 20 s.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")


def main(argv: list[str] | None = None) -> int:
    _env_defaults()
    parser = argparse.ArgumentParser(prog="horizonrl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    tr = sub.add_parser("train", help="train one method (runs the Prefect 'train' flow)")
    tr.add_argument("--config", help="YAML config file")
    tr.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field, e.g. method=grpo")
    rc = sub.add_parser("recompute", help="compute a method's advantages over a stored run, without new rollouts")
    rc.add_argument("--run-dir", required=True, help="data/<experiment>/<run_name>")
    rc.add_argument("--method", required=True, help="method (loop, grpo, gigpo, blpo, ...) or estimator name")
    rc.add_argument("--param", action="append", default=[], metavar="KEY=VALUE", help="estimator parameter override")
    args = parser.parse_args(argv)
    if args.command == "recompute":
        return _recompute(args)

    from horizonrl.config import load_config

    try:
        cfg = load_config(args.config, args.set)
    except ValueError as err:
        print(f"horizonrl: bad configuration: {err}", file=sys.stderr)
        return 2
    if args.command == "train":
        from flows.train import train
        from horizonrl.tracking import tracking_uri

        summary = train(config=cfg.model_dump())
        uri = tracking_uri(cfg.tracking_uri)
        print("\n== horizonrl: run finished ==")
        print(f"held-out success (sampled, {cfg.eval.n_tasks} tasks): {summary['initial_success_rate']:.3f} -> {summary['final_success_rate']:.3f} "
              f"({summary['improvement'] * 100:+.1f} points) after {int(summary['iterations'])} iterations")
        print(f"MLflow: experiment {cfg.experiment!r}, run {cfg.run_name!r}; open the UI with: mlflow ui --backend-store-uri {uri} --host 127.0.0.1")
        print(f"data: {os.path.join(cfg.data_dir, cfg.experiment, cfg.run_name)}")
    return 0


def _recompute(args: argparse.Namespace) -> int:
    import yaml

    from flows.recompute import recompute_advantages
    from horizonrl.config import METHODS
    import methods

    name = METHODS[args.method].advantage if args.method in METHODS else args.method
    if name not in methods.ADVANTAGES:
        print(f"horizonrl: --method {args.method!r} is neither a method ({', '.join(sorted(METHODS))}) nor an estimator", file=sys.stderr)
        return 2
    params = {k: yaml.safe_load(v) for k, v in (p.split("=", 1) for p in args.param)}
    written = recompute_advantages(args.run_dir, args.method, params)
    for it, path in sorted(written.items()):
        print(f"iteration {it}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
