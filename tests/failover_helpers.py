"""Shared by the failover tests (test_failover, test_embedded, test_fleet, test_fault_campaign): the run they
generate and the invariant every run must keep -- nothing lost or duplicated, the target's output,
streamed chunks that concatenate to the text."""
from __future__ import annotations

import time

from edgespec import EdgeSession, TreeShape
from edgespec.common.tree import TokenTree
from edgespec.runtime.llama import ContextConfig
from edgespec.runtime.tree_verifier import LlamaTreeVerifier
from logit_record import capture
from lossless import GREEDY, assert_lossless, explain_divergence, model_name

N_CTX = 2048
SHAPE = TreeShape(budget=6, max_depth=3, branching=2, width=2)  # a small real tree; fixed, so runs compare
PROMPT = "Explain, step by step and in detail, how a computer boots."
MAX_TOKENS = 160
PROBE_S = 0.3


class Recorder:
    """Spies on the session's decode loop (session.decoder.run): the tokens emitted per step, with
    the time they came (monotonic, and wall-clock to compare with the failover's event times)."""

    def __init__(self, session: EdgeSession) -> None:
        self.steps: list[list[int]] = []
        self.times: list[float] = []
        self.walls: list[float] = []
        inner = session.decoder.run

        def spy(*args, **kwargs):
            for tokens in inner(*args, **kwargs):
                self.steps.append(list(tokens))
                self.times.append(time.monotonic())
                self.walls.append(time.time())
                yield tokens

        session.decoder.run = spy

    @property
    def tokens(self) -> list[int]:
        return [t for step in self.steps for t in step]


def pull(stream, chunks: list[str], until, max_steps: int = 400) -> None:
    """Consume chunks until `until()` holds (the stream must not end first)."""
    for _ in range(max_steps):
        if until():
            return
        chunks.append(next(stream))
    raise AssertionError("condition not reached")


def fo_stats(session: EdgeSession) -> dict:
    return session.stats.extra["failover"]


def assert_targets_choices(model, prompt: list[int], out: list[int], label: str) -> list[int]:
    """Teacher-forced check of EVERY committed token: each is the target's greedy choice after the
    tokens before it (decoded as a plain chain), or the choice of the verifier's own recorded
    logits there, explained by numerics (lossless.explain_divergence). A lost or duplicated token
    would show up here (also after a near-tie, where a plain comparison with a reference run has
    to stop). Returns the positions of explained divergences."""
    verifier = LlamaTreeVerifier(model, ContextConfig(n_ctx=N_CTX))
    ties, i = [], 0
    try:
        verifier.sync(prompt)
        while i < len(out):
            chunk = out[i:i + 16]
            with capture() as records:
                result = verifier.verify(TokenTree.chain(verifier.committed[-1], chunk), GREEDY, i)
            n = len(result.path)
            if n < len(chunk):
                explain_divergence(prompt + out[:i + n], chunk[n], records[-1].row(n), label,
                                   model=model_name(model), position=i + n)
                ties.append(i + n)
                n += 1
            i += n
            verifier.sync(prompt + out[:i])
    finally:
        verifier.close()
    return ties


def check_output(model, prompt: list[int], out: list[int], chunks: list[str], committed: list[int], reference,
                 label: str, max_tokens: int, max_depth: int) -> list[int]:
    """The invariant of every failover run, in-process or reported by an edge child (the fault
    campaigns): the chunks concatenate to the text of exactly the emitted tokens, the decoder's
    committed context is the prompt plus exactly those tokens (nothing lost or duplicated), and
    they are the target's own greedy output, every token checked. Returns the near-tie positions."""
    assert 0 < len(out) <= max_tokens, (label, len(out))
    ended = len(out) < max_tokens
    candidate = out + [model.eos] if ended else out
    text = b"".join(model.token_bytes(t) for t in out).decode("utf-8", "replace")
    assert "".join(chunks) == text, label
    assert committed[:len(prompt) + len(candidate)] == prompt + candidate, label
    assert len(committed) - len(prompt) - len(out) <= max_depth + 1, label  # the last step's overshoot
    assert_lossless(candidate, reference, label)
    ties = assert_targets_choices(model, prompt, candidate, label)
    print(f"{label}: {len(out)} tokens, near-ties at {ties}")
    return ties


def check_run(model, session: EdgeSession, rec: Recorder, chunks: list[str], reference, label: str) -> None:
    """check_output for an in-process session recorded by `rec`."""
    prompt = session.draft_model.chat_tokens([{"role": "user", "content": PROMPT}])
    check_output(model, prompt, rec.tokens, chunks, session.decoder.committed, reference, label, MAX_TOKENS,
                 SHAPE.max_depth)
