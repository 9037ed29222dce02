"""PII masking on the device: nothing personal leaves it.

`Masker.mask` replaces personal values by typed, numbered placeholders before any text is
tokenised for the draft or sent to the verifier; `Masker.restore`/`restore_stream` put the values
back into the answer locally. Detection (`Masker.detect`):

- "presidio": presidio-analyzer's spaCy NER (PERSON; edge/privacy/analyzer.py) plus the pattern
  recognizers (edge/privacy/patterns.py);
- "patterns": the pattern recognizers only (devices that cannot hold the spaCy model).

Overlaps are resolved by entity-type priority (patterns.PRIORITY). Values already in the vault are
masked wherever they reappear (an answer pasted back into the history), even if the analyzer
misses them this time. Failures: with `strict=True` an analyzer that cannot load or fails on a text
raises PrivacyError and nothing is sent; otherwise the masker falls back to the pattern
recognizers and counts it in `fallbacks`.
"""
from __future__ import annotations

import re
import threading
import warnings
from typing import Iterable, Iterator, Mapping, Sequence

from edgespec.common.errors import EdgespecError
from edgespec.edge.privacy.analyzer import SPACY_MODEL
from edgespec.edge.privacy.patterns import DEFAULT_ENTITIES, PRIORITY, Span, find_all, resolve
from edgespec.edge.privacy.vault import PLACEHOLDER, Vault

__all__ = ["DEFAULT_ENTITIES", "MODES", "Masker", "PrivacyError", "Span", "Vault", "make_masker"]

MODES = ("presidio", "patterns")


class PrivacyError(EdgespecError):
    """Strict mode: the PII analyzer is unavailable or failed, so the request is not sent."""


class Masker:
    """Masks text for one conversation (owns its Vault) and restores answers."""

    def __init__(self, mode: str = "presidio", *, strict: bool = False, entities: Iterable[str] | None = None,
                 vault: Vault | None = None, spacy_model: str = SPACY_MODEL) -> None:
        if mode not in MODES:
            raise ValueError(f"privacy mode must be one of {MODES}, got {mode!r}")
        self.entities = tuple(DEFAULT_ENTITIES if entities is None else entities)
        unknown = set(self.entities) - set(PRIORITY)
        if unknown:
            raise ValueError(f"unknown PII entity types {sorted(unknown)}; known: {', '.join(PRIORITY[2:])}")
        self.mode, self.strict = mode, strict
        self.vault = vault if vault is not None else Vault()
        self.fallbacks = 0                 # texts masked with patterns only because the analyzer failed
        self._ner = None
        self._lock = threading.Lock()
        if mode == "presidio":
            try:
                from edgespec.edge.privacy.analyzer import PresidioNer

                self._ner = PresidioNer(spacy_model)
            except Exception as exc:  # missing package or model, broken install
                if strict:
                    raise PrivacyError(f"PII analyzer unavailable ({exc}); strict mode sends nothing") from exc
                warnings.warn(f"PII analyzer unavailable ({exc}); masking with pattern recognizers only",
                              RuntimeWarning, stacklevel=2)
                self.mode = "patterns"

    def __repr__(self) -> str:
        return f"Masker(mode={self.mode!r}, strict={self.strict}, {self.vault!r})"

    def detect(self, text: str) -> list[Span]:
        """Non-overlapping spans to mask in `text`, in order (placeholder look-alikes included)."""
        spans = find_all(text, self.entities)
        spans += [Span(m.start(), m.end(), "PLACEHOLDER_LIKE", 1.0, "literal") for m in PLACEHOLDER.finditer(text)]
        for value, _ in self.vault.known_values():
            spans += [Span(m.start(), m.end(), "KNOWN_VALUE", 1.0, "vault")
                      for m in re.finditer(re.escape(value), text)]
        if self._ner is not None:
            try:
                spans += self._ner.find(text, self.entities)
            except Exception as exc:
                if self.strict:
                    raise PrivacyError(f"PII analyzer failed ({exc!r}); strict mode sends nothing") from exc
                self.fallbacks += 1
        return resolve(spans)

    def mask(self, text: str) -> str:
        """`text` with every detected value replaced by its placeholder."""
        out, pos = [], 0
        for span in self.detect(text):
            value = text[span.start:span.end]
            if span.entity == "KNOWN_VALUE":
                placeholder = next(p for v, p in self.vault.known_values() if v == value)
            else:
                placeholder = self.vault.placeholder(span.entity, value)
            out += [text[pos:span.start], placeholder]
            pos = span.end
        out.append(text[pos:])
        return "".join(out)

    def mask_messages(self, messages: Sequence[Mapping[str, str]]) -> list[dict[str, str]]:
        """Chat messages (any role: system, user, assistant history, tool output) with masked contents."""
        return [{**m, "content": self.mask(m.get("content", ""))} for m in messages]

    def restore(self, text: str) -> str:
        return self.vault.restore(text)

    def restore_stream(self, chunks: Iterable[str]) -> Iterator[str]:
        return self.vault.restore_stream(chunks)


def make_masker(privacy: "str | Masker | None", strict: bool = False,
                entities: Iterable[str] | None = None) -> Masker | None:
    """EdgeSession's `privacy=` argument as a Masker: a mode name, a ready Masker, or None (off)."""
    if privacy is None or isinstance(privacy, Masker):
        return privacy
    return Masker(privacy, strict=strict, entities=entities)
