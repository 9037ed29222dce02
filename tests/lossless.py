"""Losslessness checks: the target-only greedy reference, and the one rule for a divergence.

On llama.cpp a different batch shape or KV-cache layout changes logits in the last bits (plus a
few tenths of a logit on a quantised model), so speculative greedy output may leave target-only
greedy output where the target's top two tokens are close. A fixed margin cannot tell such a flip
from a wrong acceptance at the same spot, so every divergence is EXPLAINED with measured logits
(`explain_divergence`):

  (a) the logits the verifier itself computed for the deciding node (recorded in the verifying
      process, in the batch shape it used: tests/logit_record.py) have the emitted token as their
      argmax, i.e. acceptance was applied correctly to the logits it had; and
  (b) the target-only logits for the same context pick another token, by a margin m, and the two
      measured rows differ by at least m where it matters: the gap between the two tokens moved by
      shift = m + (batch gap) >= m. The flip is numerics, and `max_abs_diff` (largest change of any
      logit among both rows' top tokens) must stay below NUMERIC_SANITY, well above what a batch
      shape does but far below what a wrong context or mask does.

Anything else (no recorded logits for that context, an argmax that is not the emitted token, a
token outside the target's top choices) fails. The float32 torch backend needs no rule: its
speculative output must equal its target-only output exactly (tests/test_torch_backend.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import logit_record
from edgespec.common.sampling import SamplingParams
from edgespec.common.tree import TokenTree
from edgespec.runtime.llama import ContextConfig, LlamaModel
from edgespec.runtime.tree_verifier import LlamaTreeVerifier
from logit_record import Row

GREEDY = SamplingParams()
# Not an allowance: a bound on how far two computations of the SAME context may differ for the
# difference to count as rounding. Batch shape moves the Qwen 1.5B target's logits by up to about
# 0.5 (issue 8) and SmolLM2's by less; a wrong context, position or attention mask by several units.
NUMERIC_SANITY = 2.0

logit_record.install()
logit_record.enable_children()


@dataclass(frozen=True)
class Explanation:
    """A divergence explained by measured logits (see the module docstring)."""

    position: int        # index of the diverging token in the generated output
    emitted: int         # what the speculative run emitted (the verifier's argmax)
    target: int          # what target-only decoding picks there
    margin: float        # target-only: logit(target) - logit(emitted), >= 0
    batch_gap: float     # verifier's row: logit(emitted) - logit(target), >= 0
    max_abs_diff: float  # largest |verifier - target-only| over both rows' top tokens
    source: str          # which verifier process, tree and node

    @property
    def shift(self) -> float:
        """How much the gap between the two tokens moved from target-only to the verifier's batch."""
        return self.margin + self.batch_gap

    def __str__(self) -> str:
        return (f"token {self.position}: emitted {self.emitted}, target-only {self.target}; target-only margin "
                f"{self.margin:.4f}, verifier's batch gap {self.batch_gap:.4f}, shift {self.shift:.4f}, "
                f"max |batch - target-only| {self.max_abs_diff:.4f} ({self.source})")


EXPLAINED: list[Explanation] = []   # every divergence explained in this test process, for reports


@dataclass
class Reference:
    tokens: list[int]
    margins: list[float]
    prompt: list[int] = field(default_factory=list)
    rows: list[Row] = field(default_factory=list)   # target-only logits (top) before each token
    model: str | None = None                        # model file name (llama.cpp references)


def greedy_reference(verifier, prompt: list[int], n: int, is_end) -> Reference:
    """Plain autoregressive greedy decoding with any verifier session (root-only trees: one token
    per step); `verifier` needs sync/verify/committed (llama.cpp or torch backends). On llama.cpp
    the logits of each step are kept as the target-only side of an explanation."""
    tokens, margins = [], []
    with logit_record.capture() as records:
        verifier.sync(prompt)
        for step in range(n):
            result = verifier.verify(TokenTree.chain(verifier.committed[-1], []), GREEDY, step)
            tokens += result.tokens
            margins += result.margins
            if is_end(result.tokens[-1]):
                break
    rows = [rec.row(0) for rec in records]
    model = records[0].model if records else None
    return Reference(tokens, margins, list(prompt), rows if len(rows) == len(tokens) else [], model)


def target_only_greedy(model: LlamaModel, prompt: list[int], n: int) -> Reference:
    """The llama.cpp target's own greedy output."""
    verifier = LlamaTreeVerifier(model, ContextConfig(n_ctx=2048))
    try:
        return greedy_reference(verifier, prompt, n, model.is_end_of_generation)
    finally:
        verifier.close()


