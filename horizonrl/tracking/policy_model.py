"""The trained policy as an MLflow pyfunc model that serves anywhere: its weights and tokenizer as the
``policy`` artifact (a LoRA policy's base model as ``base``), the library's code beside it (``code/``:
``horizonrl`` and ``methods``), and pinned requirements, so ``mlflow.pyfunc.load_model`` in a fresh
environment with only those installed, or ``mlflow models serve``, answers without the project.

``predict`` takes rows with ``goal``, ``observation`` and ``admissible`` (the turn's commands, a list of
strings) and returns the greedy action of each, in window context with no history, prompted and decoded as
the run that trained it was (its model config: ``rollout.prompt``, ``free_format``, ``enable_thinking``,
``action_mode``, ``max_action_tokens``). A policy trained in admissible mode chooses among the listed
commands and needs the list; one trained in free mode writes its reply (``admissible`` optional, shown by a
listed prompt). docs/tracking.md shows loading and serving it.

The model is logged from this file (MLflow's "models from code", ``mlflow_runs.log_policy``): MLflow copies
it into the model and runs it at load time, where ``set_model`` below names the model object. Logged as a
Python object instead, the model would be a CloudPickle file, and loading a model from another's store would
run whatever that pickle holds.
"""

from __future__ import annotations

import math
from typing import Any

import mlflow.pyfunc
import pandas as pd
from mlflow.models import ModelSignature, set_model
from mlflow.types.schema import Array, ColSpec, Schema

# Logged with the model, so MLflow checks inputs at serving time (and warns about no missing signature).
SIGNATURE = ModelSignature(
    inputs=Schema(
        [
            ColSpec("string", "goal"),
            ColSpec("string", "observation"),
            ColSpec(Array("string"), "admissible", required=False),
        ]
    ),
    outputs=Schema([ColSpec("string")]),
)

CHAT_KEYS = ("prompt", "free_format", "enable_thinking")
"""The model config's keys that set the prompt (``ChatFormat.for_tokenizer``); the others set the decoding."""


class PolicyModel(mlflow.pyfunc.PythonModel):
    def load_context(self, context) -> None:
        from horizonrl.engines.hf import TransformersEngine
        from horizonrl.models import lora
        from horizonrl.models.loading import load_policy, policy_tokenizer
        from horizonrl.rollout.prompting import ChatFormat

        policy, config = context.artifacts["policy"], dict(context.model_config or {})
        if "base" in context.artifacts:  # LoRA adapters over the base model logged beside them
            base, _ = load_policy(context.artifacts["base"])
            self.model, tokenizer = lora.load_adapter_policy(policy, base), policy_tokenizer(policy)
        else:
            self.model, tokenizer = load_policy(policy)
        self.fmt = ChatFormat.for_tokenizer(tokenizer, **{k: config[k] for k in CHAT_KEYS if k in config})
        self.engine = TransformersEngine(self.model, tokenizer.pad_token_id, list(self.fmt.stop_ids))
        self.admissible_mode = config.get("action_mode", "admissible") == "admissible"
        self.max_tokens = int(config.get("max_action_tokens", 32))

    def predict(self, context, model_input: pd.DataFrame, params=None) -> list[str]:
        from horizonrl.engines.base import SampleRequest, TokenTrie

        prompts, tries = [], []
        for i, row in enumerate(model_input.to_dict("records")):
            listed = commands(row.get("admissible"))
            if self.admissible_mode and not listed:
                raise ValueError(
                    f"row {i}: 'admissible' is missing or empty: this policy was trained to choose among the turn's "
                    "commands (rollout.action_mode = 'admissible'); give them as a list of strings"
                )
            prompts.append(self.fmt.system(row["goal"]) + self.fmt.user(row["observation"], listed))
            tries.append(TokenTrie([self.fmt.command(c) for c in listed]) if self.admissible_mode else None)
        gens = self.engine.generate(SampleRequest(prompts, tries, self.max_tokens, 1.0, True, 0))
        return [self.fmt.parse_action(g.token_ids, g.finished)[0] for g in gens]


def commands(value: Any) -> list[str]:
    """A row's ``admissible`` as a list of strings: none given (absent, None, NaN from a pandas column with
    gaps) is an empty list."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return []
    return [str(c) for c in value]


set_model(PolicyModel())
