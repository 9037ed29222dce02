"""Run a `Decoder` over a `PagedKVCache`: prefill, (batched) tree decoding, commit of accepted rows.

    engine = Engine(model, num_blocks=..., block_size=16)
    seq = engine.new_sequence()
    engine.prefill(seq, prompt[:-1])                          # K/V of committed tokens, no logits
    out = engine.decode([seq], [(tree.tokens, tree.parents)])  # logits [B, T, vocab], K/V in scratch
    engine.commit(seq, out, 0, [0, 3, 7])                     # keep the rows of root + accepted path

A decode step attends over each sequence's cached context (gathered from its blocks) plus the
step's own tokens under the tree mask (tree_attention.py). The step's K/V stay in the scratch tensor
`out.kv` until `commit` copies the accepted rows into the sequence's blocks, so a rejected branch
never touches the cache and nothing has to be removed afterwards. Several sequences' trees go
through one forward: trees are padded to the largest, block tables with the null block.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence as Seq

import numpy as np
import torch

from edgespec.common.errors import ContextOverflowError
from edgespec.verifier.torch.kv_cache import PagedKVCache, Sequence
from edgespec.verifier.torch.model import Decoder
from edgespec.verifier.torch.tree_attention import chain_parents, depths, step_mask


@dataclass
class StepOutput:
    logits: torch.Tensor | None   # [B, T, vocab] (model dtype), None for prefill
    kv: torch.Tensor              # [n_layer, 2, B, T, Hkv, D]: the step's K/V (scratch)
    sizes: list[int]              # real tree size per sequence (T is the largest)


@dataclass
class StepInputs:
    """Everything one forward needs, on the model's device."""

    tokens: torch.Tensor      # [B, T] int64
    positions: torch.Tensor   # [B, T] int64 (context length + depth)
    mask: torch.Tensor        # [B, 1, T, nb*block_size + T] bool
    tables: torch.Tensor      # [B, nb] int64 block ids


class Engine:
    def __init__(self, model: Decoder, *, num_blocks: int, block_size: int = 16, prefill_chunk: int = 256) -> None:
        c = model.config
        self.model = model
        self.cache = PagedKVCache(c.n_layer, c.n_head_kv, c.head_dim, num_blocks=num_blocks,
                                  block_size=block_size, dtype=model.dtype, device=model.device)
        self.prefill_chunk = prefill_chunk

    def new_sequence(self) -> Sequence:
        return self.cache.new_sequence()

    def inputs(self, seqs: Seq[Sequence], trees: Seq[tuple[Seq[int], Seq[int]]]) -> StepInputs:
        """Pad the trees (tokens, parents) of `seqs` into one batch; positions continue each context."""
        if len(seqs) != len(trees) or not seqs:
            raise ValueError("one tree per sequence, at least one")
        T = max(len(tokens) for tokens, _ in trees)
        tokens = np.zeros((len(seqs), T), np.int64)
        positions = np.zeros((len(seqs), T), np.int64)
        for b, (seq, (toks, parents)) in enumerate(zip(seqs, trees)):
            tokens[b, :len(toks)] = toks
            positions[b, :len(toks)] = seq.length + depths(parents)
        if positions.max() >= self.model.rope.max_positions:
            raise ContextOverflowError(f"position {positions.max()} is beyond the model's "
                                       f"{self.model.rope.max_positions} positions (n_ctx)")
        tables = self.cache.block_tables(seqs)
        mask = step_mask([p for _, p in trees], [s.length for s in seqs], tables.shape[1] * self.cache.block_size)
        dev = self.cache.device
        return StepInputs(torch.from_numpy(tokens).to(dev), torch.from_numpy(positions).to(dev),
                          torch.from_numpy(mask).to(dev), tables)

    def forward(self, x: StepInputs, logits: bool = True) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The model over prepared inputs (a separate step so benchmarks can time or graph it alone)."""
        gather = None if x.tables.shape[1] == 0 else (lambda layer: self.cache.gather(layer, x.tables))
        return self.model(x.tokens, x.positions, x.mask, gather, logits=logits)

    @torch.no_grad()
    def decode(self, seqs: Seq[Sequence], trees: Seq[tuple[Seq[int], Seq[int]]], logits: bool = True) -> StepOutput:
        out, kv = self.forward(self.inputs(seqs, trees), logits=logits)
        return StepOutput(out, kv, [len(t) for t, _ in trees])

    @torch.no_grad()
    def commit(self, seq: Sequence, out: StepOutput, b: int, rows: Seq[int]) -> None:
        """Append the K/V of step rows `rows` (a root-to-node path, in order) of batch entry b."""
        index = torch.as_tensor(list(rows), dtype=torch.int64, device=out.kv.device)
        seq.append(out.kv[:, :, b].index_select(2, index))

    @torch.no_grad()
    def prefill(self, seq: Sequence, tokens: Seq[int]) -> None:
        """Append the K/V of `tokens` (committed context) in chunks; no logits are computed."""
        for start in range(0, len(tokens), self.prefill_chunk):
            chunk = list(tokens[start:start + self.prefill_chunk])
            out = self.decode([seq], [(chunk, chain_parents(len(chunk)))], logits=False)
            seq.append(out.kv[:, :, 0])