def target_only_row(model: LlamaModel, context: list[int], n_ctx: int = 2048) -> Row:
    """The target's logits after `context`, decoded as one plain batch on a fresh context."""
    verifier = LlamaTreeVerifier(model, ContextConfig(n_ctx=n_ctx))
    try:
        with logit_record.capture() as records:
            verifier.sync(context)
            verifier.verify(TokenTree.chain(context[-1], []), GREEDY, 0)
        return records[-1].row(0)
    finally:
        verifier.close()


def spec_tokens(session, prompt: list[int], n: int, sampling: SamplingParams = GREEDY) -> list[int]:
    """Speculative output with the end-of-generation token kept (if it came before n tokens)."""
    out = [t for chunk in session.generate_tokens(prompt, n, sampling) for t in chunk]
    return out + [session.draft_model.eos] if len(out) < n else out


def first_divergence(candidate: list[int], reference: list[int]) -> int | None:
    n = min(len(candidate), len(reference))
    return next((i for i in range(n) if candidate[i] != reference[i]), None)


def explain_divergence(context: list[int], emitted: int, target_row: Row, label: str, *,
                       model: str | None = None, position: int = -1, verifier_here: bool | None = None,
                       records: list[logit_record.TreeRecord] | None = None) -> Explanation:
    """Assert that a verifier emitting `emitted` after `context`, where target-only logits
    (`target_row`) pick another token, is explained by numerics; the one rule every test uses.

    The verifier's own row is the most recent recorded node with exactly this context: in
    `records` if given, else in any process (verifier_here=True/False: this process / verifier
    children only)."""
    target = target_row.argmax
    assert target != emitted, f"{label}: token {position} ({emitted}) is target-only's own choice: nothing to explain"
    found = logit_record.latest(context, model, here=verifier_here, records=records)
    assert found is not None, (
        f"{label}: diverged at token {position} (emitted {emitted}, target-only {target}) and no verifier logits were "
        "recorded for that context, so the divergence cannot be explained")
    record, node = found
    batch = record.row(node)
    source = record.describe(node)
    # (a) acceptance was applied correctly to the logits the verifier had
    assert batch.argmax == emitted, (
        f"{label}: token {position}: the verifier emitted {emitted} but its own logits for that node pick "
        f"{batch.argmax} ({source}): a wrong acceptance, not numerics")
    # (b) target-only logits differ from the verifier's by at least the margin between the two tokens
    t_emitted, b_target = target_row.value(emitted), batch.value(target)
    assert t_emitted is not None and b_target is not None, (
        f"{label}: token {position}: emitted {emitted} and target-only {target} are not both among the top "
        f"{logit_record.TOP_K} of both rows ({source}): not a near-tie")
    margin = target_row.value(target) - t_emitted
    batch_gap = batch.value(emitted) - b_target
    common = {int(t) for t in target_row.ids} & {int(t) for t in batch.ids}
    max_abs_diff = max(abs(batch.value(t) - target_row.value(t)) for t in common)
    explanation = Explanation(position, emitted, target, margin, batch_gap, max_abs_diff, source)
    assert explanation.shift >= margin and max_abs_diff >= margin / 2, f"{label}: {explanation}: shift below the margin"
    assert max_abs_diff < NUMERIC_SANITY, (
        f"{label}: {explanation}: the verifier's logits differ from target-only by more than rounding "
        f"(>= {NUMERIC_SANITY}): wrong context or attention, not numerics")
    EXPLAINED.append(explanation)
    print(f"{label}: divergence explained: {explanation}")
    return explanation


def assert_lossless(candidate: list[int], ref: Reference, label: str) -> bool:
    """True if identical up to the shorter length; False if the first divergence is explained by
    numerics (explain_divergence), which is then where comparing must stop.

    Both sequences keep their end-of-generation token, so stopping early is a divergence too.
    """
    i = first_divergence(candidate, ref.tokens)
    if i is None:
        return True
    assert ref.rows, (f"{label}: diverged from the target-only reference at token {i} ({candidate[i]} != "
                      f"{ref.tokens[i]}) and the reference has no llama.cpp logits: no divergence is allowed")
    explain_divergence(ref.prompt + candidate[:i], candidate[i], ref.rows[i], label, model=ref.model, position=i)
    return False


def model_name(model: LlamaModel) -> str:
    """The name recorded with each tree (tests/logit_record.py)."""
    return Path(str(model.path)).name
