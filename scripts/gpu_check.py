"""GPU check: a ~0.5 B-parameter Qwen2 (Qwen2.5-0.5B's shape, random weights built from a config, no
download) runs rollouts through the transformers engine and one PPO update on one CUDA GPU, and prints
generation and training throughput; then the real model, SmolLM2-135M-Instruct in bfloat16, is served by
vLLM's CUDA build beside the learner (``real_model_check``). Sized to finish within 8 minutes on one recent GPU.

    .venv/bin/python scripts/gpu_check.py [--episodes 64] [--lora-rank 0] [--real-model DIR]

It checks the path the CPU tests cannot: bf16 weights, SDPA attention, the engine's KV cache and
sampling on the device, the learner's forward/backward there, and a vLLM server on the same GPU: its
sampling log-probs against the learner's (parity), one training iteration on its episodes, the new weights
reloaded into it in place (verified by the probe), and parity again on the new weights. On a machine
without CUDA it stops with a message and exit status 2. The first part's numbers are for random weights
(actions are constrained to admissible commands, so episodes and token counts are realistic in shape, not
in success). The real model is ``--real-model``, else as the benchmark's ``real`` section finds it
(``benchmarks.real.model_dir``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DEADLINE_S = 8 * 60


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes", type=int, default=64, help="rollouts collected (tasks x 4), the generation batch")
    ap.add_argument(
        "--lora-rank", type=int, default=0, help="train LoRA adapters of this rank instead of all weights (0: full)"
    )
    ap.add_argument("--real-model", help="SmolLM2's converted folder (default: as benchmarks/real.py finds it)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print(
            "gpu_check needs a CUDA GPU and a CUDA build of torch; this machine has none (torch.cuda.is_available() "
            "is False).\n"
            "The CPU paths are covered by `make test`; see docs/deploy.md, 'GPU'.",
            file=sys.stderr,
        )
        return 2

    from transformers import Qwen2Config, Qwen2ForCausalLM

    import methods
    from horizonrl import store
    from horizonrl.config import LoraConfig, ModelConfig
    from horizonrl.engines.base import SampleRequest
    from horizonrl.engines.hf import TransformersEngine
    from horizonrl.envs.household import HouseholdSuite
    from horizonrl.models.loading import resolve_dtype
    from horizonrl.models.lora import attach
    from horizonrl.models.tokenizers import train_word_tokenizer
    from horizonrl.rollout.loop import SamplingSettings, collect
    from horizonrl.rollout.prompting import ChatFormat
    from horizonrl.training.sequences import train_rows
    from horizonrl.training.trainer import UpdateSettings, ppo_update

    t_start = time.perf_counter()
    device = torch.device("cuda")
    dtype = resolve_dtype(ModelConfig().dtype, device)  # the config's default: bf16 on CUDA
    print(f"device {torch.cuda.get_device_name(0)}, torch {torch.__version__}, dtype {dtype}, attention sdpa")

    suite = HouseholdSuite(0)
    tokenizer = train_word_tokenizer(suite.corpus(200))
    fmt = ChatFormat.for_tokenizer(tokenizer)
    config = Qwen2Config(  # Qwen2.5-0.5B's architecture; the vocabulary stays full size for a realistic LM head
        vocab_size=151_936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32_768,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(dtype)
    if args.lora_rank:
        model = attach(model, LoraConfig(rank=args.lora_rank, alpha=2.0 * args.lora_rank), seed=0)
    n_params = sum(p.numel() for p in model.parameters())
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(
        f"model: {n_params / 1e9:.3f} B parameters ({n_train / 1e6:.1f} M trained), built in "
        f"{time.perf_counter() - t_start:.1f} s"
    )

    engine = TransformersEngine(model, tokenizer.pad_token_id, [fmt.end_id, tokenizer.eos_token_id], str(device))
    n_tasks = max(1, args.episodes // 4)
    warm = collect(
        suite, suite.tasks("train", "easy", 2), 2, engine, fmt, SamplingSettings("admissible", "full", 2, 2, 24, 1.0, 1)
    )  # kernels, allocator
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    records = collect(
        suite,
        suite.tasks("train", "easy", n_tasks),
        4,
        engine,
        fmt,
        SamplingSettings("admissible", "full", 2, 8, 24, 1.0, 0),
    )
    torch.cuda.synchronize()
    t_gen = time.perf_counter() - t0
    gen_tokens = sum(len(t.gen.token_ids) for r in records for t in r.turns)
    turns = sum(len(r.turns) for r in records)
    print(
        f"generation (admissible, full context, {len(records)} episodes, {turns} turns): {gen_tokens} action tokens "
        f"in {t_gen:.1f} s "
        f"= {gen_tokens / t_gen:.0f} tokens/s (environment steps included)"
    )

    prompts = [r.turns[0].prompt_ids for r in records]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    free = engine.generate(SampleRequest(prompts, [None] * len(prompts), 64, 1.0, False, 0))
    torch.cuda.synchronize()
    t_free = time.perf_counter() - t0
    free_tokens = sum(len(g.token_ids) for g in free)
    print(
        f"generation (free decoding, batch {len(prompts)}, up to 64 new tokens): {free_tokens} tokens in {t_free:.1f} "
        f"s = {free_tokens / t_free:.0f} tokens/s"
    )
    del warm, free

    rows = [r for r in train_rows(store.turns_table(records), "full") if r.positions]
    gen = torch.Generator().manual_seed(0)
    for r in rows:  # random +-1 advantages: throughput does not depend on their values
        r.adv = [float(torch.randint(0, 2, (1,), generator=gen)) * 2 - 1] * len(r.positions)
    loss_name = "ppo_clip"
    params = methods.LOSSES.get(loss_name).params_cls(clip_mode="asymmetric", eps_low=0.2, eps_high=0.2)
    settings = UpdateSettings(
        loss_name, params, 1, max(1, len(rows) // 2), False, 1.0, 1e9, 1.0, 16_384, tokenizer.pad_token_id
    )
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6)
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    try:
        stats = ppo_update(model, optimizer, rows, settings, seed=0).stats
    except RuntimeError as err:
        if "device" in str(err):
            print(
                "update failed on a device mismatch: the learner (horizonrl/training/trainer.py) must build its "
                "tensors on the model's device",
                file=sys.stderr,
            )
        raise
    torch.cuda.synchronize()
    t_upd = time.perf_counter() - t0
    real = sum(len(r.input_ids) for r in rows)
    print(
        f"update (1 epoch, {int(stats['steps'])} optimizer steps, {len(rows)} trajectories, {real} tokens incl. "
        "pi_old recompute): "
        f"{t_upd:.1f} s, trainer-reported {stats['tokens_per_s']:.0f} tokens/s, peak GPU memory "
        f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB"
    )
    del model, optimizer, engine
    torch.cuda.empty_cache()

    from benchmarks.real import model_dir

    data = Path(__file__).resolve().parents[1] / "data"
    out = data / "gpu-check"
    real_dir = args.real_model or model_dir(data)
    if real_dir is None:
        print("no real model: give --real-model DIR or set HORIZONRL_REAL_MODEL", file=sys.stderr)
        return 1
    found = real_model_check(Path(real_dir), out, "cuda", BF16_TOLERANCE)
    total = time.perf_counter() - t_start
    print(f"total {total:.0f} s (budget {DEADLINE_S} s)")
    return 0 if total < DEADLINE_S and found["passed"] else 1


BF16_TOLERANCE = 0.1  # nats: bfloat16 sampler vs learner (engine.vllm.sync_tolerance's advice for bf16)


def real_model_check(path: Path, out: Path, device: str, tolerance: float, tasks: int = 2, group: int = 2) -> dict:
    """A real model served by vLLM (the build for ``device``; the run's dtype: bfloat16 on CUDA, float32 on the
    CPU) beside the learner, on household easy in admissible mode: ``tasks`` x ``group`` episodes played by the
    server, one iteration of the flow's stages (LOOP advantages, the PPO update with pi_old recomputed), the
    new weights saved and reloaded into the server in place, and ``tasks`` x ``group`` more episodes. Passed
    when the sampler-learner gap (max |stored - recomputed log-prob|) is within ``tolerance`` before and
    after the sync and the sync was in place. Returns the figures; prints them."""
    from benchmarks.pipeline import learn
    from horizonrl.config import load_config
    from horizonrl.engines.vllm import VLLMLaunch
    from horizonrl.engines.vllm_server import free_port
    from horizonrl.envs import make_suite
    from horizonrl.models.loading import load_policy, resolve_device, resolve_dtype
    from horizonrl.models.probe import probe_of
    from horizonrl.rollout.loop import SamplingSettings, collect
    from horizonrl.rollout.prompting import ChatFormat
    from horizonrl.training.trainer import UpdateSettings

    root = Path(__file__).resolve().parents[1]
    cfg = load_config(
        str(root / "configs" / "loop_household_easy.yaml"),
        [
            f"model.path={path}",
            f"model.device={device}",
            "engine.name=vllm",
            f"engine.vllm.python={root / '.venv-vllm' / 'bin' / 'python'}",
            f"engine.vllm.device={device}",
            f"engine.vllm.sync_tolerance={tolerance}",
            f"engine.vllm.port={free_port()}",  # beside a run's server on the default port
            f"rollout.tasks_per_iteration={tasks}",
            f"rollout.group_size={group}",
            "env.max_turns=4",
            "update.epochs=1",
            f"data_dir={out}",
        ],
    )
    dtype = resolve_dtype(cfg.model.dtype, resolve_device(device))
    model, tokenizer = load_policy(path, dtype)
    model.to(device)
    fmt = ChatFormat.for_tokenizer(tokenizer)
    suite = make_suite(cfg.env.name, cfg.env.suite_seed, cfg.env.games, cfg.data_dir)
    pool = suite.tasks("train", cfg.env.tier, tasks)
    t0 = time.perf_counter()
    engine = VLLMLaunch.from_config(cfg).engine(str(path), list(fmt.stop_ids))
    print(f"{path.name}: {dtype}, vLLM ({device} build) up in {time.perf_counter() - t0:.0f} s")
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.update.lr)
    s = UpdateSettings.from_config(cfg, tokenizer.pad_token_id, sampled_here=True)
    name, params = cfg.advantage_spec()
    try:
        records = collect(suite, pool, group, engine, fmt, SamplingSettings.from_config(cfg, suite, 1))
        before = _sampler_gap(model, records, s, cfg.rollout.context)
        t0 = time.perf_counter()
        learn(records, cfg, 1, 0, (name, params, None), model, optimizer, s)  # advantages and the PPO update
        saved = out / "real-model-v1"
        model.save_pretrained(saved, safe_serialization=True)
        update_s = time.perf_counter() - t0
        engine.sync(str(saved), probe_of(model.eval(), len(tokenizer)))
        sync = engine.last_sync
        again = collect(suite, pool, group, engine, fmt, SamplingSettings.from_config(cfg, suite, 2))
        after = _sampler_gap(model, again, s, cfg.rollout.context)
    finally:
        engine.close()
    passed = sync.path == "in_place" and before <= tolerance and after <= tolerance
    print(
        f"parity: max |vLLM - learner| log-prob {before:.3g} before the update, {after:.3g} after the sync "
        f"(tolerance {tolerance:g}); iteration (advantages, update, checkpoint) {update_s:.1f} s; sync {sync.path} "
        f"in {sync.seconds:.2f} s, probe {sync.probe_max_diff:.3g}"
        + ("" if sync.reason is None else f" ({sync.reason})")
    )
    print(f"real model check: {'passed' if passed else 'FAILED'}")
    return {
        "gap_before": before,
        "gap_after": after,
        "sync_path": sync.path,
        "sync_s": sync.seconds,
        "update_s": update_s,
        "passed": passed,
    }


def _sampler_gap(model: torch.nn.Module, records: list, s, context: str) -> float:
    """Max |stored sampling log-prob - the learner's recompute| over the policy tokens of ``records``."""
    from horizonrl import store
    from horizonrl.training.sequences import train_rows
    from horizonrl.training.trainer import recompute_old_logprobs

    rows = [r for r in train_rows(store.turns_table(records), context) if r.positions]
    got = recompute_old_logprobs(model, rows, s)
    return max(abs(a - b) for r, c in zip(rows, got) for a, b in zip(r.sample_logp, c))


if __name__ == "__main__":
    sys.exit(main())
