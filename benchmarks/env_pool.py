"""Speed-up of ``EnvPool`` over stepping the same episodes one after another, measured side by side.

Both sides play the same episodes (``episodes`` slots over the suite's first train tasks, as K rollouts
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
from horizonrl.envs.pool import EnvPool
from horizonrl.seeding import derive_seed


def _choice(slot: int, turn: int, commands: list[str]) -> str:
    return commands[random.Random(derive_seed(0, "bench", slot, turn)).randrange(len(commands))] if commands else "look"


def sequential(envs: list, tasks: list, turns: int) -> tuple[float, list[str]]:
    """Reset and step every episode in this process, one after another; (seconds, last observations)."""
    start = time.perf_counter()
    states = [env.reset(task) for env, task in zip(envs, tasks)]
    last, live = [obs for obs, _ in states], {slot: info for slot, (_, info) in enumerate(states)}
    for turn in range(turns):
        for slot, info in list(live.items()):
            obs, _, done, info = envs[slot].step(_choice(slot, turn, info["admissible_commands"]))
            last[slot], live[slot] = obs, info
            if done:
                del live[slot]
    return time.perf_counter() - start, last


def pooled(pool: EnvPool, tasks: list, turns: int) -> tuple[float, list[str]]:
    """The same episodes through the pool: one ``step_many`` per turn."""
    start = time.perf_counter()
    states = pool.reset_many(tasks)
    last, live = [obs for obs, _ in states], {slot: info for slot, (_, info) in enumerate(states)}
    for turn in range(turns):
        results = pool.step_many({slot: _choice(slot, turn, info["admissible_commands"]) for slot, info in live.items()})
        for slot, (obs, _, done, info) in results.items():
            last[slot], live[slot] = obs, info
            if done:
                del live[slot]
    return time.perf_counter() - start, last


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
    envs = [suite.make() for _ in tasks]
    start = time.perf_counter()
    pool = EnvPool(args.suite, 0, n_workers=args.workers)
    _, seq_last = sequential(envs, tasks, args.turns)  # warm-up round, untimed
    _, pool_last = pooled(pool, tasks, args.turns)
    warmup = time.perf_counter() - start
    assert seq_last == pool_last, "the pool and in-process stepping diverged"
    times: dict[str, list[float]] = {"sequential": [], "pool": []}
    for _ in range(args.rounds):
        times["sequential"].append(sequential(envs, tasks, args.turns)[0])
        times["pool"].append(pooled(pool, tasks, args.turns)[0])
    pool.close()
    for env in envs:
        env.close()
    seq, par = statistics.median(times["sequential"]), statistics.median(times["pool"])
    print(f"suite={args.suite} tier={args.tier} episodes={args.episodes} turns={args.turns} workers={args.workers} "
          f"rounds={args.rounds} warm-up={warmup:.1f}s")
    print(f"sequential: {seq:.2f}s  ({', '.join(f'{t:.2f}' for t in times['sequential'])})")
    print(f"pool:       {par:.2f}s  ({', '.join(f'{t:.2f}' for t in times['pool'])})")
    print(f"speed-up:   {seq / par:.2f}x")


if __name__ == "__main__":
    main()
