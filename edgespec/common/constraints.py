"""Constrained decoding: one token mask, applied identically by the draft and by the verifier.

A `TokenConstraint` bans token sequences (e.g. the tokenisations of absolute advertising claims such
as "best in the world"): wherever the context ends with all but the last token of a banned
sequence, that last token is masked (its logit set to -inf), so no banned sequence is ever
completed. The mask is a function of the context only, so both sides compute the same one:

- the verifier (common/acceptance.py `accept_logits`) masks the target's logits at every tree node
  given the committed context plus the node's path, before argmax (greedy) or `probabilities`
  (sampled; the target-sample rule samples from the masked p);
- the drafter (edge/drafting.py) masks the draft's logits the same way, so the rejection rule's q
  is the masked draft distribution and drafted trees never propose a masked token.

Speculative output under the constraint then equals target-only output under the constraint
(greedy), and has exactly the distribution of the masked target (sampled): the target's masked
distribution is what acceptance reads, whatever the draft proposed.

Banned phrases are matched on token ids, not text: `from_phrases` bans the tokenisations a phrase
usually has in running text (as is, after a space, capitalised); a phrase spelled with other tokens
(e.g. split mid-word) is not caught. The constraint travels to the verifier in SamplingParams
(proto field SamplingParams.constraint).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import numpy as np

from edgespec.common.errors import InvalidRequestError

MAX_BANNED_TOKENS = 4096   # total tokens over all banned sequences (a request-size bound for the verifier)


@dataclass(frozen=True)
class TokenConstraint:
    """Banned token sequences; `mask(context)` is the set of token ids the next position may not take."""

    banned: tuple[tuple[int, ...], ...] = ()
    _next: dict = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        banned = tuple(dict.fromkeys(tuple(int(t) for t in seq) for seq in self.banned))  # dedupe, keep order
        if any(not seq for seq in banned):
            raise InvalidRequestError("a banned token sequence is empty")
        if any(t < 0 for seq in banned for t in seq):
            raise InvalidRequestError("banned token ids must be >= 0")
        if sum(len(seq) for seq in banned) > MAX_BANNED_TOKENS:
            raise InvalidRequestError(f"banned sequences hold more than {MAX_BANNED_TOKENS} tokens")
        object.__setattr__(self, "banned", banned)
        for seq in banned:   # prefix -> tokens it may not be followed by
            self._next.setdefault(seq[:-1], set()).add(seq[-1])

    def __bool__(self) -> bool:
        return bool(self.banned)

    @property
    def max_len(self) -> int:
        return max((len(s) for s in self.banned), default=0)

    def validate(self, vocab_size: int) -> None:
        """Raise InvalidRequestError unless every banned id is in the vocabulary."""
        bad = [t for seq in self.banned for t in seq if t >= vocab_size]
        if bad:
            raise InvalidRequestError(f"banned token id {bad[0]} outside the vocabulary [0, {vocab_size})")

    def mask(self, context: Sequence[int]) -> list[int]:
        """Token ids banned at the position after `context`."""
        out: set[int] = set()
        for k in {len(p) for p in self._next}:
            if k <= len(context):
                out |= self._next.get(tuple(context[len(context) - k:]) if k else (), set())
        return sorted(out)

    def apply(self, logits: np.ndarray, context: Sequence[int]) -> np.ndarray:
        """`logits` with the banned ids at -inf (a copy; the input is left alone)."""
        banned = self.mask(context)
        if not banned:
            return logits
        out = np.array(logits, dtype=np.float32 if np.asarray(logits).dtype == np.float32 else np.float64)
        out[banned] = -np.inf
        if not np.isfinite(out).any():
            raise InvalidRequestError("the constraint bans every token at this position")
        return out

    @classmethod
    def from_phrases(cls, phrases: Iterable[str], tokenize: Callable[[str], list[int]]) -> "TokenConstraint":
        """Ban each phrase as it is usually tokenised in running text: as given, after a space, and
        with a capital first letter (both). `tokenize(text)` must not add special tokens."""
        seqs = []
        for phrase in phrases:
            phrase = phrase.strip()
            if not phrase:
                continue
            for variant in dict.fromkeys((phrase, phrase[:1].upper() + phrase[1:], phrase.lower())):
                for text in (variant, " " + variant):
                    tokens = tokenize(text)
                    if tokens:
                        seqs.append(tuple(tokens))
        return cls(tuple(seqs))


def node_context(context: Sequence[int], tree_tokens: Sequence[int], path: Sequence[int]) -> list[int]:
    """The tokens before the position a tree node predicts: the committed context (whose last token
    is the root) plus the tokens of the node's path below the root."""
    return [*context, *(int(tree_tokens[n]) for n in path)]
