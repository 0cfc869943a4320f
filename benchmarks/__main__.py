"""The benchmark suite of issue 8: every figure with its target, as one table.

    python -m benchmarks            # full sizes (about 7 minutes on 2 idle CPU cores)
    python -m benchmarks --publish docs/benchmarks.md   # the same, and the table written into that page (make bench)
    python -m benchmarks --quick    # tiny sizes, a smoke run of every section (the test runs this)

Targets are ratios measured side by side in one run, so that they hold on a noisy shared machine.
Outputs go to ``--out`` (default benchmarks/out/, ignored by git): figures.json, figures.csv, the
benchmark train run's log, data and MLflow store. The figures are also logged as one run of the
``benchmarks`` MLflow experiment in the project's store (``MLFLOW_TRACKING_URI`` or ./mlflow).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from benchmarks import advantages, async_rollouts, pipeline, real, rollout, store, update, vllm_server
from benchmarks.report import Figure, log_mlflow, publish, save, table
from horizonrl.config import load_config

CONFIG = "configs/loop_household_easy.yaml"
SECTIONS = (
    ("advantages", "store", "rollout", "update", "pipeline", "async")
    + (("vllm",) if vllm_server.available() else ())
    + (("real",) if real.available() else ())
)
SIZES = {  # full, quick
    "adv_rows": (1_000_000, 20_000),
    "adv_groups": (100_000, 2_000),
    "memory_keys": (100_000, 2_000),
    "store_rows": (1_000_000, 20_000),
    "rollout_tasks": (8, 2),
    "rollout_group": (8, 2),
    "update_tasks": (16, 2),
    "update_group": (8, 2),
    "pipeline_iterations": (2, 1),
    "async_iterations": (3, 2),
    "async_tasks": (8, 2),
    "async_group": (8, 2),
    "vllm_tasks": (8, 2),
    "vllm_group": (8, 2),
    "real_tasks": (2, 1),
    "real_group": (2, 2),
    "real_iterations": (3, 2),
}
QUICK_RUN = [
    "env.max_turns=3",
    "rollout.tasks_per_iteration=2",
    "rollout.group_size=2",
    "update.minibatch_size=2",
    "eval.n_tasks=2",
    "eval.n_tasks_ends=2",  # the main config evaluates 1000 tasks at the run's two ends
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="tiny sizes: checks that every section runs, measures nothing"
    )
    parser.add_argument("--out", default="benchmarks/out", help="output folder (default benchmarks/out)")
    parser.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS), help="run these sections only")
    parser.add_argument("--no-mlflow", action="store_true", help="do not log the figures to MLflow")
    parser.add_argument(
        "--gen-latency-ms",
        type=float,
        default=50.0,
        help="async section: idle ms per engine call standing in for a GPU generator (default 50)",
    )
    parser.add_argument(
        "--publish",
        metavar="PAGE",
        help="write the table into PAGE's benchmark block (make bench: docs/benchmarks.md); full sizes, every section",
    )
    args = parser.parse_args(argv)
    if args.publish and (args.quick or sorted(args.only) != sorted(SECTIONS)):
        parser.error("--publish needs full sizes and every section (no --quick, no --only)")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    n = {k: v[1] if args.quick else v[0] for k, v in SIZES.items()}
    out = Path(args.out)
    extra = QUICK_RUN if args.quick else []
    cfg = load_config(CONFIG, [*extra, f"data_dir={out / 'data'}"])
    figures: list[Figure] = []
    seconds: dict[str, float] = {}
    for section in args.only:
        t0 = time.perf_counter()
        if section == "advantages":
            figures += advantages.run(n["adv_rows"], n["adv_groups"], n["memory_keys"])
        elif section == "store":
            figures += store.run(n["store_rows"])
        elif section == "rollout":
            figures += rollout.run(cfg, n["rollout_tasks"], n["rollout_group"])
        elif section == "update":
            figures += update.run(cfg, n["update_tasks"], n["update_group"])
        elif section == "async":
            figures += async_rollouts.run(
                cfg, n["async_iterations"], n["async_tasks"], n["async_group"], args.gen_latency_ms
            )
        elif section == "vllm":
            figures += vllm_server.run(cfg, n["vllm_tasks"], n["vllm_group"], out / "vllm")
        elif section == "real":
            figures += real.run(cfg, n["real_tasks"], n["real_group"], n["real_iterations"], out / "real")
        else:
            figures += pipeline.run(CONFIG, [*extra, f"iterations={n['pipeline_iterations']}"], out / "pipeline")
        seconds[section] = time.perf_counter() - t0
        print(f"[{section}: {seconds[section]:.0f} s]", flush=True)
    suite_s = sum(s for section, s in seconds.items() if section != "real")
    passed = None if args.quick else suite_s < 600
    figures.append(Figure("suite/seconds", suite_s, "s", "< 600", passed, "every section but real: the tiny model"))
    if "real" in seconds:  # a 135 M-parameter model's compute: reported, outside the 10-minute budget
        figures.append(Figure("real/section_s", seconds["real"], "s", "", None, "the real section alone"))
    print(table(figures))
    params = {"quick": args.quick, "sections": ",".join(args.only), **n}
    files = save(figures, out, params)
    if args.publish:
        publish(figures, params, Path(args.publish))
    if not args.no_mlflow:
        print(f"MLflow run {log_mlflow(figures, params, files)} in experiment 'benchmarks'")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
