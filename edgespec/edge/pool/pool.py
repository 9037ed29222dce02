"""The draft pool: several experts behind the Drafter interface the decoder already uses.

`DraftPool.grow` asks every active expert for a tree and merges them into one (merge.py); `accept`
keeps every expert with a KV cache in step with what the target accepted; `predict_next` asks the
primary model. The decoder cannot tell a pool from a Drafter.

Memory: experts that can be loaded and unloaded (GGUF models and LoRA adapters built from paths)
are loaded when first needed and evicted least-recently-used when loading another would exceed
`memory_budget` bytes. Pinned experts (a drafter the session owns) and model-free experts (lookup,
templates) always stay. `report()` says what is resident and why.

For the router: `set_active(names)` picks the experts each step consults; `stats()` gives each
expert's measured cost and calibrated acceptance (experts.ExpertStats), counted against what the
target actually committed, so they are right whether or not trees were drafted ahead.

Sampled rejection rule: it needs each node's children drawn from one known q, so the pool then
drafts with its primary model expert alone (never merged; the tree keeps its q and prefix groups).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from edgespec.common.errors import InvalidRequestError
from edgespec.common.sampling import SamplingParams
from edgespec.common.tree import TokenTree
from edgespec.edge.drafting import Draft, TreeShape
from edgespec.edge.pool.experts import Expert, ExpertStats
from edgespec.edge.pool.merge import merge_drafts

GiB = 1 << 30
MODEL_KINDS = ("model", "lora")


class PoolMemoryError(InvalidRequestError):
    """The active experts cannot fit the pool's memory budget together."""


@dataclass
class _Slot:
    expert: Expert
    stats: ExpertStats
    last_used: int = -1          # step counter of the last use (LRU)
    why: str = "registered, not loaded"
    last_draft: Draft | None = None   # its latest proposal (to map accepted paths onto its own tree)

    @property
    def evictable(self) -> bool:
        """Loaded from a path by the pool (a pinned drafter or a model-free expert is never evicted)."""
        return hasattr(self.expert, "load") and not getattr(self.expert, "pinned", True)

    @property
    def resident(self) -> bool:
        loaded = getattr(self.expert, "loaded", None)
        return loaded() if loaded is not None else True


@dataclass
class _Pending:
    """A proposed tree, resolved against the committed context once it has moved past the root."""

    n_context: int
    tail: tuple[int, ...]        # the context's last tokens (cheap check that it is still the context)
    tree: TokenTree
    origins: list[frozenset]


@dataclass
class PoolOverhead:
    """Time the pool itself spends per step (merge, bookkeeping), apart from the experts' drafting."""

    steps: int = 0
    seconds: float = 0.0
    expert_seconds: float = 0.0

    @property
    def fraction(self) -> float:
        return self.seconds / self.expert_seconds if self.expert_seconds else 0.0


