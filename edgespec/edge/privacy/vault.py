"""Placeholders and the vault that maps them back to values, on this device only.

A value becomes a typed, numbered placeholder (`[PERSON_1]`, `[PHONE_2]`), the same one for the
same value for the whole conversation. The vault is the only place holding the values: it is never
sent, never logged (its repr shows counts only) and written to disk only by an explicit `save()`.

Soundness of restoration: every placeholder-shaped string in masked text was issued by this vault,
because user text that merely looks like one (`[PERSON_1]` typed by the user) is itself masked as a
value of type TEXT. So `restore` maps exactly what was masked back to what it was, and a user's
"[PERSON_1]" comes back as that literal text, never as someone's name.
"""
from __future__ import annotations

import json
import os
import re
import threading
from pathlib import Path
from typing import Iterable, Iterator

# Placeholder labels per entity type (what the model sees).
LABELS: dict[str, str] = {
    "PERSON": "PERSON", "EMAIL_ADDRESS": "EMAIL", "PHONE_NUMBER": "PHONE", "CREDIT_CARD": "CARD",
    "IBAN_CODE": "IBAN", "IP_ADDRESS": "IP", "API_KEY": "API_KEY", "CN_RESIDENT_ID": "ID_NUMBER",
    "US_SSN": "SSN", "ADDRESS": "ADDRESS", "LOCATION": "LOCATION", "PLACEHOLDER_LIKE": "TEXT",
}
PLACEHOLDER = re.compile(r"\[([A-Z]+(?:_[A-Z]+)*)_([1-9]\d{0,5})\]")
# A string that could still grow into a placeholder: what a stream must hold back at its end.
_PARTIAL = re.compile(r"\[(?:[A-Z]+(?:_[A-Z]*)*(?:_\d{0,6})?)?$")
_MAX_PLACEHOLDER = 40


def _key(entity: str, value: str) -> str:
    """Values that are the same thing get the same placeholder: digits only for numbers written
    with spaces or dashes, case-folded e-mails, collapsed whitespace otherwise."""
    if entity in ("PHONE_NUMBER", "CREDIT_CARD", "CN_RESIDENT_ID", "US_SSN"):
        return re.sub(r"[^\dXx+]", "", value).upper()
    if entity in ("EMAIL_ADDRESS", "IBAN_CODE"):
        return value.replace(" ", "").casefold()
    return " ".join(value.split())


class Vault:
    """Placeholder <-> value for one conversation. Thread-safe; in memory unless saved."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_key: dict[tuple[str, str], str] = {}   # (label, normalised value) -> placeholder
        self._values: dict[str, str] = {}               # placeholder -> value as first seen
        self._counts: dict[str, int] = {}

    def __repr__(self) -> str:  # never the values: a repr ends up in logs and tracebacks
        return f"Vault({len(self._values)} placeholders)"

    def __len__(self) -> int:
        return len(self._values)

    def placeholder(self, entity: str, value: str) -> str:
        """The placeholder of `value` (issued on first sight, then always the same)."""
        label = LABELS.get(entity, entity)
        key = (label, _key(entity, value))
        with self._lock:
            found = self._by_key.get(key)
            if found is None:
                n = self._counts.get(label, 0) + 1
                self._counts[label] = n
                found = f"[{label}_{n}]"
                self._by_key[key] = found
                self._values[found] = value
            return found

    def value(self, placeholder: str) -> str | None:
        return self._values.get(placeholder)

    def known_values(self) -> list[tuple[str, str]]:
        """(value, placeholder) pairs, longest value first: masked again wherever they reappear."""
        with self._lock:
            return sorted(((v, p) for p, v in self._values.items()), key=lambda vp: -len(vp[0]))

    def restore(self, text: str) -> str:
        """Issued placeholders back to their values; anything else untouched."""
        return PLACEHOLDER.sub(lambda m: self._values.get(m.group(0), m.group(0)), text)

    def restore_stream(self, chunks: Iterable[str]) -> Iterator[str]:
        """`restore` over a stream of text chunks: a possible placeholder at a chunk's end is held
        back until the next chunk completes or refutes it (or the stream ends)."""
        pending = ""
        try:
            for chunk in chunks:
                pending += chunk
                cut = len(pending)
                tail = _PARTIAL.search(pending, max(0, len(pending) - _MAX_PLACEHOLDER))
                if tail is not None:
                    cut = tail.start()
                out, pending = self.restore(pending[:cut]), pending[cut:]
                if out:
                    yield out
            if pending:
                yield self.restore(pending)
        finally:  # closing the restored stream closes its source (e.g. ends an EdgeSession request)
            close = getattr(chunks, "close", None)
            if close is not None:
                close()

    # -- explicit persistence only --------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> None:
        """Write the mapping to `path` (mode 0600). Only ever called on the user's request."""
        path = Path(path)
        data = json.dumps({"values": self._values, "counts": self._counts}, ensure_ascii=False)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(data)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Vault":
        """A vault saved by `save` (to continue a conversation with the same placeholders)."""
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
        vault = cls()
        for placeholder, value in raw["values"].items():
            label = PLACEHOLDER.fullmatch(placeholder).group(1)
            entity = next((e for e, lab in LABELS.items() if lab == label), label)
            vault._values[placeholder] = value
            vault._by_key[(label, _key(entity, value))] = placeholder
        vault._counts = {k: int(v) for k, v in raw["counts"].items()}
        return vault
