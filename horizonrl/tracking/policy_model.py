"""The trained policy as an MLflow pyfunc model: safetensors weights plus tokenizer as artifacts.

``predict`` takes rows with ``goal`` and ``observation`` (and optionally ``admissible``, a list of
commands) and returns the greedy action of each, in window context with no history, prompted as the run
that trained it was (its model config: ``rollout.prompt``, ``free_format``, ``enable_thinking``).

The model is logged from this file (MLflow's "models from code", ``mlflow_runs.log_policy``): MLflow copies
it into the model and runs it at load time, where ``set_model`` below names the model object. Logged as a
Python object instead, the model would be a CloudPickle file, and loading a model from another's store would
run whatever that pickle holds.
"""

from __future__ import annotations

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


class PolicyModel(mlflow.pyfunc.PythonModel):
    def load_context(self, context) -> None:
        from horizonrl.engines.hf import TransformersEngine
        from horizonrl.models.loading import load_policy
        from horizonrl.rollout.prompting import ChatFormat

        self.model, tokenizer = load_policy(context.artifacts["policy"])
        self.fmt = ChatFormat.for_tokenizer(tokenizer, **(context.model_config or {}))
        self.engine = TransformersEngine(self.model, tokenizer.pad_token_id, list(self.fmt.stop_ids))

    def predict(self, context, model_input: pd.DataFrame, params=None) -> list[str]:
        from horizonrl.engines.base import SampleRequest, TokenTrie

        prompts, tries = [], []
        for _, row in model_input.iterrows():
            cmds = row.get("admissible")
            listed = [str(c) for c in cmds] if cmds is not None else []  # shown to the model by a listed prompt
            prompts.append(self.fmt.system(row["goal"]) + self.fmt.user(row["observation"], listed))
            tries.append(TokenTrie([self.fmt.command(c) for c in cmds]) if cmds is not None and len(cmds) else None)
        gens = self.engine.generate(SampleRequest(prompts, tries, 32, 1.0, True, 0))
        return [self.fmt.parse_action(g.token_ids, g.finished)[0] for g in gens]


set_model(PolicyModel())
