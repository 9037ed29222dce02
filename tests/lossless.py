"""Helpers for losslessness checks: target-only greedy reference and the near-tie rule."""
from __future__ import annotations

from dataclasses import dataclass

from edgespec.common.sampling import SamplingParams
from edgespec.common.tree import TokenTree
from edgespec.runtime.llama import ContextConfig, LlamaModel
from edgespec.runtime.tree_verifier import LlamaTreeVerifier

# Batch shape changes llama.cpp logits slightly (MODELS.md: greedy divergences observed where the
# target's top-2 logits differ by 0.03-0.11). A divergence is accepted only below this gap.
NEAR_TIE_MARGIN = 0.5
GREEDY = SamplingParams()


@dataclass
class Reference:
    tokens: list[int]
    margins: list[float]


def greedy_reference(verifier, prompt: list[int], n: int, is_end) -> Reference:
    """Plain autoregressive greedy decoding with any verifier session (root-only trees: one token
    per step); `verifier` needs sync/verify/committed (llama.cpp or torch backends)."""
    verifier.sync(prompt)
    tokens, margins = [], []
    for step in range(n):
        result = verifier.verify(TokenTree.chain(verifier.committed[-1], []), GREEDY, step)
        tokens += result.tokens
        margins += result.margins
        if is_end(result.tokens[-1]):
            break
    return Reference(tokens, margins)


def target_only_greedy(model: LlamaModel, prompt: list[int], n: int) -> Reference:
    """The llama.cpp target's own greedy output."""
    verifier = LlamaTreeVerifier(model, ContextConfig(n_ctx=2048))
    try:
        return greedy_reference(verifier, prompt, n, model.is_end_of_generation)
    finally:
        verifier.close()


def spec_tokens(session, prompt: list[int], n: int, sampling: SamplingParams = GREEDY) -> list[int]:
    """Speculative output with the end-of-generation token kept (if it came before n tokens)."""
    out = [t for chunk in session.generate_tokens(prompt, n, sampling) for t in chunk]
    return out + [session.draft_model.eos] if len(out) < n else out


def first_divergence(candidate: list[int], reference: list[int]) -> int | None:
    n = min(len(candidate), len(reference))
    return next((i for i in range(n) if candidate[i] != reference[i]), None)


def assert_lossless(candidate: list[int], ref: Reference, label: str) -> bool:
    """True if identical up to the shorter length; a divergence must sit at a near-tie of the target.

    Both sequences keep their end-of-generation token, so stopping early is a divergence too.
    """
    i = first_divergence(candidate, ref.tokens)
    if i is None:
        return True
    assert ref.margins[i] < NEAR_TIE_MARGIN, (
        f"{label}: diverged from target-only greedy at token {i} where the target's top-2 margin is "
        f"{ref.margins[i]:.3f} (>= {NEAR_TIE_MARGIN}): not a floating-point near-tie")
    return False
