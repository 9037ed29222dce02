"""Token helpers shared by the edge and the verifier: KV-cache prefix reuse, tokenizer identity."""
from __future__ import annotations

import hashlib
from typing import Iterable, Sequence


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share: the part of a cached context that can be kept."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def tokenizer_fingerprint(token_texts: Iterable[bytes]) -> str:
    """sha256 over the token list in id order, NUL-separated: the edge sends its draft's, the
    verifier compares it with its target's. Equal fingerprints mean draft tokens mean the same
    to the target, whichever library read the GGUF."""
    h = hashlib.sha256()
    for text in token_texts:
        h.update(text)
        h.update(b"\x00")
    return h.hexdigest()
