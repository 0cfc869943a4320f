"""Target 2: the PPO update against a bare forward-and-backward loop, same model, same token count.

The rows are one iteration of the main run (``tasks x group`` full-context episodes of the initial
policy), with random advantages, all kept: an untrained policy rarely wins, so its LOO advantages are
mostly filtered out, and the update's cost does not depend on the values. The PPO side is the whole
``ppo_update`` call as the flow makes it: the rows were sampled by these weights in this process, so pi_old
is their stored sampling log-probs after the check on a sample of rows (horizonrl/training/trainer.py; a failed
check recomputes every row, and counts in the time); its tokens are epochs x the real tokens of the rows. The bare side
runs the same real tokens, cut into equal-length rows with no padding, through
``model(...)`` with a next-token cross-entropy, backward, clipping and one AdamW step per minibatch.

The decoder layouts (``update.packing``: padded buckets, packed rows, the prefix-shared tree) are compared
side by side on the same rows, and on an APPO batch: half as many tasks, each group's rollouts and as many
branches (which share their parent's tokens up to the branch point).
"""

from __future__ import annotations

import copy
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
import torch.nn.functional as F

from benchmarks.report import Figure
from horizonrl import store
from horizonrl.config import TrainConfig
from horizonrl.engines.hf import TransformersEngine
from horizonrl.envs import make_suite
from horizonrl.models.loading import load_policy
from horizonrl.rollout.branching import collect_branches, plan_branches
from horizonrl.rollout.loop import SamplingSettings, collect
from horizonrl.rollout.prompting import ChatFormat
from horizonrl.rollout.records import EpisodeRecord
from horizonrl.run.learner import initial_model_dir
from horizonrl.training.checkpoint import CheckpointRef
from horizonrl.training.rank_group import RankGroup
from horizonrl.training.sequences import TrainRow, attach_advantages, train_rows
from horizonrl.training.trainer import PI_OLD_CHECK_ROWS, UpdateSettings, ppo_update


def _rows(
    cfg: TrainConfig, model: torch.nn.Module, tokenizer, tasks_n: int, group: int, branches: bool = False
) -> list[TrainRow]:
    """``tasks_n`` x ``group`` rollouts of the initial policy (with ``branches``, also ``group`` APPO
    branches per task, planned as APPO plans them) as training rows with random advantages."""
    suite = make_suite(cfg.env.name, cfg.env.suite_seed, cfg.env.games, cfg.data_dir)
    fmt = ChatFormat.for_tokenizer(tokenizer)
    engine = TransformersEngine(model, tokenizer.pad_token_id, [fmt.end_id, tokenizer.eos_token_id])
    sampling = SamplingSettings.from_config(cfg, suite, 0)
    records = collect(suite, suite.tasks("train", cfg.env.tier, tasks_n), group, engine, fmt, sampling)
    if branches:
        starts, _, _ = plan_branches(records, group, cfg.branching(), tokenizer)
        records += collect_branches(suite, starts, engine, fmt, sampling, first_rollout_id=len(records))
    return random_advantage_rows(records, cfg.rollout.context)


def random_advantage_rows(records: list[EpisodeRecord], context: str) -> list[TrainRow]:
    """Played ``records`` as training rows with fixed random advantages, every turn kept: the update's cost
    does not depend on the values, and an untrained policy's own advantages would filter most rows out."""
    turns = store.turns_table(records)
    n = turns.num_rows
    adv = pa.table(
        {
            "rollout_id": turns["rollout_id"],
            "turn": turns["turn"],
            "adv": np.random.default_rng(0).normal(size=n),
            "keep": np.ones(n, bool),
            "adv_tokens": pa.nulls(n, pa.list_(pa.float64())),
        },
        schema=store.ADVANTAGES,
    )
    return attach_advantages(train_rows(turns, context), adv)


