"""Speed-up of ``EnvPool`` over stepping the same episodes one after another, measured side by side.

Both sides go through the rollout loop's interface (``InProcess`` and ``EnvPool``, one ``step_many`` per
turn) and play the same episodes (``episodes`` slots over the suite's first train tasks, as K rollouts
of each task) with the same action script: at each turn slot s plays admissible command number
``rng(s, turn) mod len(admissible)``, so both sides see identical states (checked). After one untimed
warm-up round (JVM start, game loading, worker start), rounds alternate sequential / pool and the
median of each is reported, and each round's ratio, so a trend (a JIT still compiling) shows.
``--warmup-rounds`` adds untimed rounds: ScienceWorld's JVMs compile their hot code in background
threads for the first few hundred steps, and those threads use the spare core even in the sequential
side, so early rounds understate what the pool gains once the JVMs are warm, as they are in training
(the pool keeps its workers' environments across iterations).

With ``--overlap``, the same pool then plays full ``collect`` rounds with the tiny model (the run's
default, built under ``data/``) and the default rollout settings, without and with ``rollout.overlap``,
alternating after one untimed round each, and reports the median of each and their ratio. Both sides
play the same tasks and rollouts; the sampled actions differ (overlap changes the engine batches), so
episode lengths may too. ``--gen-latency-ms`` adds idle waiting to every engine call, standing in for
generation on a GPU or a vLLM server, where the CPU is free while the policy samples: the case overlap
is for (on this CPU alone, generation and the workers compete for the same cores).

    python benchmarks/env_pool.py --suite scienceworld-boil --episodes 8 --turns 20 --workers 2
    python benchmarks/env_pool.py --suite textworld-cooking --tier medium
    python benchmarks/env_pool.py --suite household --turns 10 --overlap
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from horizonrl.config import EnvConfig, TrainConfig
from horizonrl.envs import make_suite
from horizonrl.envs.base import Task
from horizonrl.envs.batch import EpisodeBatch, InProcess
from horizonrl.envs.pool import EnvPool
from horizonrl.seeding import derive_seed


def _choice(slot: int, turn: int, commands: list[str]) -> str:
    return commands[random.Random(derive_seed(0, "bench", slot, turn)).randrange(len(commands))] if commands else "look"


def play(envs: EpisodeBatch, tasks: list, turns: int) -> tuple[float, float, list[str]]:
    """Reset and step every episode through ``envs`` as the rollout loop does (one ``step_many`` per
    turn); (reset seconds, step seconds, last observations)."""
    start = time.perf_counter()
    states = envs.reset_many(tasks)
    reset_s = time.perf_counter() - start
    last, live = [obs for obs, _ in states], {slot: info for slot, (_, info) in enumerate(states)}
    start = time.perf_counter()
    for turn in range(turns):
        results = envs.step_many(
            {slot: _choice(slot, turn, info["admissible_commands"]) for slot, info in live.items()}
        )
        for slot, (obs, _, done, info) in results.items():
            last[slot], live[slot] = obs, info
            if done or "error" in info:
                del live[slot]
    return reset_s, time.perf_counter() - start, last


class _RemoteLatency:
    """The engine, plus ``latency_s`` of idle waiting per call: a stand-in for generation that runs off
    this CPU (a GPU, a vLLM server), which is what overlap is for. Samples are the wrapped engine's."""

    def __init__(self, engine: Any, latency_s: float) -> None:
        self.engine, self.latency_s = engine, latency_s

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        time.sleep(self.latency_s)
        return self.engine.generate(*args, **kwargs)

    def session(self) -> _RemoteLatency:
        return _RemoteLatency(self.engine.session(), self.latency_s)

    def extend(self, *args: Any, **kwargs: Any) -> Any:
        time.sleep(self.latency_s)
        return self.engine.extend(*args, **kwargs)


