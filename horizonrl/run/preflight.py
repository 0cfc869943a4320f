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
import os
import re
import shutil
import struct
import subprocess
import threading
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from horizonrl.config import MODEL_URI_PREFIXES, TrainConfig, run_dir
from horizonrl.config.schema import MODEL_PATH_FORMS
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

HUB_TIMEOUT_S = 5.0
"""How long the one look-up of a hub id waits for the hub (``check_hub_id``)."""

SAFETENSORS_MAX_HEADER = 100_000_000
"""The largest header the safetensors format allows (bytes): a larger length is not a safetensors file."""

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
"""The files a saved tokenizer's vocabulary is in (fast, SentencePiece, BPE, WordPiece): one must be there."""


EXTRAS = {"textworld-": ("textworld", "textworld"), "scienceworld-": ("scienceworld", "scienceworld")}
"""Suite name prefix -> (the package its environments import, the project's extra that installs it)."""


class PreflightError(ValueError):
    """Something the user brings cannot serve the run; the message names it and the way out, on one line."""


def check_start(
    cfg: TrainConfig, allowed: Sequence[str] = (), length: str = "iterations"
) -> list[config_history.Change]:
    """Before a train or warm-start run starts or resumes: the settings it resumes with
    (``config_history.resume_changes``, returned; ``length``: the field that counts its iterations), what it
    plays (``check_run``) and whether its rollout batch fits in memory. A start that finished no iteration,
    run again with other settings, starts afresh (``config_history.failed_start``): its model is checked."""
    folder = run_dir(cfg)
    config_history.check_allowed(cfg, allowed)
    changes = config_history.resume_changes(folder, cfg, allowed, length)
    check_run(cfg, resuming=has_checkpoint(folder) and not config_history.failed_start(folder, cfg))
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
    """``model.path`` in every form it takes: a pretrained model's name (fetched here on first use, verified
    against its provenance after), a local folder (``check_model_folder``), a logged policy in the tracking
    store (``check_logged_model``), else a hub id (``check_hub_id``)."""
    path = cfg.model.path
    if path is None:
        return
    if path.startswith(MODEL_URI_PREFIXES):
        check_logged_model(path, cfg.tracking_uri)
        return
    if path in pretrained.KNOWN:
        try:
            pretrained.fetch(path, cfg.data_dir)
        except (ValueError, RuntimeError) as err:
            raise PreflightError(f"model.path = {path!r}: {_first_line(err)}") from err
    folder = local_model_folder(cfg)
    if folder is not None:
        check_model_folder(folder, "model.path")
    else:
        check_hub_id(path)


def check_logged_model(path: str, configured_uri: str | None) -> None:
    """``models:/<name>/<version>`` or ``runs:/<run id>`` is in the tracking store (a run with a logged
    policy), asked without creating the store."""
    from horizonrl.tracking import mlflow_runs
    from mlflow import MlflowClient

    uri = mlflow_runs.tracking_uri(configured_uri, create=False)
    if not mlflow_runs.store_exists(uri):
        raise PreflightError(
            f"model.path = {path!r}: the tracking store {uri} does not exist yet, so it holds no logged policy; "
            "set tracking_uri (or MLFLOW_TRACKING_URI) to the store that has it"
        )
    try:
        mlflow_runs.resolve_policy(MlflowClient(uri), path, "model.path =")
    except ValueError as err:
        raise PreflightError(_first_line(err)) from err


def check_hub_id(path: str) -> None:
    """A ``model.path`` that names no folder here is a hub id (``org/name``): asked of the hub once, now,
    with a short timeout and no retries (transformers would retry five times, about 100 s where the hub
    cannot be reached, after the run was created). Refused naming both readings and the forms that work."""
    status = hub_status(path)
    if status is not None:
        raise PreflightError(f"model.path = {path!r}: no folder {path!r} here, and {status}; {MODEL_PATH_FORMS}")


def hub_status(repo_id: str) -> str | None:
    """None when the model hub (``HF_ENDPOINT``, default huggingface.co) has model ``repo_id``, or the local
    hub cache holds it; else why not, as a phrase (no such model, or the hub cannot be reached)."""
    from huggingface_hub import get_token, try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    try:
        if isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
            return None
    except HFValidationError as err:
        return f"it is not a hub id either ({_first_line(err)})"
    if os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE"):
        return "the hub is switched off (HF_HUB_OFFLINE) and its local cache has no such model"
    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    request = urllib.request.Request(f"{endpoint.rstrip('/')}/api/models/{repo_id}", method="GET")
    if token := get_token():
        request.add_header("Authorization", f"Bearer {token}")
    answer: list[str | None] = []

    def ask() -> None:  # in a thread: a name lookup is not bounded by the socket's timeout
        try:
            with urllib.request.urlopen(request, timeout=HUB_TIMEOUT_S):
                answer.append(None)
        except urllib.error.HTTPError as err:
            answer.append(
                f"the hub at {endpoint} has no such model (HTTP {err.code}; a private or gated one needs HF_TOKEN)"
            )
        except (urllib.error.URLError, OSError) as err:
            answer.append(f"the hub at {endpoint} cannot be reached ({getattr(err, 'reason', err)})")

    thread = threading.Thread(target=ask, name="hub-lookup", daemon=True)
    thread.start()
    thread.join(HUB_TIMEOUT_S + 1)
    return answer[0] if answer else f"the hub at {endpoint} cannot be reached (no answer in {HUB_TIMEOUT_S:g} s)"


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
    tensors: dict[str, tuple[int, ...]] = {}
    for file in weights:
        try:
            header = safetensors_header(file)
        except ValueError as err:
            raise PreflightError(f"{field}: {file}: {err}; download or save the model again") from err
        tensors |= {k: tuple(t["shape"]) for k, t in header.items() if k != "__metadata__"}
    if not adapter:
        problem = architecture_problem(folder, tensors)
        if problem:
            raise PreflightError(f"{field}: {folder}: {problem}")
    check_tokenizer(folder, field)
    if adapter and Path(lora.base_model_path(folder)).is_dir():
        check_model_folder(lora.base_model_path(folder), f"{field} (the base model of its adapters)")