def bare_loop(
    model: torch.nn.Module,
    rows: list[TrainRow],
    epochs: int,
    steps: int,
    lr: float,
    clip: float,
    micro_batch_tokens: int | None = None,
) -> tuple[int, float]:
    """Forward, backward and an AdamW step over the rows' real tokens (cut after the last policy
    token, as the update does), packed into equal rows; returns (tokens, seconds). ``micro_batch_tokens``:
    each step's gradient accumulated over forward passes of at most that many tokens, as the update's
    ``update.micro_batch_tokens`` bounds its own (None: one pass per step), so that the two hold the
    same activations at once and differ by the update's own work alone."""
    stream = [t for r in rows for t in r.input_ids[: r.positions[-1] + 1]]
    width = round(len(stream) / len(rows))
    batch = torch.tensor(stream[: len(stream) // width * width]).view(-1, width)  # (rows, width)
    per_pass = max(1, micro_batch_tokens // width) if micro_batch_tokens else len(batch)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    t0 = time.perf_counter()
    for _ in range(epochs):
        for part in torch.tensor_split(batch, steps):
            for micro in part.split(per_pass):
                logits = model(input_ids=micro).logits  # (micro rows, width, vocab)
                loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), micro[:, 1:].flatten())
                (loss * len(micro) / len(part)).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return epochs * batch.numel(), time.perf_counter() - t0


def run(cfg: TrainConfig, tasks_n: int, group: int, rounds: int = 2) -> list[Figure]:
    """``rounds`` PPO updates and bare loops, in the order P B B P ..., each from the initial weights;
    the ratio is of summed tokens over summed time (the alternation cancels drifting machine load)."""
    policy_dir = initial_model_dir(cfg, make_suite(cfg.env.name, cfg.env.suite_seed, cfg.env.games, cfg.data_dir))
    initial, tokenizer = load_policy(policy_dir)
    rows = _rows(cfg, initial, tokenizer, tasks_n, group)
    s = UpdateSettings.from_config(cfg, tokenizer.pad_token_id, sampled_here=True)
    real = sum(r.positions[-1] + 1 for r in rows)
    ppo_s = bare_s = 0.0
    bare_tokens = 0
    for k in range(2 * rounds):
        model = copy.deepcopy(initial)
        if (k % 4) in (0, 3):
            optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.update.lr, weight_decay=cfg.update.weight_decay)
            t0 = time.perf_counter()
            result = ppo_update(model, optimizer, rows, s, seed=0)
            ppo_s += time.perf_counter() - t0
        else:
            steps_per_epoch = -(-len(rows) // s.minibatch_size)  # full context: one row per trajectory
            tokens, seconds = bare_loop(model, rows, s.epochs, steps_per_epoch, cfg.update.lr, s.grad_clip)
            bare_tokens, bare_s = bare_tokens + tokens, bare_s + seconds
    ppo_tps, bare_tps = rounds * s.epochs * real / ppo_s, bare_tokens / bare_s
    parallel = data_parallel(cfg, policy_dir, rows, s, 2, ("ddp", "fsdp"))
    pad = result.stats["pad_fraction"]
    appo_cfg = cfg.model_copy(update={"method": "appo"})
    loop_l = layouts(initial, rows, s, cfg.update.lr)
    appo_l = layouts(
        initial, _rows(appo_cfg, initial, tokenizer, max(tasks_n // 2, 1), group, branches=True), s, cfg.update.lr
    )
    pi_old = "stored sampling log-probs" if result.stats["pi_old_shortcut"] else "recomputed (check failed)"
    return [
        Figure(
            "update/ppo_tokens_s",
            ppo_tps,
            "tok/s",
            "",
            None,
            f"{len(rows)} rows, {real:,} tokens x {s.epochs} epochs x {rounds} rounds, {ppo_s:.1f} s (pi_old: "
            f"{pi_old}; update.packing {s.packing})",
        ),
        Figure(
            "update/vs_bare_loop",
            ppo_tps / bare_tps,
            "x",
            ">= 0.95",
            ppo_tps / bare_tps >= 0.95,
            f"bare forward+backward: {bare_tps:,.0f} tok/s",
        ),
        *(
            Figure(
                f"update/{name}_tokens_s",
                dp_tps,
                "tok/s",
                "",
                None,
                f"update.world_size 2, strategy {strategy} (torchrun, gloo): {dp_tps / one_tps:.2f}x world_size 1 "
                f"alternated with it ({one_tps:,.0f} tok/s, {torch.get_num_threads()} threads; ranks 1 each); "
                f"collectives {dp['comm_share']:.0%} of a rank's update; information only",
            )
            for name, strategy in (("dp2", "ddp"), ("fsdp2", "fsdp"))
            for dp_tps, one_tps, dp in [parallel[strategy]]
        ),
        Figure("update/padding", pad, "frac", "<= 0.10", pad <= 0.10, "padded share of computed decoder positions"),
        *layout_figures(loop_l, appo_l, bare_tps),
        Figure(
            "update/pi_old_max_diff",
            result.stats["pi_old_max_diff"],
            "nats",
            f"<= {s.pi_old_tol:g}",
            result.stats["pi_old_max_diff"] <= s.pi_old_tol,
            f"max |stored sampling log-prob - learner's| on the {PI_OLD_CHECK_ROWS} checked rows (above: pi_old "
            "recomputed, update.pi_old_tol)",
        ),
    ]


def data_parallel(
    cfg: TrainConfig,
    policy_dir: object,
    rows: list[TrainRow],
    s: UpdateSettings,
    world_size: int,
    strategies: tuple[str, ...],
    rounds: int = 2,
) -> dict[str, tuple[float, float, dict[str, float]]]:
    """The update on ``world_size`` ranks (``update.world_size``) with each of ``strategies``
    (``update.strategy``) against the same update in this process, alternated (R P P R ...) so that both
    see the same machine load: {strategy: (ranks' tokens/s, this process's tokens/s, the ranks' last
    figures)}. One rank group serves every strategy; a first job per strategy loads the ranks' model and
    is not timed, nor is the ranks' start. The ranks run one thread each (torchrun's default with several
    ranks); this process its usual number."""
    group = RankGroup(Path(cfg.data_dir) / "bench-ranks", world_size, "gloo")
    tokens = s.epochs * sum(r.positions[-1] + 1 for r in rows)
    job = dict(rows=rows, settings=s, seed=0, lr=cfg.update.lr, weight_decay=cfg.update.weight_decay, model=cfg.model)
    initial, _ = load_policy(policy_dir)
    out: dict[str, tuple[float, float, dict[str, float]]] = {}
    try:
        for strategy in strategies:
            group.update(policy=str(policy_dir), iteration=0, strategy=strategy, **job)
            dp_s = one_s = 0.0
            for k in range(2 * rounds):
                if (k % 4) in (0, 3):
                    group.advance(CheckpointRef("ranks", k))
                    t0 = time.perf_counter()
                    last = group.update(policy="ranks", iteration=1, strategy=strategy, **job)
                    dp_s += time.perf_counter() - t0
                else:
                    model = copy.deepcopy(initial)
                    optimizer = torch.optim.AdamW(
                        model.parameters(), lr=cfg.update.lr, weight_decay=cfg.update.weight_decay
                    )
                    t0 = time.perf_counter()
                    ppo_update(model, optimizer, rows, s, seed=0)
                    one_s += time.perf_counter() - t0
            out[strategy] = (rounds * tokens / dp_s, rounds * tokens / one_s, last["stats"])
    finally:
        group.stop()
    return out


LAYOUTS = ("off", "packed", "tree")  # update.packing


def layouts(
    initial: torch.nn.Module, rows: list[TrainRow], s: UpdateSettings, lr: float
) -> dict[str, tuple[float, dict[str, float], list[torch.Tensor]]]:
    """``ppo_update`` on ``rows`` with each decoder layout (``update.packing``), in the order A B C C B A
    from the initial weights: {layout: (real tokens/s, the last update's figures, its final weights)}."""
    tokens = s.epochs * sum(r.positions[-1] + 1 for r in rows)
    seconds = dict.fromkeys(LAYOUTS, 0.0)
    out = {}
    for name in (*LAYOUTS, *reversed(LAYOUTS)):
        model = copy.deepcopy(initial)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        t0 = time.perf_counter()
        stats = ppo_update(model, optimizer, rows, replace(s, packing=name), seed=0).stats
        seconds[name] += time.perf_counter() - t0
        out[name] = (0.0, stats, [p.detach().clone() for p in model.parameters()])
    return {k: (2 * tokens / seconds[k], *v[1:]) for k, v in out.items()}


def layout_figures(loop: dict, appo: dict, bare_tps: float) -> list[Figure]:
    """Packed and tree against padded on the LOOP and the APPO batch, each layout against the bare loop,
    the tree's computed positions per unique token, and the weights' largest difference from padded."""
    figures = []
    for batch, res in (("loop", loop), ("appo", appo)):
        padded = res["off"]
        drift = max(float((a - b).abs().max()) for k in ("packed", "tree") for a, b in zip(res[k][2], padded[2]))
        figures.append(
            Figure(
                f"update/{batch}_tokens_computed_per_unique",
                padded[1]["tokens_computed_per_unique"],
                "x",
                "",
                None,
                f"padded layout, decoder positions per unique token (shared prefixes once; per decoder call); packed "
                f"{res['packed'][1]['tokens_computed_per_unique']:.3f}, tree "
                f"{res['tree'][1]['tokens_computed_per_unique']:.3f}",
            )
        )
        for name, target in (("packed", 1.0), ("tree", 1.1 if batch == "loop" else 1.2)):
            ratio = res[name][0] / padded[0]
            figures.append(
                Figure(
                    f"update/{batch}_{name}_vs_padded",
                    ratio,
                    "x",
                    f">= {target:g}",
                    ratio >= target,
                    f"update.packing {name}: {res[name][0]:,.0f} tok/s against padded {padded[0]:,.0f}"
                    + (f" ({res[name][0] / bare_tps:.3f}x the bare loop)" if batch == "loop" else "")
                    + "; "
                    + f"weights after the update within {drift:.1e} of padded's",
                )
            )
    return figures
