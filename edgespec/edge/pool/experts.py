"""Draft experts: anything that proposes continuations of the committed context as a scored tree.

Every expert answers `propose(committed, shape, sampling, step, stop) -> Draft`, a tree rooted at
committed[-1] with at most `shape.budget` drafted nodes, whose `scores` estimate each node's path
acceptance (the draft model's path probability, a lookup's match frequency, a template's prior)
and whose `seconds` is what proposing cost. The pool (pool.py) merges several experts' trees into
one (merge.py). Experts that hold a KV cache (the draft model, its LoRA variants) also keep it in
step with what was accepted (`accept`).

Kinds: "model" (a GGUF draft model through drafting.Drafter), "lora" (the same with a LoRA adapter
on a base model: runtime/lora.py), "lookup" (lookup.py), "template" (templates.py).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

import numpy as np

from edgespec.common.sampling import SamplingParams
from edgespec.common.tree import TokenTree
from edgespec.edge.drafting import Draft, Drafter, TreeShape
from edgespec.runtime.llama import ContextConfig, LlamaModel

Stop = Callable[[], bool] | None


class Expert(Protocol):
    """What the pool needs from an expert (see the module docstring)."""

    name: str
    kind: str

    def propose(self, committed: list[int], shape: TreeShape, sampling: SamplingParams, step: int,
                stop: Stop = None) -> Draft: ...

    def accept(self, draft: Draft, path: list[int]) -> None:
        """`path` (nodes of this expert's own `draft`) was accepted: keep state in step."""

    def predict_next(self, committed: list[int]) -> int | None:
        """The expert's best guess of the target's next token, None if it has none."""

    def nbytes(self) -> int:
        """Memory held while resident (weights, KV cache, index); an estimate where not exact."""

    def close(self) -> None: ...


@dataclass
class ExpertStats:
    """What an expert's proposals were worth, for the merge (calibration) and the router.

    Counted against what the target committed (pool.py resolves each tree once the context has
    moved past its root): a node is an `opportunity` when its parent was accepted (or is the root),
    `accepted` when the target's token matched it. `acceptance` is accepted / opportunities with a
    weak prior (2 of 4), i.e. the conditional acceptance of a proposed node.
    """

    proposals: int = 0
    nodes: int = 0               # nodes proposed
    sent: int = 0                # of those, nodes kept in the merged tree (before a planner cut)
    opportunities: int = 0
    accepted: int = 0
    seconds: float = 0.0
    prior_accepted: float = 2.0
    prior_opportunities: float = 4.0

    @property
    def acceptance(self) -> float:
        return (self.accepted + self.prior_accepted) / (self.opportunities + self.prior_opportunities)

    @property
    def seconds_per_proposal(self) -> float:
        return self.seconds / self.proposals if self.proposals else 0.0

    def as_dict(self) -> dict:
        return {"proposals": self.proposals, "nodes": self.nodes, "sent": self.sent, "opportunities": self.opportunities,
                "accepted": self.accepted, "acceptance": round(self.acceptance, 4),
                "ms_per_proposal": round(1000 * self.seconds_per_proposal, 3)}


def root_only(committed: list[int]) -> Draft:
    """An empty proposal (no drafted node)."""
    return Draft(TokenTree.chain(committed[-1], []), [0], np.ones(1))


def chains_to_draft(committed: list[int], chains: list[tuple[list[int], list[float]]], seconds: float,
                    max_depth: int, budget: int) -> Draft:
    """Token chains with per-token path scores -> one prefix-shared tree (node_seq -1: not decoded).

    A shared prefix keeps the highest score proposed for it; the tree is then cut to the `budget`
    best nodes (a child never outscores its parent, so every cut is a tree).
    """
    tokens, parents, scores = [committed[-1]], [-1], [1.0]
    index: dict[tuple[int, int], int] = {}
    for chain, chain_scores in chains:
        node = 0
        for token, score in list(zip(chain, chain_scores))[:max_depth]:
            score = min(score, scores[node])
            child = index.get((node, token))
            if child is None:
                child = index[(node, token)] = len(tokens)
                tokens.append(int(token))
                parents.append(node)
                scores.append(score)
            else:
                scores[child] = max(scores[child], score)
            node = child
    tree = TokenTree(tokens=np.array(tokens, np.int32), parents=np.array(parents, np.int32))
    draft = Draft(tree, [0] + [-1] * (len(tokens) - 1), np.array(scores, np.float64))
    draft = draft.pruned(budget)
    draft.seconds = seconds
    return draft


class _DrafterBacked:
    """Experts that draft with a model `Drafter` (the base model, or the base with a LoRA adapter)."""

    drafter: Drafter | None  # loaded lazily by the subclasses; set whenever propose is called

    def propose(self, committed: list[int], shape: TreeShape, sampling: SamplingParams, step: int,
                stop: Stop = None) -> Draft:
        return self.drafter.grow(committed, shape, sampling, step, stop=stop)

    def accept(self, draft: Draft, path: list[int]) -> None:
        self.drafter.accept(draft, path)

    def predict_next(self, committed: list[int]) -> int | None:
        return self.drafter.predict_next(committed)


@dataclass
class ModelExpert(_DrafterBacked):
    """A GGUF draft model (drafting.Drafter). Built around a loaded Drafter (pinned: its owner,
    e.g. EdgeSession, frees it) or from a path, loaded when the pool first needs it."""

    name: str
    path: Path | None = None
    config: ContextConfig = field(default_factory=ContextConfig)
    drafter: Drafter | None = None
    kind: str = "model"

    @classmethod
    def around(cls, name: str, drafter: Drafter) -> "ModelExpert":
        return cls(name=name, drafter=drafter)

    @classmethod
    def from_path(cls, name: str, path: str | os.PathLike, config: ContextConfig = ContextConfig()) -> "ModelExpert":
        return cls(name=name, path=Path(path), config=config)

    @property
    def pinned(self) -> bool:
        """Owned by someone else: the pool never evicts it."""
        return self.path is None

    def load(self) -> None:
        if self.drafter is None:
            self.drafter = Drafter(LlamaModel(self.path), self.config)

    def loaded(self) -> bool:
        return self.drafter is not None

    def estimated_bytes(self) -> int:
        """Before loading: the GGUF file (weights are mapped whole) plus its KV cache, estimated."""
        if self.drafter is not None:
            return self.nbytes()
        return self.path.stat().st_size + kv_bytes_estimate(self.config.n_ctx)

    def nbytes(self) -> int:
        if self.drafter is None:
            return 0
        model = self.drafter.model
        weights = model.path.stat().st_size if hasattr(model, "path") else 0
        return weights + kv_bytes(model, getattr(self.drafter.ctx, "n_ctx", self.config.n_ctx))

    def close(self) -> None:
        """Free what this expert loaded itself (a pinned drafter belongs to its owner)."""
        if self.drafter is not None and not self.pinned:
            self.drafter.close()
            self.drafter.model.close()
            self.drafter = None


def kv_bytes(model: LlamaModel, n_ctx: int) -> int:
    """f16 K and V for every layer and KV head over n_ctx cells (what llama.cpp allocates)."""
    import llama_cpp as C

    raw = getattr(model, "_model", None)
    if not raw:
        return 0
    head_dim = C.llama_model_n_embd(raw) // max(1, C.llama_model_n_head(raw))
    return 2 * 2 * C.llama_model_n_layer(raw) * C.llama_model_n_head_kv(raw) * head_dim * n_ctx


def kv_bytes_estimate(n_ctx: int) -> int:
    """KV bytes of an unloaded small draft model (Qwen2.5 0.5B: 12 KiB per cell), before loading."""
    return 12 * 1024 * n_ctx


@dataclass
class LoraExpert(_DrafterBacked):
    """A LoRA adapter on a base ModelExpert's weights (runtime/lora.py): its own KV context on the
    shared base model, so switching experts costs no reload and no re-prefill of the other's cache
    (an adapter changes every layer's output, so one KV cache cannot serve two adapters)."""

    name: str
    base: ModelExpert
    adapter_path: Path | None
    scale: float = 1.0
    config: ContextConfig = field(default_factory=ContextConfig)
    kind: str = "lora"
    drafter: Drafter | None = None
    adapter: object | None = None    # runtime.lora.LoraAdapter once loaded

    pinned = False

    def load(self) -> None:
        from edgespec.runtime.lora import LoraAdapter, set_adapters

        self.base.load()
        model = self.base.drafter.model
        adapter = None if self.adapter_path is None else LoraAdapter(model, self.adapter_path)
        drafter = Drafter(model, self.config)
        set_adapters(drafter.ctx, [] if adapter is None else [(adapter, self.scale)])
        self.adapter, self.drafter = adapter, drafter

    def loaded(self) -> bool:
        return self.drafter is not None

    def estimated_bytes(self) -> int:
        if self.drafter is not None:
            return self.nbytes()
        adapter = 0 if self.adapter_path is None else Path(self.adapter_path).stat().st_size
        return adapter + kv_bytes_estimate(self.config.n_ctx)

    def swap(self, adapter_path: str | os.PathLike | None, scale: float | None = None) -> Path | None:
        """Hot-swap the adapter (a new version from distillation; None: the bare base model) without
        reloading the base; returns the previous path (to roll back). The KV cache is rebuilt on
        the next draft, since it was computed under the old adapter."""
        from edgespec.runtime.lora import LoraAdapter, set_adapters

        previous = self.adapter_path
        self.scale = self.scale if scale is None else scale
        if self.drafter is not None:
            new = None if adapter_path is None else LoraAdapter(self.drafter.model, adapter_path)
            set_adapters(self.drafter.ctx, [] if new is None else [(new, self.scale)])
            if self.adapter is not None:
                self.adapter.close()
            self.adapter = new
        self.adapter_path = None if adapter_path is None else Path(adapter_path)
        return previous

    def nbytes(self) -> int:
        """The adapter and this expert's KV cache; the base's weights count for the base expert."""
        if self.drafter is None:
            return 0
        adapter = self.adapter.nbytes if self.adapter is not None else 0
        return adapter + kv_bytes(self.drafter.model, getattr(self.drafter.ctx, "n_ctx", self.config.n_ctx))

    def close(self) -> None:
        """Unload: free the context first (it points at the adapter), then the adapter."""
        if self.drafter is not None:
            self.drafter.close()
            self.drafter = None
        if self.adapter is not None:
            self.adapter.close()
            self.adapter = None