def safetensors_problem(file: Path) -> str | None:
    """Why ``file`` is not a whole safetensors file (``safetensors_header``), or None."""
    try:
        safetensors_header(file)
    except ValueError as err:
        return str(err)
    return None


def safetensors_header(file: Path) -> dict:
    """The JSON header of the whole safetensors file ``file`` (each tensor's dtype, shape and byte range),
    read from its 8-byte header length; a ``ValueError`` says why it is not one: not safetensors at all (no
    JSON object after a plausible length), truncated, or with extra bytes. The tensors are not read."""
    size = file.stat().st_size
    try:
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError(f"{size} bytes, shorter than a safetensors header")
            (length,) = struct.unpack("<Q", head)
            if length > SAFETENSORS_MAX_HEADER or f.read(1) != b"{":
                raise ValueError("not a safetensors file (no JSON header after its first 8 bytes)")
            if 8 + length > size:
                raise ValueError(
                    f"its header declares {length} bytes of metadata but the file has {size} bytes (truncated)"
                )
            f.seek(8)
            header = json.loads(f.read(length))
    except OSError as err:
        raise ValueError(f"unreadable ({err})") from err
    except json.JSONDecodeError as err:
        raise ValueError(f"not a safetensors file (its header is not JSON: {err})") from err
    if not isinstance(header, dict) or not all(isinstance(t, dict) for k, t in header.items() if k != "__metadata__"):
        raise ValueError("not a safetensors file (its header is not a JSON object of tensors)")
    ends = [t.get("data_offsets", [0, 0])[1] for k, t in header.items() if k != "__metadata__"]
    need = 8 + length + max(ends, default=0)
    if need != size:
        what = "truncated" if need > size else "extra bytes"
        raise ValueError(f"its header declares {need} bytes but the file has {size} ({what})")
    return header


def architecture_problem(folder: Path, tensors: dict[str, tuple[int, ...]]) -> str | None:
    """Why the weights (``tensors``: name -> shape, from the safetensors headers) do not fit the architecture
    ``folder``'s ``config.json`` names, or None. The model is built on torch's meta device (shapes, no
    memory, no weights) and its state's names and shapes compared: a tensor it lacks would start random, one
    it has no place for would be dropped, one of another shape would not load. A config copied from another
    model, or a ``model_type`` edited, is named here instead of in transformers' load report."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(folder)
        if getattr(config, "quantization_config", None):  # packed tensors of the quantizer's own shapes
            return None
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as err:  # noqa: BLE001 - transformers raises many types for a config it cannot build
        return f"its config.json does not describe a causal LM transformers can build ({_first_line(err)})"
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    prefixed = {f"{model.base_model_prefix}.{k}": v for k, v in tensors.items()}
    if len(prefixed.keys() & expected.keys()) > len(tensors.keys() & expected.keys()):
        tensors = prefixed  # a base model's weights, which transformers loads under the causal LM's prefix
    tied = {n for n, _ in model.named_parameters(remove_duplicate=False)} - {n for n, _ in model.named_parameters()}
    missing = sorted(k for k in expected.keys() - tensors.keys() - tied if not _ignored(model, "missing", k))
    unexpected = sorted(k for k in tensors.keys() - expected.keys() if not _ignored(model, "unexpected", k))
    shapes = sorted(k for k in expected.keys() & tensors.keys() if expected[k] != tensors[k])
    if not (missing or unexpected or shapes):
        return None
    parts = [f"{len(missing)} of its tensors missing ({_some(missing)})"] if missing else []
    parts += [f"{len(unexpected)} it has no place for ({_some(unexpected)})"] if unexpected else []
    if shapes:
        parts.append(
            f"{len(shapes)} of another shape ({shapes[0]}: {list(tensors[shapes[0]])} in the file, "
            f"{list(expected[shapes[0]])} in the architecture)"
        )
    return (
        f"its weights do not fit the architecture its config.json names ({type(model).__name__}, model_type "
        f"{config.model_type!r}): {'; '.join(parts)}; the config and the weights come from different models: "
        "download or save the model again"
    )


def _some(keys: list[str]) -> str:
    return ", ".join(keys[:2]) + (", ..." if len(keys) > 2 else "")


def _ignored(model: object, kind: str, key: str) -> bool:
    """Whether the model class tells transformers to ignore ``key`` when ``kind`` (missing, unexpected)."""
    patterns = getattr(model, f"_keys_to_ignore_on_load_{kind}", None) or []
    return any(re.search(p, key) for p in patterns)


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
    python = v.interpreter()
    found = vllm_version(str(python))
    if found != VLLM_VERSION:
        where = "" if str(python) == v.python else f" ({python})"
        raise PreflightError(
            f"engine.vllm.python = {v.python!r}{where}: {found}, expected vLLM {VLLM_VERSION}: run `make vllm-venv`, "
            "or set engine.vllm.url to a running server"
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