class DraftPool:
    def __init__(self, experts: Sequence[Expert], memory_budget: int = 2 * GiB,
                 active: Iterable[str] | None = None, skip_models_at: float | None = None) -> None:
        """skip_models_at: when the model-free experts' best tree already promises this many accepted
        tokens (the sum of its node scores, i.e. of estimated path acceptances), the model experts
        are not asked that step: their drafting costs 100-1000x more (long copies in edits and
        follow-ups). None: always ask them."""
        names = [e.name for e in experts]
        if len(set(names)) != len(names):
            raise InvalidRequestError(f"expert names must be unique: {names}")
        if not experts:
            raise InvalidRequestError("a draft pool needs at least one expert")
        orphans = [e.name for e in experts if getattr(e, "base", None) is not None and e.base.name not in names]
        if orphans:
            raise InvalidRequestError(f"LoRA experts {orphans} need their base model expert in the same pool")
        self.memory_budget = memory_budget
        self.skip_models_at = skip_models_at
        self.skipped_model_proposals = 0
        self._slots: dict[str, _Slot] = {e.name: _Slot(e, getattr(e, "stats", None) or ExpertStats()) for e in experts}
        for slot in self._slots.values():
            if not slot.evictable:
                slot.why = "pinned (owned by the session)" if slot.expert.kind in MODEL_KINDS else "model-free, always resident"
        self._active: list[str] = []
        self.set_active(names if active is None else active)
        self._tick = 0
        self._pending: deque[_Pending] = deque(maxlen=4)
        self.overhead = PoolOverhead()
        self.merged_steps = 0    # steps whose sent tree held nodes of more than one expert
        self.events: deque[str] = deque(maxlen=50)   # loads and evictions, newest last

    # -- the router's side ----------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        return list(self._slots)

    @property
    def active(self) -> list[str]:
        return list(self._active)

    def set_active(self, names: Iterable[str]) -> None:
        """Consult these experts from the next step on (in this order: the first model-kind expert
        is the primary, which guesses the target's next token). Loading happens at first use."""
        names = list(dict.fromkeys(names))
        unknown = [n for n in names if n not in self._slots]
        if unknown or not names:
            raise InvalidRequestError(f"unknown or no experts {unknown or names}; the pool has {self.names}")
        self._active = names

    def expert(self, name: str) -> Expert:
        return self._slots[name].expert

    def stats(self) -> dict[str, ExpertStats]:
        """Per expert: proposals, nodes, measured acceptance, seconds (see ExpertStats)."""
        return {name: slot.stats for name, slot in self._slots.items()}

    def report(self) -> list[dict]:
        """What is resident, how many bytes, and why (pinned, active, kept by LRU, evicted)."""
        return [{"name": name, "kind": slot.expert.kind, "resident": slot.resident,
                 "bytes": slot.expert.nbytes() if slot.resident else 0, "active": name in self._active,
                 "evictable": slot.evictable, "last_used_step": slot.last_used, "why": slot.why,
                 **slot.stats.as_dict()} for name, slot in self._slots.items()]

    def resident_bytes(self) -> int:
        return sum(slot.expert.nbytes() for slot in self._slots.values() if slot.resident)

    # -- the decoder's side (the Drafter interface) ----------------------------------------------
    def grow(self, committed: list[int], shape: TreeShape, sampling: SamplingParams, step: int,
             stop: Callable[[], bool] | None = None) -> Draft:
        started = time.perf_counter()
        self._tick += 1
        self._resolve(committed)
        if sampling.needs_q:   # rejection rule: one model's q-drawn tree, never merged (module docstring)
            names = [self._primary()]
        else:
            names = self._active
        for slot in self._slots.values():   # the decoder accepts only the latest tree: older ones are void
            slot.last_draft = None
        load_started = time.perf_counter()
        self._make_resident(names)
        load_seconds = time.perf_counter() - load_started   # lazy loading is not per-step overhead
        parts: list[tuple[str, Draft]] = []
        for name in sorted(names, key=lambda n: self._slots[n].expert.kind in MODEL_KINDS):  # cheap experts first
            slot = self._slots[name]
            if slot.expert.kind in MODEL_KINDS and self._cheap_tree_suffices(parts):
                self.skipped_model_proposals += 1
                continue
            slot.last_used = self._tick
            draft = slot.expert.propose(committed, shape, sampling, step, stop)
            slot.last_draft = draft
            if draft.complete:   # a tree cut short is counted once finished (the same call again)
                slot.stats.proposals += 1
                slot.stats.nodes += len(draft.tree) - 1
                slot.stats.seconds += draft.seconds
            parts.append((name, draft))
        expert_seconds = sum(d.seconds for _, d in parts) + load_seconds
        complete = all(d.complete for _, d in parts)
        catchup = max((d.catchup_tokens for _, d in parts), default=0)   # a model expert that sat out turns
        parts = [p for p in parts if len(p[1].tree) > 1] or parts[:1]   # empty proposals: nothing to merge
        if len(parts) == 1:
            draft, origins = parts[0][1], [frozenset([parts[0][0]])] * len(parts[0][1].tree)
        else:
            merged = merge_drafts(parts, shape.budget)
            draft, origins = merged.draft, merged.origins
        draft.complete = complete   # unfinished: the decoder calls again to finish it (Drafter.grow)
        draft.catchup_tokens = catchup
        if len(draft.tree) > 1 and complete:
            proposers = set().union(*origins[1:])
            self.merged_steps += len(proposers) > 1
            for name in proposers:
                self._slots[name].stats.sent += sum(name in o for o in origins[1:])
            self._pending.append(_Pending(len(committed), tuple(committed[-8:]), draft.tree, origins))
        done = time.perf_counter()
        draft.seconds = done - started
        self.overhead.steps += 1
        self.overhead.expert_seconds += expert_seconds
        self.overhead.seconds += (done - started) - expert_seconds
        return draft

    def _cheap_tree_suffices(self, parts: list[tuple[str, Draft]]) -> bool:
        """Whether a model-free expert's tree already promises skip_models_at accepted tokens."""
        if self.skip_models_at is None:
            return False
        return any(self._slots[n].expert.kind not in MODEL_KINDS and float(d.scores[1:].sum()) >= self.skip_models_at
                   for n, d in parts)

    def accept(self, draft: Draft, path: list[int]) -> None:
        """The decoder kept `path` of `draft`: every expert holding a KV cache keeps the part of its
        own last tree that carries the same tokens (its tree may differ from the merged one)."""
        accepted = draft.tree.tokens[path].tolist()
        for slot in self._slots.values():
            own = slot.last_draft
            if own is None or slot.expert.kind not in MODEL_KINDS or not slot.resident:
                continue
            if int(own.tree.tokens[0]) != int(draft.tree.tokens[0]):
                continue
            slot.expert.accept(own, _follow(own.tree, accepted))
            slot.last_draft = None

    def predict_next(self, committed: list[int]) -> int:
        """The primary model's guess of the target's next token; without an active model, the lookup's."""
        primary = next((n for n in self._active if self._slots[n].expert.kind in MODEL_KINDS), None)
        if primary is not None:
            self._make_resident([primary])
            return int(self._slots[primary].expert.predict_next(committed))
        for name in self._active:
            guess = self._slots[name].expert.predict_next(committed)
            if guess is not None:
                return int(guess)
        return int(committed[-1])   # no guess at all: a drafted-ahead tree then simply misses

    def close(self) -> None:
        """Free what the pool loaded (a pinned drafter's owner frees it)."""
        for slot in self._slots.values():
            if slot.resident:
                slot.expert.close()

    # -- internals ------------------------------------------------------------------------------
    def _primary(self) -> str:
        """The first active model-kind expert, else any model-kind expert of the pool."""
        for pool in (self._active, self.names):
            for name in pool:
                if self._slots[name].expert.kind in MODEL_KINDS:
                    return name
        raise InvalidRequestError(
            "the sampled rejection rule needs a draft model's q, and this pool has no model expert "
            "(lookup and template trees are exact only under greedy or target-sample)")

    def _make_resident(self, names: Sequence[str]) -> None:
        """Load what `names` need (a LoRA needs its base), evicting the least recently used others."""
        bases: dict[str, list[str]] = {}
        for name in names:
            base = getattr(self._slots[name].expert, "base", None)
            if base is not None and base.name in self._slots:
                bases.setdefault(base.name, []).append(name)
        needed = list(dict.fromkeys([*bases, *names]))     # bases load first
        for name in needed:
            self._slots[name].last_used = self._tick
        for name in needed:
            slot = self._slots[name]
            if not slot.resident:
                self._evict_for(slot.expert.estimated_bytes(), keep=set(needed))
                slot.expert.load()
                self.events.append(f"step {self._tick}: loaded {name} ({slot.expert.nbytes() / 2**20:.0f} MiB)")
            if slot.evictable:
                slot.why = (f"active at step {self._tick}" if name in names else "") + (
                    f"{' and ' if name in names else ''}base of {', '.join(bases[name])}" if name in bases else "")

    def _evict_for(self, need: int, keep: set[str]) -> None:
        used = self.resident_bytes()
        if used + need <= self.memory_budget:
            return
        victims = sorted((s.last_used, n) for n, s in self._slots.items()
                         if s.evictable and s.resident and n not in keep)
        for _, name in victims:
            for victim in [*self._dependents(name), name]:   # adapters before their base
                slot = self._slots[victim]
                if not slot.resident:
                    continue
                freed = slot.expert.nbytes()
                slot.expert.close()
                slot.last_draft = None
                slot.why = f"evicted at step {self._tick} (least recently used) to fit {need / 2**20:.0f} MiB"
                self.events.append(f"step {self._tick}: evicted {victim} ({freed / 2**20:.0f} MiB)")
                used -= freed
            if used + need <= self.memory_budget:
                return
        raise PoolMemoryError(
            f"the active experts need {(used + need) / 2**20:.0f} MiB together, over the pool's budget of "
            f"{self.memory_budget / 2**20:.0f} MiB: raise memory_budget or activate fewer experts")

    def _dependents(self, name: str) -> list[str]:
        """LoRA experts on this base (they cannot stay without it)."""
        return [n for n, s in self._slots.items() if getattr(getattr(s.expert, "base", None), "name", None) == name]

    def _resolve(self, committed: list[int]) -> None:
        """Count, per expert, proposed nodes the target accepted (ExpertStats), for every earlier tree
        whose context is a prefix of `committed` and now has tokens after it. The path the target took
        through a tree is the longest one matching the committed continuation (exact under greedy;
        under sampling it is what the verifier's own draws chose)."""
        keep: deque[_Pending] = deque(maxlen=self._pending.maxlen)
        for p in self._pending:
            n = p.n_context
            if len(committed) <= n:
                keep.append(p)   # drafted ahead of where the context is now
                continue
            if tuple(committed[max(0, n - 8):n]) != p.tail:
                continue          # a guess that did not come true: never sent, or sent and missed
            continuation = committed[n:]
            kids = p.tree.children()
            node = 0
            for token in continuation:
                if not kids[node]:
                    break
                match = None
                for child in kids[node]:
                    for name in p.origins[child]:
                        self._slots[name].stats.opportunities += 1
                    if int(p.tree.tokens[child]) == token:
                        match = child
                if match is None:
                    break
                for name in p.origins[match]:
                    self._slots[name].stats.accepted += 1
                node = match
        self._pending = keep


def _follow(tree: TokenTree, tokens: list[int]) -> list[int]:
    """The nodes of `tree` along `tokens` from the root, as far as the tree has them."""
    kids = tree.children()
    node, path = 0, []
    for token in tokens:
        node = next((c for c in kids[node] if int(tree.tokens[c]) == token), None)
        if node is None:
            break
        path.append(node)
    return path


def lookup_first_pool(model_expert: Expert, extra: Sequence[Expert] = (), memory_budget: int = 2 * GiB) -> DraftPool:
    """The pool EdgeSession builds for `lookup=True`: the draft model with a lookup expert under it."""
    from edgespec.edge.pool.lookup import LookupExpert

    return DraftPool([model_expert, LookupExpert(), *extra], memory_budget=memory_budget)

