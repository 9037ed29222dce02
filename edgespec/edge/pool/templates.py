"""Templates for structured output: where the format fixes the next tokens, propose them for free.

A rule is a regular expression over the end of the text so far and the continuations it implies,
e.g. after `<tool_call>\\n` (Qwen's and Hermes' tool-call format) comes `{"name": "`, after a
complete call `}}` comes `\\n</tool_call>`, after a ReAct "Thought:" line comes "Action: ". With
the names of the tools the app offers (`tool_rules`), the expert also proposes each tool name and
the `", "arguments": {"` that follows it. A continuation is tokenized as plain text; if the model
would split it differently, the verifier simply accepts less (greedy and target-sample stay exact
for any tree). Scores: the rule's prior times the expert's calibrated per-node acceptance.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from edgespec.common.sampling import SamplingParams
from edgespec.edge.drafting import Draft, TreeShape
from edgespec.edge.pool.experts import ExpertStats, Stop, chains_to_draft, root_only


@dataclass(frozen=True)
class Rule:
    pattern: re.Pattern
    continuations: tuple[str, ...]
    prior: float = 0.9          # probability that the format continues this way (split over continuations)


def rule(pattern: str, *continuations: str, prior: float = 0.9) -> Rule:
    return Rule(re.compile(pattern + r"\Z", re.DOTALL), tuple(continuations), prior)


DEFAULT_RULES: tuple[Rule, ...] = (
    rule(r"<tool_call>\n", '{"name": "'),
    rule(r'\{"name": "[\w.\-]+', '", "arguments": {"'),
    rule(r'"arguments": \{.*\}\}', "\n</tool_call>", "\n</tool_call><|im_end|>", prior=0.8),
    rule(r'"arguments": \{\}', "}\n</tool_call>"),
    rule(r"(^|\n)Thought:[^\n]*\n", "Action: "),
    rule(r"(^|\n)Action: [^\n]*\n", "Action Input: "),
    rule(r"(^|\n)Action Input: [^\n]*\n", "Observation: "),
    rule(r"(^|\n)Observation: [^\n]*\n", "Thought: "),
)


def tool_rules(names: Sequence[str]) -> tuple[Rule, ...]:
    """Rules that complete a call to one of the app's tools once `{"name": "` is written."""
    return (rule(r'\{"name": "', *(f'{n}", "arguments": {{"' for n in names)),)


class TemplateExpert:
    """Proposes the continuations of every rule that matches the end of the text so far."""

    kind = "template"

    def __init__(self, tokenize: Callable[[str], list[int]], detokenize: Callable[[list[int]], str],
                 rules: Sequence[Rule] = DEFAULT_RULES, name: str = "template", tail_tokens: int = 64) -> None:
        self.name = name
        self.tokenize, self.detokenize = tokenize, detokenize
        self.rules = tuple(rules)
        self.tail_tokens = tail_tokens
        self.stats = ExpertStats(prior_accepted=3.0, prior_opportunities=4.0)
        self._tokens: dict[str, list[int]] = {}

    @classmethod
    def for_model(cls, model, tools: Sequence[str] = (), **kwargs) -> "TemplateExpert":
        """Rules over a LlamaModel's tokenizer (special tokens such as <|im_end|> parsed)."""
        rules = tuple(kwargs.pop("rules", DEFAULT_RULES)) + (tool_rules(tools) if tools else ())
        return cls(lambda text: model.tokenize(text, add_special=False, parse_special=True), model.detokenize,
                   rules=rules, **kwargs)

    def propose(self, committed: list[int], shape: TreeShape, sampling: SamplingParams, step: int,
                stop: Stop = None) -> Draft:
        started = time.perf_counter()
        text = self.detokenize(committed[-self.tail_tokens:])
        per_node = self.stats.acceptance
        chains = []
        for r in self.rules:
            if r.pattern.search(text):
                share = r.prior / len(r.continuations)
                for continuation in r.continuations:
                    tokens = self._tokenized(continuation)
                    chains.append((tokens, [share * per_node ** d for d in range(1, len(tokens) + 1)]))
        if not chains:
            draft = root_only(committed)
            draft.seconds = time.perf_counter() - started
            return draft
        return chains_to_draft(committed, chains, time.perf_counter() - started, shape.max_depth, shape.budget)

    def _tokenized(self, text: str) -> list[int]:
        if text not in self._tokens:
            self._tokens[text] = self.tokenize(text)
        return self._tokens[text]

    def accept(self, draft: Draft, path: list[int]) -> None:
        pass

    def predict_next(self, committed: list[int]) -> int | None:
        return None

    def nbytes(self) -> int:
        return 0

    def close(self) -> None:
        pass
