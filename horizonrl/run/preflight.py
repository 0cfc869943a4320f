"""What a user brings from outside the config, checked before any Prefect flow or MLflow run exists: the
model folder, the environment's package and data, the vLLM interpreter or server, and whether a rollout
batch fits in memory. The config check (``horizonrl.config``) cannot see these: a config can be valid and
the folder it names truncated. Each failure is a ``PreflightError`` whose message is one line naming the
field, the file or the command to run; every check reads headers and asks versions, none loads weights.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import shutil
import struct
import subprocess
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from horizonrl.config import MODEL_URI_PREFIXES, TrainConfig, run_dir
from horizonrl.models import pretrained
from horizonrl.run import config_history

VLLM_VERSION = "0.32.0"
"""The vLLM release the project runs against (``make vllm-venv`` installs it; the Makefile's VLLM_VERSION)."""

TURN_TOKENS = 256
"""Tokens a turn (observation + action) is assumed to take in the memory estimate: generous for the built-in
environments' observations, so the estimate errs towards refusing a batch that would barely fit."""


FULL_CONTEXT_TURNS = 50
"""Turns a full-context episode is assumed to reach when ``env.max_turns`` leaves the horizon to the tier
(the estimate does not build the suite to ask it; the model's positions cap the context anyway)."""

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
"""The files a saved tokenizer's vocabulary is in (fast, SentencePiece, BPE, WordPiece): one must be there."""


EXTRAS = {"textworld-": ("textworld", "textworld"), "scienceworld-": ("scienceworld", "scienceworld")}
"""Suite name prefix -> (the package its environments import, the project's extra that installs it)."""


class PreflightError(ValueError):
    """Something the user brings cannot serve the run; the message names it and the way out, on one line."""


def check_start(cfg: TrainConfig, allowed: Sequence[str] = ()) -> list[config_history.Change]:
    """Before a train or warm-start run starts or resumes: the settings it resumes with
    (``config_history.resume_changes``, returned), what it plays (``check_run``) and whether its rollout
    batch fits in memory."""
    config_history.check_allowed(cfg, allowed)
    changes = config_history.resume_changes(run_dir(cfg), cfg, allowed)
    check_run(cfg, resuming=has_checkpoint(run_dir(cfg)))
    check_rollout_memory(cfg)
    return changes


def check_run(cfg: TrainConfig, model_dir: str | Path | None = None, resuming: bool = False) -> None:
    """Every check of this module that applies to ``cfg``. ``model_dir``: the policy folder the run plays
    when it is not ``model.path`` (an evaluation's downloaded policy). A run that resumes (``resuming``)
    plays its own checkpoints, from its checkpoint 0 on: its ``model.path`` is not read again, so a folder
    changed or removed since does not stop it."""
    if model_dir is not None:
        check_model_folder(model_dir, "the policy")
    elif not resuming:
        check_model(cfg)
    check_environment(cfg)
    check_engine(cfg)


def check_model(cfg: TrainConfig) -> None:
    """``model.path`` when it names a local folder or a pretrained model, fetched here on first use and
    verified against its provenance after (a logged policy or a hub id is resolved at the start)."""
    path = cfg.model.path
    if path in pretrained.KNOWN:
        try:
            pretrained.fetch(path, cfg.data_dir)
        except (ValueError, RuntimeError) as err:
            raise PreflightError(f"model.path = {path!r}: {_first_line(err)}") from err
    folder = local_model_folder(cfg)
    if folder is not None:
        check_model_folder(folder, "model.path")


def local_model_folder(cfg: TrainConfig) -> Path | None:
    """The folder ``model.path`` names on this machine: a directory, or a pretrained model's cache; None for
    the tiny model, a logged policy or a hub id."""
    path = cfg.model.path
    if path is None or path.startswith(MODEL_URI_PREFIXES):
        return None
    folder = pretrained.model_dir(path, cfg.data_dir) if path in pretrained.KNOWN else Path(path).expanduser()
    return folder if folder.is_dir() else None


def check_model_folder(folder: str | Path, field: str) -> None:
    """A transformers model folder that will load: ``config.json`` readable, every safetensors file's header
    consistent with its size (a truncated download), the tokenizer loadable and a chat template or an end
    token to close a turn with."""
    from horizonrl.models import lora

    folder = Path(folder)
    adapter = lora.is_adapter_dir(folder)  # a LoRA policy: adapters and tokenizer here, the model in its base
    config = folder / (lora.ADAPTER_CONFIG if adapter else "config.json")
    try:
        if not isinstance(json.loads(config.read_text()), dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as err:
        raise PreflightError(f"{field}: {config} is not a readable model config ({err})") from err
    weights = sorted(folder.glob("*.safetensors"))
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as err:
            raise PreflightError(f"{field}: {index} is not a readable weights index ({err})") from err
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise PreflightError(f"{field}: {index} names weights files that are not there: {', '.join(missing)}")
    if not weights:
        raise PreflightError(f"{field}: {folder} holds no *.safetensors weights (the policy loads safetensors only)")
    for file in weights:
        problem = safetensors_problem(file)
        if problem:
            raise PreflightError(f"{field}: {file}: {problem}; download or save the model again")
    check_tokenizer(folder, field)
    if adapter and Path(lora.base_model_path(folder)).is_dir():
        check_model_folder(lora.base_model_path(folder), f"{field} (the base model of its adapters)")


def safetensors_problem(file: Path) -> str | None:
    """Why ``file`` is not a whole safetensors file, read from its 8-byte header length and JSON header
    (the tensors' declared byte ranges against the file's size), or None. The tensors are not read."""
    size = file.stat().st_size
    try:
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"{size} bytes, shorter than a safetensors header"
            (length,) = struct.unpack("<Q", head)
            if 8 + length > size:
                return f"its header declares {length} bytes of metadata but the file has {size} bytes (truncated)"
            header = json.loads(f.read(length))
    except (OSError, ValueError) as err:
        return f"unreadable safetensors header ({err})"
    if not isinstance(header, dict):
        return "its safetensors header is not a JSON object"
    ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__" and isinstance(t, dict)]
    need = 8 + length + max(ends, default=0)
    if need != size:
        what = "truncated" if need > size else "extra bytes"
        return f"its header declares {need} bytes but the file has {size} ({what})"
    return None


def check_tokenizer(folder: Path, field: str) -> None:
    """The folder's tokenizer loads and can frame a turn (``ChatFormat``: a chat template, else an end token)."""
    from horizonrl.models.loading import policy_tokenizer
    from horizonrl.rollout.prompting import ChatFormat

    how = "save one there with tokenizer.save_pretrained"
    if not any((folder / f).is_file() for f in TOKENIZER_FILES):  # transformers builds an empty one from config.json
        raise PreflightError(
            f"{field}: {folder}: its tokenizer does not load (none of {', '.join(TOKENIZER_FILES)} is there); {how}"
        )
    try:
        tokenizer = policy_tokenizer(folder)
    except Exception as err:  # noqa: BLE001 - transformers raises many types for a missing or broken tokenizer
        raise PreflightError(f"{field}: {folder}: its tokenizer does not load ({_first_line(err)}); {how}") from err
    if tokenizer.chat_template is None and tokenizer.eos_token_id is None:
        raise PreflightError(
            f"{field}: {folder}: the tokenizer has neither a chat template nor an end-of-text token, so a turn "
            "cannot be closed; add a chat_template to tokenizer_config.json"
        )
    try:
        ChatFormat.for_tokenizer(tokenizer)
    except (ValueError, KeyError, IndexError) as err:
        raise PreflightError(f"{field}: {folder}: {_first_line(err)}") from err


def check_commands(cfg: TrainConfig, policy_dir: str | Path, split: str) -> None:
    """The policy's tokenizer tells apart the commands of the first task of ``split`` (the check the action
    trie makes at the first turn, ``TokenTrie``): a closed word list trained on another environment spells
    unseen words alike, which would stop the evaluation after its run exists."""
    from horizonrl.engines.base import TokenTrie
    from horizonrl.envs import make_suite
    from horizonrl.models.loading import policy_tokenizer
    from horizonrl.rollout.prompting import ChatFormat

    if cfg.rollout.action_mode != "admissible":
        return
    fmt = ChatFormat.for_tokenizer(policy_tokenizer(policy_dir))
    suite = make_suite(cfg.env.name, cfg.env.suite_seed, cfg.env.games, cfg.data_dir)
    env = suite.make()
    try:
        _, info = env.reset(suite.tasks(split, cfg.env.tier, 1)[0])
        commands = list(info["admissible_commands"])
    finally:
        env.close()
    try:
        TokenTrie([fmt.command(c) for c in commands], commands)
    except ValueError as err:
        raise PreflightError(
            f"env.name = {cfg.env.name!r}: the policy's tokenizer cannot spell this environment's commands: "
            f"{_first_line(err)}"
        ) from err


def check_environment(cfg: TrainConfig) -> None:
    """The environment's package, data and programs: the adapters' benchmarks (their own check, which names
    what to install), TextWorld and ``tw-make`` for generated games, ScienceWorld and Java."""
    name = cfg.env.name
    if name in ("alfworld", "webshop", "appworld"):
        from horizonrl.envs import make_suite
        from horizonrl.envs.adapters import MissingBenchmark

        try:
            make_suite(name, cfg.env.suite_seed)
        except MissingBenchmark as err:
            raise PreflightError(f"env.name = {name!r}: {_first_line(err)}") from err
    for prefix, (package, extra) in EXTRAS.items():
        if name.startswith(prefix) and importlib.util.find_spec(package) is None:
            raise PreflightError(f"env.name = {name!r}: {package} is not installed: pip install -e '.[{extra}]'")
    if name.startswith("textworld-") and cfg.env.games is None:
        from horizonrl.envs.textworld_env import tw_make_path

        try:
            tw_make_path()
        except RuntimeError as err:
            raise PreflightError(f"env.name = {name!r} generates its games: {err}") from err
    elif name.startswith("scienceworld-"):
        if shutil.which("java") is None:
            raise PreflightError(f"env.name = {name!r}: ScienceWorld's simulator needs Java 17: no `java` on PATH")


def check_engine(cfg: TrainConfig) -> None:
    """``engine.name: vllm``: the server at ``engine.vllm.url`` answers and serves the run's model, or the
    interpreter at ``engine.vllm.python`` imports vLLM at ``VLLM_VERSION``."""
    if cfg.engine.name != "vllm":
        return
    from horizonrl.engines.vllm_server import SERVED_NAME

    v = cfg.engine.vllm
    if v.url is not None:
        served = served_models(v.url)
        if SERVED_NAME not in served:
            raise PreflightError(
                f"engine.vllm.url = {v.url!r} serves {', '.join(served) or 'no model'}, not {SERVED_NAME!r}: start "
                f"it with --served-model-name {SERVED_NAME} (docs/deploy.md)"
            )
        return
    found = vllm_version(v.python)
    if found != VLLM_VERSION:
        raise PreflightError(
            f"engine.vllm.python = {v.python!r}: {found}, expected vLLM {VLLM_VERSION}: run `make vllm-venv`, or set "
            "engine.vllm.url to a running server"
        )


def served_models(url: str) -> list[str]:
    """The model names the OpenAI-compatible server at ``url`` lists (``GET /v1/models``)."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/v1/models", timeout=10) as r:
            listing = json.loads(r.read().decode())
    except (urllib.error.URLError, OSError, ValueError) as err:
        raise PreflightError(
            f"engine.vllm.url = {url!r} does not answer GET /v1/models ({getattr(err, 'reason', err)})"
        ) from err
    return [m.get("id", "?") for m in listing.get("data", [])] if isinstance(listing, dict) else []


@functools.cache
def vllm_version(python: str) -> str:
    """``vllm.__version__`` as ``python`` imports it (one interpreter start per process and interpreter), or
    what went wrong, as a phrase."""
    if not Path(python).is_file():
        return "no such interpreter"
    try:
        done = subprocess.run(
            [python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True, timeout=300
        )
    except (OSError, subprocess.SubprocessError) as err:
        return f"it does not run ({err})"
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        return f"it cannot import vllm ({lines[-1] if lines else f'exit {done.returncode}'})"
    return f"vLLM {done.stdout.strip()}" if done.stdout.strip() != VLLM_VERSION else VLLM_VERSION


def check_rollout_memory(cfg: TrainConfig) -> None:
    """The transformers engine plays an iteration's ``rollout.tasks_per_iteration`` x ``rollout.group_size``
    episodes as one batch, its KV cache one slab: estimate it and the last-token logits against the memory
    free now, so a batch too large is refused naming the setting instead of ending in the OOM killer's
    silence. The estimate assumes ``TURN_TOKENS`` per turn; a vLLM server manages its own cache."""
    if cfg.engine.name != "transformers":
        return
    need = rollout_bytes(cfg)
    free = free_memory(cfg.model.device)
    if need > free:
        rows = cfg.rollout.tasks_per_iteration * cfg.rollout.group_size
        fits = max(int(cfg.rollout.tasks_per_iteration * free / need), 0)
        raise PreflightError(
            f"rollout.tasks_per_iteration = {cfg.rollout.tasks_per_iteration}: {rows} episodes at once need about "
            f"{need / 2**30:.1f} GiB for their KV cache and logits, {free / 2**30:.1f} GiB is free; lower it "
            f"(about {fits} fits) or rollout.group_size"
        )


def rollout_bytes(cfg: TrainConfig) -> int:
    """Estimated bytes of one rollout batch: KV cache of every row over its context, plus three float32
    copies of each row's last-token logits (logits, log-softmax, probabilities)."""
    folder = local_model_folder(cfg)
    if folder is not None and (folder / "config.json").is_file():
        c = json.loads((folder / "config.json").read_text())
        c = c.get("text_config", c)
        layers, heads = c["num_hidden_layers"], c["num_attention_heads"]
        kv_heads, vocab = c.get("num_key_value_heads") or heads, c.get("vocab_size", 0)
        head_dim = c.get("head_dim") or c["hidden_size"] // heads
        positions = c.get("max_position_embeddings") or 4096
    else:  # the tiny model built from the config; its vocabulary at most the largest tiny tokenizer's (Qwen3)
        t = cfg.model.tiny
        layers, kv_heads, head_dim, vocab = t.num_layers, t.num_kv_heads, t.hidden_size // t.num_heads, 152_000
        positions = t.max_positions
    width = 2 if cfg.model.dtype in ("bfloat16", "float16") else 4
    r = cfg.rollout
    turns = cfg.env.max_turns or FULL_CONTEXT_TURNS
    context = (r.history_turns + 2) * TURN_TOKENS if r.context == "window" else turns * TURN_TOKENS
    context = min(context, positions)
    rows = r.tasks_per_iteration * r.group_size
    return rows * (2 * layers * kv_heads * head_dim * width * context + 3 * 4 * vocab)


def free_memory(device: str) -> int:
    """Bytes free where the policy plays: the CUDA device's free memory, else the machine's available memory."""
    import psutil
    import torch

    if device != "cpu" and torch.cuda.is_available():
        return int(torch.cuda.mem_get_info(int(device.partition(":")[2] or 0))[0])
    return int(psutil.virtual_memory().available)


def check_recompute(run_folder: str | Path) -> list[Path]:
    """A run folder to recompute advantages over: its stored iterations (returned, in order), every table
    checked against its kind's schema (``store.StoreError`` naming the file and column) before one is written."""
    from horizonrl import store

    iterations = sorted(p for p in Path(run_folder).glob("iter=*") if (p / "episodes.parquet").is_file())
    if not iterations:
        raise PreflightError(f"--run-dir {str(run_folder)!r} holds no stored iteration (iter=<n>/episodes.parquet)")
    for d in iterations:
        for kind in ("episodes", "turns"):
            store.check_table(d / f"{kind}.parquet", kind)
    return iterations


def has_checkpoint(run_folder: str | Path) -> bool:
    """Whether the run folder holds a checkpoint (a folder appears only once written whole): a start there
    resumes."""
    from horizonrl.training.checkpoint import checkpoints

    return bool(checkpoints(Path(run_folder)))


def _first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0] if lines else type(err).__name__
