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

A `Grammar` (a JSON schema, a Lark grammar or a regex, compiled by llguidance) is the other half of
the same mask: the answer, i.e. the context from `Grammar.start` on, must stay a prefix of a string
the grammar accepts, so at each position only the tokens that keep it so are allowed (and the
end-of-generation tokens once the grammar accepts). The mask is a function of the context again,
so the drafter and the verifier compute the same one; the grammar's text and start travel in
TokenConstraint (proto fields 3 and 4) and each side compiles it against its own copy of the token
list (equal by the tokenizer fingerprint checked at Open). A context the grammar cannot continue
(it broke the grammar, e.g. a guessed token drafted ahead, or it has ended) allows only the
end-of-generation tokens. Greedy output is then the target's argmax among the allowed tokens at
every position; sampled output is the target's p renormalised over them.
"""
from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from edgespec.common.errors import InvalidRequestError
from edgespec.common.tokens import common_prefix_length

if TYPE_CHECKING:
    import llguidance

MAX_BANNED_TOKENS = 4096   # total tokens over all banned sequences (a request-size bound for the verifier)
MAX_GRAMMAR_BYTES = 64 * 1024   # the grammar's text (it travels with every Verify)


@functools.lru_cache(maxsize=256)
def _grammar_error(text: str) -> str:
    """llguidance's complaint about a grammar text ('' when it compiles); cached, because every
    Verify message carries the grammar and the verifier rebuilds the constraint from it."""
    import llguidance

    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text)
    return messages[0] if is_error else ""


@dataclass(frozen=True)
class Grammar:
    """What the answer must match: an llguidance grammar text (built by `json_schema`, `lark`,
    `regex` or `from_response_format`). `start` is the context position of the answer's first
    token; -1 until the request places it (`TokenConstraint.placed`, done by EdgeSession)."""

    text: str
    start: int = -1

    def __post_init__(self) -> None:
        if len(self.text.encode()) > MAX_GRAMMAR_BYTES:
            raise InvalidRequestError(f"the grammar is over {MAX_GRAMMAR_BYTES} bytes")
        error = _grammar_error(self.text)
        if error:
            raise InvalidRequestError(f"invalid grammar: {error.strip()}")

    # JSON as json.dumps writes it, on one line: with free whitespace (llguidance's default) small
    # models drift into endless newlines inside the object. A schema's own "x-guidance" overrides it.
    JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | str | bool) -> "Grammar":
        """JSON text valid against `schema` (a dict, or its JSON text), laid out as JSON_LAYOUT."""
        import llguidance

        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise InvalidRequestError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequestError(f"a JSON schema is an object, got {type(schema).__name__}")
        try:
            return cls(llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=cls.JSON_LAYOUT))
        except ValueError as exc:
            raise InvalidRequestError(f"invalid JSON schema: {exc}") from None

    @classmethod
    def lark(cls, text: str) -> "Grammar":
        """Text matched by a Lark grammar (llguidance's dialect; a GBNF grammar is converted)."""
        import llguidance
        from llguidance.gbnf_to_lark import gbnf_to_lark

        if "::=" in text:   # llama.cpp's GBNF
            try:
                text = gbnf_to_lark(text)
            except Exception as exc:  # noqa: BLE001 - its parser raises plain exceptions
                raise InvalidRequestError(f"invalid GBNF grammar: {exc}") from None
        return cls(llguidance.LLMatcher.grammar_from_lark(text))

    @classmethod
    def regex(cls, pattern: str) -> "Grammar":
        import llguidance

        return cls(llguidance.LLMatcher.grammar_from_regex(pattern))

    @classmethod
    def from_response_format(cls, response_format: Mapping[str, Any]) -> "Grammar | None":
        """OpenAI's `response_format`: {"type": "json_schema", "json_schema": {"schema": {...}}},
        {"type": "json_object"} (any JSON object) or {"type": "text"} (None: unconstrained); and
        {"type": "grammar", "grammar": LARK_OR_GBNF} or {"type": "regex", "regex": PATTERN}."""
        if not isinstance(response_format, Mapping):
            raise InvalidRequestError("response_format must be an object")
        kind = response_format.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls.json_schema({"type": "object"})
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, Mapping) or "schema" not in spec:
                raise InvalidRequestError('response_format json_schema needs {"json_schema": {"schema": {...}}}')
            return cls.json_schema(spec["schema"])
        if kind in ("grammar", "regex") and isinstance(response_format.get(kind), str):
            return cls.lark(response_format[kind]) if kind == "grammar" else cls.regex(response_format[kind])
        raise InvalidRequestError(f"unsupported response_format {dict(response_format)!r}: use type text, "
                                  "json_object, json_schema (with json_schema.schema), grammar or regex")


