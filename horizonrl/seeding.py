"""One run seed, many independent streams: every random choice derives its seed from (seed, purpose, ...)."""

from __future__ import annotations

import hashlib


def derive_seed(seed: int, *parts: object) -> int:
    """A 63-bit seed fixed by ``seed`` and the names/indices in ``parts`` (stable across processes)."""
    text = "/".join([str(seed), *map(str, parts)])
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1