def compare_overlap(pool: EnvPool, tasks: list[Task], args: argparse.Namespace) -> None:
    """Median seconds of full ``collect`` rounds through ``pool``, overlap off and on, side by side."""
    from dataclasses import replace

    from horizonrl.engines.hf import TransformersEngine
    from horizonrl.models.loading import load_policy
    from horizonrl.rollout.loop import SamplingSettings, collect
    from horizonrl.rollout.prompting import ChatFormat
    from horizonrl.run.learner import initial_model_dir

    cfg = TrainConfig(env=EnvConfig(name=args.suite, tier=args.tier, max_turns=args.turns))
    suite = make_suite(cfg.env.name, cfg.env.suite_seed, cfg.env.games, cfg.data_dir)
    model, tokenizer = load_policy(initial_model_dir(cfg, suite))
    fmt = ChatFormat.for_tokenizer(tokenizer)
    engine = TransformersEngine(model, tokenizer.pad_token_id, [fmt.end_id, tokenizer.eos_token_id])
    if args.gen_latency_ms:
        engine = _RemoteLatency(engine, args.gen_latency_ms / 1000)
    sampling = SamplingSettings.from_config(cfg, suite, 0)

    def seconds(overlap: bool) -> float:
        start = time.perf_counter()
        collect(pool, tasks, args.group_size, engine, fmt, replace(sampling, overlap=overlap))
        return time.perf_counter() - start

    seconds(False), seconds(True)  # warm-up, untimed
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.rounds):
        for overlap in (False, True):
            times[overlap].append(seconds(overlap))
    off, on = statistics.median(times[False]), statistics.median(times[True])
    latency = f", +{args.gen_latency_ms:g} ms idle per engine call" if args.gen_latency_ms else ""
    print(
        f"collect: {len(tasks) * args.group_size} episodes, tiny model{latency}, {args.workers} workers, at most "
        f"{args.turns} turns "
        f"(median of rounds)"
    )
    print(f"no overlap  {off:6.2f}s\noverlap     {on:6.2f}s\nspeed-up:   {off / on:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", default="scienceworld-boil")
    parser.add_argument("--tier", default="easy")
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=2, help="rollouts per task (K)")
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup-rounds", type=int, default=1, help="untimed rounds on each side first")
    parser.add_argument(
        "--overlap", action="store_true", help="also time full collect with the tiny model, overlap off and on"
    )
    parser.add_argument(
        "--gen-latency-ms",
        type=float,
        default=0.0,
        help="with --overlap: idle milliseconds added to each engine call, standing in for generation off this CPU",
    )
    args = parser.parse_args()

    suite = make_suite(args.suite, 0)
    distinct = suite.tasks("train", args.tier, -(-args.episodes // args.group_size))
    tasks = [distinct[i // args.group_size] for i in range(args.episodes)]
    if hasattr(suite, "prepare"):
        suite.prepare(distinct)  # TextWorld: generate the games before timing
    start = time.perf_counter()
    local = InProcess(suite)
    pool = EnvPool(args.suite, 0, n_workers=args.workers)
    for _ in range(args.warmup_rounds):
        *_, seq_last = play(local, tasks, args.turns)
        *_, pool_last = play(pool, tasks, args.turns)
    warmup = time.perf_counter() - start
    assert seq_last == pool_last, "the pool and in-process stepping diverged"
    times: dict[str, list[tuple[float, float]]] = {"sequential": [], "pool": []}
    for _ in range(args.rounds):
        times["sequential"].append(play(local, tasks, args.turns)[:2])
        times["pool"].append(play(pool, tasks, args.turns)[:2])
    local.close()
    print(
        f"suite={args.suite} tier={args.tier} episodes={args.episodes} turns={args.turns} workers={args.workers} "
        f"rounds={args.rounds} warm-up rounds={args.warmup_rounds} ({warmup:.1f}s) (median of rounds; reset + steps)"
    )
    print("per round:   " + "  ".join(f"{sum(s) / sum(p):.2f}x" for s, p in zip(times["sequential"], times["pool"])))
    med = {side: [statistics.median(t[i] for t in rounds) for i in (0, 1)] for side, rounds in times.items()}
    for side in ("sequential", "pool"):
        print(f"{side:<11} total {sum(med[side]):6.2f}s  reset {med[side][0]:6.2f}s  steps {med[side][1]:6.2f}s")
    print(
        f"speed-up:   total {sum(med['sequential']) / sum(med['pool']):.2f}x  steps "
        f"{med['sequential'][1] / med['pool'][1]:.2f}x"
    )
    if args.overlap:
        compare_overlap(pool, distinct, args)
    pool.close()


if __name__ == "__main__":
    main()