class GrammarVocab:
    """A model's token list as llguidance sees it, and the grammars compiled over it (an LRU).
    Built once per model (about a second): `LlamaModel.grammar_vocab()`, or `from_token_bytes`."""

    def __init__(self, tokenizer: "llguidance.LLTokenizer", n_vocab: int, cached: int = 16) -> None:
        self.tokenizer = tokenizer
        self.n_vocab = n_vocab
        self.eog = np.zeros(n_vocab, bool)
        self.eog[[t for t in tokenizer.eos_tokens if t < n_vocab]] = True
        self._cursors: OrderedDict[str, _GrammarCursor] = OrderedDict()
        self._cached = cached
        self._lock = threading.Lock()

    @classmethod
    def from_token_bytes(cls, tokens: Sequence[bytes], eog: Sequence[int],
                         tokenize: Callable[[bytes], list[int]]) -> "GrammarVocab":
        """From each token's bytes (special tokens: b"\\xff" + their text) and the end-of-generation ids.
        Every byte a grammar may need must be some token (llguidance's masks assume it; byte-level
        vocabularies such as Qwen's and SmolLM2's have all 256)."""
        import llguidance

        class _Wrapped:
            eos_token_id, bos_token_id, special_token_ids = eog[0], None, list(eog)

            def __init__(self) -> None:
                self.tokens = list(tokens)

            def __call__(self, text: bytes | str) -> list[int]:
                return tokenize(text.encode() if isinstance(text, str) else text)

        tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Wrapped()), eos_token=list(eog))
        return cls(tok, len(tokens))

    def cursor(self, text: str) -> "_GrammarCursor":
        with self._lock:
            cursor = self._cursors.pop(text, None) or _GrammarCursor(self, text)
            self._cursors[text] = cursor
            while len(self._cursors) > self._cached:
                self._cursors.popitem(last=False)
            return cursor


