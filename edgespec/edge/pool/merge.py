"""Merge several experts' trees into the one tree that is sent (SpecInfer-style token-tree merge).

Nodes with the same token path are one node (shared prefixes are deduplicated); its score is the
highest any expert gave it, an estimate of its path acceptance. The budget is then shared by
expected value: the `budget` best nodes are kept, whoever proposed them. Every expert's scores fall
along a path, so a maximum over experts does too, and every cut by score is a tree.

Exactness: greedy and the sampled target-sample rule are exact for ANY tree, so merged trees are
fine there. The sampled rejection rule needs each node's children drawn from one known q with
their number fixed before drawing: a merged tree breaks that, so the pool never merges under it
(pool.py drafts with the model expert alone). Merged trees therefore carry no q and
`prefix_groups` False.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgespec.common.tree import TokenTree
from edgespec.edge.drafting import Draft


@dataclass
class Merged:
    draft: Draft                 # the tree to send; node_seq from the first expert that decoded the node
    origins: list[frozenset]     # per merged node, the names of the experts that proposed it


def merge_drafts(parts: list[tuple[str, Draft]], budget: int) -> Merged:
    """One tree from (expert name, draft) pairs, all rooted at the same committed token."""
    if not parts:
        raise ValueError("nothing to merge")
    root = int(parts[0][1].tree.tokens[0])
    tokens, parents, scores, node_seq = [root], [-1], [1.0], [0]
    origins: list[set] = [set(name for name, _ in parts)]
    index: dict[tuple[int, int], int] = {}
    # node_seq describes one expert's KV only (Drafter.accept adopts the deepest decoded node): the
    # first expert that decoded anything owns it; the other experts' nodes are marked undecoded.
    owner = next((name for name, d in parts if any(s >= 0 for s in d.node_seq[1:])), None)
    for name, draft in parts:
        tree = draft.tree
        if int(tree.tokens[0]) != root:
            raise ValueError(f"expert {name} drafted from root {int(tree.tokens[0])}, not {root}")
        mapped = [0] * len(tree)
        for i in range(1, len(tree)):       # parents precede children, so mapped[parent] is set
            key = (mapped[int(tree.parents[i])], int(tree.tokens[i]))
            node = index.get(key)
            if node is None:
                node = index[key] = len(tokens)
                tokens.append(key[1])
                parents.append(key[0])
                scores.append(float(draft.scores[i]))
                node_seq.append(-1)
                origins.append(set())
            else:
                scores[node] = max(scores[node], float(draft.scores[i]))
            if name == owner:
                node_seq[node] = draft.node_seq[i]
            origins[node].add(name)
            mapped[i] = node
    tree = TokenTree(tokens=np.array(tokens, np.int32), parents=np.array(parents, np.int32))
    merged = Draft(tree, node_seq, np.array(scores, np.float64),
                   seconds=sum(d.seconds for _, d in parts), decodes=sum(d.decodes for _, d in parts))
    keep = [0, *sorted(merged.order()[:budget])]
    return Merged(merged.pruned(budget), [frozenset(origins[i]) for i in keep])
