"""Who owns the committed context when no decoder does.

On the edge the decoder owns it and passes it to its verifier on every call (`ContextVerifier`).
Callers without a decoder -- the verifier service's sessions, tests, benchmarks -- wrap such a
verifier in a `Conversation`, which owns the context and extends it with every answer. Free of
llama.cpp, so the gRPC link can use it on hosts without llama-cpp-python.
"""
from __future__ import annotations

from typing import Protocol, Sequence

from edgespec.common.acceptance import VerifyResult
from edgespec.common.sampling import SamplingParams
from edgespec.common.tree import TokenTree


class ContextVerifier(Protocol):
    """A verifier told the committed context on every call (the decoder's Verifier protocol)."""

    def sync(self, context: Sequence[int]) -> None: ...
    def verify(self, context: Sequence[int], tree: TokenTree, sampling: SamplingParams, step: int) -> VerifyResult: ...
    def close(self) -> None: ...


class Conversation:
    """Owns one conversation's committed context over a ContextVerifier (no decoder around)."""

    def __init__(self, verifier: ContextVerifier) -> None:
        self.verifier = verifier
        self.committed: list[int] = []

    def sync(self, committed: Sequence[int]) -> None:
        """Adopt a new committed context (new conversation, new turn)."""
        committed = [int(t) for t in committed]
        self.committed = []  # in doubt until the verifier has it
        self.verifier.sync(committed)
        self.committed = committed

    def verify(self, tree: TokenTree, sampling: SamplingParams, step: int) -> VerifyResult:
        """Verify after the committed context and commit the answer."""
        result = self.verifier.verify(self.committed, tree, sampling, step)
        self.committed.extend(int(t) for t in result.tokens)
        return result

    def close(self) -> None:
        self.verifier.close()

    def __enter__(self) -> "Conversation":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class OwnedContext(Protocol):
    """A verifier that owns its context, as a verifier service's BackendSession does."""

    @property
    def committed_tokens(self) -> list[int]: ...
    def sync(self, tokens: list[int]) -> None: ...
    def verify(self, tree: TokenTree, sampling: SamplingParams, step: int) -> VerifyResult: ...
    def close(self) -> None: ...


class ToldContext:
    """Puts a verifier that owns its context under a caller that owns it (the decoder): the
    caller's context wins, and the verifier is re-synced whenever it holds anything else. For
    tests that verify with a verifier service's backend session in-process."""

    def __init__(self, owner: OwnedContext) -> None:
        self.owner = owner

    def sync(self, context: Sequence[int]) -> None:
        self.owner.sync(list(context))

    def verify(self, context: Sequence[int], tree: TokenTree, sampling: SamplingParams, step: int) -> VerifyResult:
        if self.owner.committed_tokens != list(context):
            self.owner.sync(list(context))
        return self.owner.verify(tree, sampling, step)

    def close(self) -> None:
        self.owner.close()