class _GrammarCursor:
    """One compiled grammar and a matcher that is moved to any answer by rollback and consume, so
    the mask stays a pure function of the answer tokens while trees are walked node by node."""

    MASKS = 128   # recent masks kept (the drafter and a local verifier ask for the same nodes)

    def __init__(self, vocab: GrammarVocab, text: str) -> None:
        import llguidance

        self.vocab = vocab
        self._fresh = llguidance.LLMatcher(vocab.tokenizer, text, log_level=0)
        if self._fresh.is_error():
            raise InvalidRequestError(f"invalid grammar: {self._fresh.get_error().strip()}")
        self._matcher = self._fresh.deep_copy()
        self._consumed: list[int] = []
        self._masks: OrderedDict[tuple[int, ...], np.ndarray | None] = OrderedDict()
        self._lock = threading.Lock()

    def allowed(self, answer: Sequence[int]) -> np.ndarray:
        """Bool mask over the vocabulary of the tokens allowed after `answer`."""
        key = tuple(int(t) for t in answer)
        with self._lock:
            packed = self._masks.pop(key, None) if key in self._masks else self._compute(key)
            self._masks[key] = packed
            while len(self._masks) > self.MASKS:
                self._masks.popitem(last=False)
        if packed is None:   # the answer cannot be continued: only end of generation
            return self.vocab.eog
        return np.unpackbits(packed, bitorder="little", count=self.vocab.n_vocab).astype(bool)

    def _compute(self, answer: tuple[int, ...]) -> np.ndarray | None:
        m = self._matcher
        keep = common_prefix_length(self._consumed, answer)
        if keep < len(self._consumed):
            if not m.rollback(len(self._consumed) - keep):   # refused: start again from the compiled grammar
                self._matcher = m = self._fresh.deep_copy()
                if keep and not m.consume_tokens(self._consumed[:keep]):
                    raise InvalidRequestError(f"grammar: {m.get_error().strip()}")
            del self._consumed[keep:]
        rest = list(answer[keep:])
        valid = m.validate_tokens(rest) if rest else 0   # never consume a bad token: errors are final
        if valid:
            m.consume_tokens(rest[:valid])
            self._consumed += rest[:valid]
        if valid < len(rest):
            return None
        packed = np.frombuffer(m.compute_bitmask(), np.uint8)
        if m.is_error():
            raise InvalidRequestError(f"grammar: {m.get_error().strip()}")
        return packed if packed.any() else None


@dataclass(frozen=True)
class TokenConstraint:
    """Banned token sequences and/or a grammar; `apply(logits, context)` masks what the next
    position may not take (`mask(context)`: the banned ids, `allowed(context)`: the grammar's)."""

    banned: tuple[tuple[int, ...], ...] = ()
    grammar: Grammar | None = None   # what the answer must match (see the module docstring)
    _next: dict = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)
    _cursor: list = field(default_factory=list, init=False, repr=False, compare=False, hash=False)

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
        return bool(self.banned) or self.grammar is not None

    def placed(self, start: int) -> "TokenConstraint":
        """This constraint with its grammar starting at context position `start` (the prompt's
        length), unless it was placed already."""
        if self.grammar is None or self.grammar.start >= 0:
            return self
        return replace(self, grammar=replace(self.grammar, start=start))

    def bind(self, vocab: GrammarVocab | Callable[[], GrammarVocab]) -> "TokenConstraint":
        """Compile the grammar over `vocab` (once; the compiled grammar is cached by the vocab).
        Every side that applies a grammar binds it to its model's token list first; a callable is
        called only when there is a grammar to bind (building a vocab takes about a second)."""
        if self.grammar is not None and not self._cursor:
            vocab = vocab if isinstance(vocab, GrammarVocab) else vocab()
            if vocab.n_vocab <= 0:
                raise InvalidRequestError("an empty vocabulary cannot carry a grammar")
            self._cursor.append(vocab.cursor(self.grammar.text))
        return self

    @property
    def bound(self) -> bool:
        return self.grammar is None or bool(self._cursor)

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

    def allowed(self, context: Sequence[int]) -> np.ndarray | None:
        """The grammar's mask after `context` (bool over the vocabulary), None without a grammar."""
        if self.grammar is None:
            return None
        if not self._cursor:
            raise InvalidRequestError("this side cannot apply the grammar: it was never bound to a token list")
        if self.grammar.start < 0:
            raise InvalidRequestError("the grammar's start position was never placed")
        return self._cursor[0].allowed(context[self.grammar.start:])

    def apply(self, logits: np.ndarray, context: Sequence[int]) -> np.ndarray:
        """`logits` with the banned ids, and the ids the grammar rules out, at -inf (a copy; the
        input is left alone)."""
        banned = self.mask(context)
        allowed = self.allowed(context)
        if not banned and allowed is None:
            return logits
        out = np.array(logits, dtype=np.float32 if np.asarray(logits).dtype == np.float32 else np.float64)
        if allowed is not None:
            n = min(out.size, allowed.size)
            out[:n][~allowed[:n]] = -np.inf
            out[n:] = -np.inf
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
