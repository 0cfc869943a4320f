"""Speed-up of ``EnvPool`` over stepping the same episodes one after another, measured side by side.

Both sides go through the rollout loop's interface (``InProcess`` and ``EnvPool``, one ``step_many`` per
turn) and play the same episodes (``episodes`` slots over the suite's first train tasks, as K rollouts
of each task) with the same action script: at each turn slot s plays admissible command number
``rng(s, turn) mod len(admissible)``, so both sides see identical states (checked). After one untimed
warm-up round (JVM start, game loading, worker start), rounds alternate sequential / pool and the
median of each is reported.

    python benchmarks/env_pool.py --suite scienceworld-boil --episodes 8 --turns 20 --workers 2
    python benchmarks/env_pool.py --suite textworld-cooking --tier medium
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from horizonrl.envs import make_suite
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
        results = envs.step_many({slot: _choice(slot, turn, info["admissible_commands"]) for slot, info in live.items()})
        for slot, (obs, _, done, info) in results.items():
            last[slot], live[slot] = obs, info
            if done or "error" in info:
                del live[slot]
    return reset_s, time.perf_counter() - start, last


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", default="scienceworld-boil")
    parser.add_argument("--tier", default="easy")
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=2, help="rollouts per task (K)")
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    suite = make_suite(args.suite, 0)
    distinct = suite.tasks("train", args.tier, -(-args.episodes // args.group_size))
    tasks = [distinct[i // args.group_size] for i in range(args.episodes)]
    if hasattr(suite, "prepare"):
        suite.prepare(distinct)  # TextWorld: generate the games before timing
    start = time.perf_counter()
    local = InProcess(suite)
    pool = EnvPool(args.suite, 0, n_workers=args.workers)
    *_, seq_last = play(local, tasks, args.turns)  # warm-up round, untimed
    *_, pool_last = play(pool, tasks, args.turns)
    warmup = time.perf_counter() - start
    assert seq_last == pool_last, "the pool and in-process stepping diverged"
    times: dict[str, list[tuple[float, float]]] = {"sequential": [], "pool": []}
    for _ in range(args.rounds):
        times["sequential"].append(play(local, tasks, args.turns)[:2])
        times["pool"].append(play(pool, tasks, args.turns)[:2])
    pool.close()
    local.close()
    print(f"suite={args.suite} tier={args.tier} episodes={args.episodes} turns={args.turns} workers={args.workers} "
          f"rounds={args.rounds} warm-up={warmup:.1f}s (median of rounds; reset + steps)")
    med = {side: [statistics.median(t[i] for t in rounds) for i in (0, 1)] for side, rounds in times.items()}
    for side in ("sequential", "pool"):
        print(f"{side:<11} total {sum(med[side]):6.2f}s  reset {med[side][0]:6.2f}s  steps {med[side][1]:6.2f}s")
    print(f"speed-up:   total {sum(med['sequential']) / sum(med['pool']):.2f}x  steps {med['sequential'][1] / med['pool'][1]:.2f}x")


if __name__ == "__main__":
    main()
