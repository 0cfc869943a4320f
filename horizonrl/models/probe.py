"""A full-weight policy's fingerprint: its log-probs (temperature 1, whole vocabulary) of the token after a
fixed probe sequence. A weight sync is checked against it (``engines/vllm.py``: the server must reproduce it).

Every full-weight checkpoint carries its own (``probe.pt``, written with the weights), so whoever syncs a
server to a checkpoint reads 4 bytes per vocabulary entry instead of loading the model: the asynchronous
generator used to hold a whole second policy, optimizer state included, only to compute this.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

PROBE_LENGTH = 32
PROBE_FILE = "probe.pt"  # not .safetensors: vLLM would read every *.safetensors of a folder as weights


@dataclass(frozen=True)
class Probe:
    """A probe sequence and the policy's log-probs of the token after it: what a weight sync must reproduce."""

    prompt: list[int]
    logprobs: list[float]


def probe_of(model: torch.nn.Module, vocab_size: int) -> Probe:
    """The probe of ``model`` (in eval mode for the call: a forward pass as in sampling, dropout off): a fixed
    sequence of ``PROBE_LENGTH`` ids spread over the vocabulary."""
    prompt = [1 + (i * 7919) % (vocab_size - 1) for i in range(PROBE_LENGTH)]
    device = next(model.parameters()).device
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt], device=device)).logits[0, -1].float()
    finally:
        model.train(training)
    return Probe(prompt, torch.log_softmax(logits, -1).tolist())


def save_probe(model: torch.nn.Module, folder: Path) -> None:
    """Write ``model``'s probe into ``folder``, beside its weights."""
    p = probe_of(model, model.get_input_embeddings().num_embeddings)
    torch.save(
        {
            "prompt": torch.tensor(p.prompt, dtype=torch.int64),
            "logprobs": torch.tensor(p.logprobs, dtype=torch.float32),
        },
        Path(folder) / PROBE_FILE,
    )


def stored_probe(folder: str | Path) -> Probe | None:
    """The probe a checkpoint was written with; None for a folder without one (a model folder, or a checkpoint
    written before probes were stored)."""
    path = Path(folder) / PROBE_FILE
    if not path.is_file():
        return None
    saved = torch.load(path, weights_only=True)
    return Probe(saved["prompt"].tolist(), saved["logprobs"].tolist())
