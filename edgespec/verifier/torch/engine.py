"""The verify engine: a `TransformerLM` over a `PagedKVCache`, one verify step of several sessions'
trees per forward, with acceptance decided on the device and the step replayed as a CUDA graph.

    engine = Engine(model, num_blocks=..., block_size=16)
    seq = engine.new_sequence()
    engine.prefill(seq, prompt[:-1])                       # K/V of committed tokens (eager, chunked)
    [d] = engine.verify([TreeStep(seq, tokens, parents, sampling, step)])
    d.path, d.next_token, d.margins                         # seq now holds the root + accepted path
    engine.verify([TreeStep(seq_a, ...), TreeStep.prefill_chunk(seq_b, chunk)])   # prefill in a verify step

One step, for B sequences with trees of up to T nodes (both rounded up to a bucket: powers of two):
1. host: reserve blocks for each tree (slots ctx_len + i), pack tokens, parents, block tables and
   context lengths (and, when sampling, parameters and one uniform per node) into ONE int64 (and
   one float64) buffer, copied to the device in one transfer each;
2. device (one CUDA graph per (B, T, context blocks, mode) bucket, captured by `warmup` or on first
   use; with graphs, tables are at least MIN_TABLE_BLOCKS wide): depths, ancestor bits, positions
   and write slots from the parents and tables (tree_ops.prepare), the forward
   (each layer writes its K/V into the tree slots, then attends over the paged cache: see
   tree_attention.py and triton_attention.py), float32 logits, each node's choice (greedy argmax,
   or the target-sample rule's inverse CDF of p at the host's uniform), the accepted path (a node is
   accepted iff every node on its root path matches its parent's choice), the next token, top-2
   margins (tree_ops.accept), and the compaction: the accepted nodes' K/V rows move to slots
   ctx_len + depth;
3. host: one small copy back ([B, 2 + 2T] floats: next token, path length, path, margins), the
   sequences' lengths advance, and of the blocks reserved past them each keeps those a next tree
   of the same size needs, as spares (kv_cache.py); the rest go back to the pool.
A chunk of a session's prompt can ride in the same step (TreeStep.prefill_chunk): a chain whose
nodes are all accepted, so verify trees and prefill of many sessions share one forward.
Only the accepted tokens and margins cross to the host; the logits stay on the device, except for
steps under the rejection rule (q on the wire), which are decided on the host from the logits rows
with common/acceptance.py and compacted by a separate eager call.

Between steps (`between_steps`, called by the backend after each batch and each sync) the cache
is compacted when its fragmentation index passes `compact_threshold` (kv_cache.PagedKVCache.compact).

On the CPU (CI) the same step function runs eagerly with the same padded shapes, so the tests
exercise everything but the graph capture and the Triton kernel.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Iterator, NamedTuple, Sequence

import numpy as np
import torch

from edgespec.common import acceptance
from edgespec.common.errors import ContextOverflowError
from edgespec.common.sampling import SamplingParams
from edgespec.verifier.torch.kv_cache import Compaction, KVSequence, PagedKVCache
from edgespec.verifier.torch.model import TransformerLM
from edgespec.common.rng import residual_uniforms
from edgespec.verifier.torch import knobs  # noqa: F401 - importing it applies $EDGESPEC_KERNEL_KNOBS, once
from edgespec.verifier.torch import tree_ops
from edgespec.verifier.torch.tree_attention import TorchPagedAttention, ancestor_mask, chain_parents, depths

CUBLAS_WORKSPACE = ":0:2"
"""cuBLAS's workspace for this process (CUBLAS_WORKSPACE_CONFIG, set on import unless the environment already sets
it; cuBLAS reads it once, at its first call). None: cuBLAS's default. With a workspace, cuBLAS 13 runs the gate/up
GEMM at 512 rows (B = 8, T = 64) and the float32 LM head as cooperative kernels that zero their workspace with a
memset node first; in a step's graph each such GEMM then started ~6.5 us after the norm before it, against ~0.5 for
the others. Without one it picks their statically scheduled variants (`ssched`, no memset). H100, thirty-sixth
session (docs/BENCHMARKS.md), steps timed in alternating processes: 8 x 64 -1.9 to -2.0 %, other cells level."""
if CUBLAS_WORKSPACE is not None:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)

GREEDY, SAMPLE, SAMPLE_TRUNCATED = 0, 1, 2   # device decision modes (graph variants)
TARGET_SAMPLE = "target-sample"   # common.sampling.AcceptanceRule.TARGET_SAMPLE's value


def bucket(n: int) -> int:
    """The power of two >= n (shapes are padded to these, so few graphs cover all steps)."""
    return 1 << max(0, int(n) - 1).bit_length()


def rule_of(sampling: SamplingParams) -> str:
    rule = getattr(sampling, "rule", TARGET_SAMPLE)
    return str(getattr(rule, "value", rule))


def decided_on_device(sampling: SamplingParams) -> bool:
    """Greedy and the target-sample rule are decided on the device; the rejection rule (which needs
    the draft's q) on the host, and so is any request with a constraint (its mask, common/constraints.py,
    is applied to the logits rows on the host)."""
    return (sampling.greedy or rule_of(sampling) == TARGET_SAMPLE) and not sampling.constraint


@dataclass
class TreeStep:
    """One sequence's tree in a verify step. parents[0] = -1; parents precede children."""

    seq: KVSequence
    tokens: Sequence[int]
    parents: Sequence[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    step: int = 0
    host_rule: Callable[[np.ndarray, Callable[[int], np.ndarray]], acceptance.Acceptance] | None = None
    """Decide on the host instead (the rejection rule): (argmax per node, float32 logits row of a
    node) -> Acceptance; the engine then compacts the chosen path."""
    prefill: bool = False
    """A chunk of committed context riding in a verify step (chunked prefill in the same forward):
    a chain whose every node is accepted; its K/V are already in place, so nothing is compacted."""

    @classmethod
    def prefill_chunk(cls, seq: KVSequence, tokens: Sequence[int]) -> "TreeStep":
        return cls(seq, tokens, chain_parents(len(tokens)), prefill=True)


class Decision(NamedTuple):
    """Immutable, as a frozen dataclass would be, at half its cost to build (B of them per step)."""

    path: list[int]          # accepted drafted nodes (root excluded)
    next_token: int
    margins: list[float]     # top-2 logit margin at the root and each accepted node


@dataclass
class _Static:
    """A bucket's device buffers (and its graph once captured)."""

    ints: torch.Tensor
    floats: torch.Tensor
    host_ints: torch.Tensor
    host_floats: torch.Tensor
    host: dict[str, np.ndarray] = field(default_factory=dict)     # numpy views of host_ints/host_floats
    defaults: np.ndarray | None = None     # host_ints as an empty step has it (padding rows), copied in first
    host_out: torch.Tensor | None = None   # pinned landing buffer for the decisions (CUDA), written by the step
    out: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    graph: object | None = None


def _packed(fields: list[tuple[str, tuple[int, ...]]]) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Offset and shape of each field laid end to end in one flat buffer; "_size" is the total."""
    out, off = {}, 0
    for name, shape in fields:
        out[name] = (off, shape)
        off += int(np.prod(shape))
    out["_size"] = (off, ())
    return out


def layout(B: int, T: int, NB: int) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Offsets and shapes of each input inside the packed int64 buffer."""
    return _packed([("tokens", (B, T)), ("parents", (B, T)), ("sizes", (B,)), ("tables", (B, NB)), ("ctx", (B,)),
                    ("compact", (B,)), ("force", (B,)), ("greedy", (B,)), ("top_k", (B,))])


def float_layout(B: int, T: int) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Offsets and shapes of each input inside the packed float32 buffer."""
    return _packed([("u", (B, T)), ("temperature", (B,)), ("top_p", (B,))])


def _views(buf: torch.Tensor, lay: dict) -> dict[str, torch.Tensor]:
    return {k: buf[o:o + int(np.prod(s))].view(s) for k, (o, s) in lay.items() if not k.startswith("_")}


def sample_choice(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  u: torch.Tensor, truncate: bool, dtype: torch.dtype) -> torch.Tensor:
    """The target-sample rule per node (common.sampling.sample_inverse_cdf on the device): the smallest
    token id t with cumsum(p)[t] > u * sum(p), where p is common.sampling.probabilities
    (temperature, top-k, top-p) computed here.

    logits [B, T, V]; temperature, top_k, top_p [B]; u [B, T] uniforms in [0, 1). Returns [B, T]."""
    B, T, V = logits.shape
    z = logits.to(dtype) / temperature.to(dtype).clamp(min=1e-8)[:, None, None]
    if truncate:
        zs, order = z.sort(dim=-1, descending=True, stable=True)
        k = torch.where((top_k > 0) & (top_k < V), top_k, V)
        kth = zs.gather(-1, (k - 1)[:, None, None].expand(B, T, 1))
        z = torch.where(z >= kth, z, float("-inf"))
        p = torch.softmax(z, dim=-1)
        cum = p.gather(-1, order).cumsum(-1)                                # p in descending order
        keep_n = (cum < top_p.to(dtype)[:, None, None]).sum(-1, keepdim=True) + 1
        keep_n = torch.where((top_p < 1.0)[:, None, None], keep_n, V)
        ranks = torch.arange(V, device=z.device).expand(B, T, V)
        keep = torch.zeros_like(p, dtype=torch.bool).scatter_(-1, order, ranks < keep_n)
        p = torch.where(keep, p, 0.0)
    else:
        p = torch.softmax(z, dim=-1)
    cum = p.cumsum(-1)
    target = (u.to(dtype) * cum[..., -1]).unsqueeze(-1)                    # u times the total mass
    token = torch.searchsorted(cum, target, right=True).squeeze(-1)
    last_nonzero = V - 1 - (p > 0).flip(-1).to(torch.int8).argmax(-1)      # as sample_inverse_cdf clamps
    return torch.minimum(token, last_nonzero)


class Engine:
    SMALL_ROWS_MATMUL = 64  # default small_rows_matmul on CUDA: fused.LINEAR_ROWS_TABLE decides per matrix and rows
    # With CUDA graphs, block tables are padded to at least this many blocks (1024 tokens at block size
    # 16): shorter contexts share one graph per (B, T) instead of capturing one per table size as the
    # context grows. The kernels read the real lengths, so the padding costs only empty key splits.
    MIN_TABLE_BLOCKS = 64

    def __init__(self, model: TransformerLM, *, num_blocks: int, block_size: int = 16, prefill_chunk: int = 256,
                 cuda_graphs: bool | None = None, attention: str = "auto", fused: bool | None = None,
                 small_rows_matmul: int | None = None, compact_threshold: float = 0.5, compact_reserve: int = 16, compact_check_every: int = 16) -> None:
        """compact_threshold: compact the cache between steps when its fragmentation F is above this
        (1.0: never), looking at F every `compact_check_every` calls of between_steps (F is a scan of
        the pool: milliseconds at 10^5 blocks, docs/BENCHMARKS.md); compact_reserve: staging blocks for
        the copies (kv_cache.py). attention: "torch" (gather + SDPA, runs anywhere), "triton" (the paged tree-attention
        kernel; CUDA, or Triton's CPU interpreter in tests) or "auto" (triton on CUDA when it
        imports, else torch). cuda_graphs: capture each step bucket as a CUDA graph (default: on
        CUDA). fused: fused.py's Triton kernels for norms, RoPE + cache writes and SiLU (default:
        on CUDA when triton imports). small_rows_matmul: with fused, steps of B*T <= this many
        rows use fused.linear_rows instead of cuBLAS for the block matmuls (0: never; default
        SMALL_ROWS_MATMUL). The float32 CPU path keeps plain torch ops: the reference."""
        c = model.config
        self.model = model
        self.cache = PagedKVCache(c.n_layer, c.n_head_kv, c.head_dim, num_blocks=num_blocks,
                                  block_size=block_size, dtype=model.dtype, device=model.device,
                                  compact_reserve=compact_reserve)
        if not 0.0 <= compact_threshold <= 1.0:
            raise ValueError(f"compact_threshold must be in [0, 1], got {compact_threshold}")
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1 token, got {prefill_chunk}")
        self.compact_threshold = compact_threshold
        self.compact_check_every = max(1, compact_check_every)
        self._since_check = 0
        self.prefill_chunk = prefill_chunk
        self.device = model.device
        self.max_positions = model.rope.max_positions   # read per step: a plain int (the module attribute: 1-3 us)
        is_cuda = self.device.type == "cuda"
        self.cuda_graphs = is_cuda if cuda_graphs is None else (cuda_graphs and is_cuda)
        self.attention_cls = self._attention(attention, is_cuda)
        self.attention = attention if attention != "auto" else (
            "torch" if self.attention_cls is TorchPagedAttention else "triton")
        self.sample_dtype = torch.float64 if not is_cuda else torch.float32
        if fused is None:
            fused = is_cuda and self._triton_available()
        self.fused = bool(fused)
        model.fused_ops = self.fused
        if small_rows_matmul is None:
            small_rows_matmul = self.SMALL_ROWS_MATMUL if is_cuda else 0
        self.small_rows_matmul = small_rows_matmul if self.fused else 0
        model.small_rows_matmul = self.small_rows_matmul
        self._static: dict[tuple, _Static] = {}
        self._last: _Static | None = None
        self._pool = None
        self.stats = {"steps": 0, "captures": 0, "replays": 0, "host_decided": 0,
                      "compactions": 0, "blocks_moved": 0, "compact_seconds": 0.0}
        self.last_compaction: Compaction | None = None

    @staticmethod
    def _triton_available() -> bool:
        try:
            import triton  # noqa: F401
        except ImportError:
            return False
        return True

    @staticmethod
    def _attention(name: str, is_cuda: bool) -> type:
        if name == "torch" or (name == "auto" and not is_cuda):
            return TorchPagedAttention
        try:
            from edgespec.verifier.torch.triton_attention import TritonPagedAttention
        except ImportError:
            if name == "triton":
                raise
            return TorchPagedAttention
        return TritonPagedAttention

    def new_sequence(self) -> KVSequence:
        return self.cache.new_sequence()

    def between_steps(self) -> Compaction | None:
        """Housekeeping no step may overlap: compact the cache if F is over the threshold."""
        self._since_check += 1
        if self.compact_threshold >= 1.0 or self._since_check < self.compact_check_every:
            return None
        self._since_check = 0
        if self.cache.pool.fragmentation() <= self.compact_threshold:
            return None
        done = self.cache.compact()
        self.stats["compactions"] += 1
        self.stats["blocks_moved"] += done.moved
        self.stats["compact_seconds"] += done.seconds
        self.last_compaction = done
        return done

    # -- prefill (eager, chunked) -------------------------------------------------------------
    def prefill(self, seq: KVSequence, tokens: Sequence[int]) -> None:
        """Append the K/V of `tokens` (committed context) in chunks; no logits are computed."""
        for _ in self.prefill_chunks(seq, tokens):
            pass

    @torch.no_grad()
    def prefill_chunks(self, seq: KVSequence, tokens: Sequence[int]) -> Iterator[int]:
        """prefill, one chunk of `prefill_chunk` tokens per iteration (yields the tokens done so far), so
        that a caller can let other work run between chunks: a long prompt then delays other sessions'
        steps by one chunk, not by the whole prompt. seq.table is read afresh for every chunk, so a
        compaction between chunks is fine."""
        for start in range(0, len(tokens), self.prefill_chunk):
            self.append(seq, tokens[start:start + self.prefill_chunk])
            yield min(len(tokens), start + self.prefill_chunk)

    @torch.no_grad()
    def append(self, seq: KVSequence, tokens: Sequence[int]) -> None:
        """One eager forward that appends the K/V of `tokens` to seq (no logits)."""
        chunk = list(tokens)
        self._forward_eager(seq, chunk, chain_parents(len(chunk)), logits=False)
        seq.length += len(chunk)

    @torch.no_grad()
    def logits(self, seq: KVSequence, tokens: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        """Float32 logits [T, vocab] of one tree after seq's context; the cache keeps its length
        (the tree's slots past it are scratch). For tests and tools."""
        out = self._forward_eager(seq, list(tokens), list(parents), logits=True)
        seq.trim()
        return out[0]

    def _forward_eager(self, seq: KVSequence, tokens: list[int], parents: list[int], logits: bool) -> torch.Tensor | None:
        n, L = len(tokens), seq.length
        d = depths(parents)
        self._check_positions(L + int(d.max()) + 1)
        seq.reserve(L + n)
        dev = self.device
        bs = self.cache.block_size
        table = torch.tensor(seq.table[None])
        pos = L + np.arange(n)
        slots = table[0, pos // bs] * bs + torch.from_numpy(pos % bs)
        attend = self.attention_cls(table.to(dev), torch.tensor([L], device=dev),
                                    torch.from_numpy(ancestor_mask(parents))[None].to(dev), bs, self.model.config.group)
        tok = torch.tensor([tokens], dtype=torch.int64, device=dev)
        positions = torch.from_numpy(L + d)[None].to(dev)
        return self.model(tok, positions, slots.to(dev), self.cache.flat, attend, logits=logits)

    def _check_positions(self, n: int) -> None:
        """n = the highest RoPE position a step uses, plus one."""
        if n > self.max_positions:
            raise ContextOverflowError(f"position {n - 1} is beyond the model's {self.max_positions} "
                                       "positions (n_ctx)")

    # -- verify -------------------------------------------------------------------------------
    def verify(self, steps: Sequence[TreeStep]) -> list[Decision]:
        """Verify one tree per sequence in one forward; commit root + accepted path in each."""
        if not steps:
            return []
        if len(steps) > 1 and len({id(s.seq) for s in steps}) != len(steps):
            raise ValueError("one tree per sequence in a step")
        limit = self.max_positions
        # One pass of checks that also finds the step's shape and decision mode: the host's Python is step
        # time (on the H200 host it ran 4-6x slower than on a 2-core CI box: 0.1-0.4 ms of a step, 2026-12-02).
        T_real, mode = 0, GREEDY
        for s in steps:
            p, n = s.sampling, len(s.tokens)
            if s.host_rule is None:
                if not decided_on_device(p):
                    raise ValueError("a step under a host-decided rule needs its host_rule")
                if not p.greedy:   # sampled on the device
                    mode = SAMPLE_TRUNCATED if mode == SAMPLE_TRUNCATED or p.top_k > 0 or p.top_p < 1.0 else SAMPLE
            if s.prefill and (s.host_rule is not None or not p.greedy):
                raise ValueError("a prefill chunk is greedy and decided on the device")
            if s.seq.length + n > limit:  # near the end: exact depth
                self._check_positions(s.seq.length + int(depths(s.parents).max()) + 1)
            T_real = max(T_real, n)
        widest = 0
        reserved = []
        try:   # until the decisions are in hand nothing is committed: a failure gives the reserved blocks back
            for s in steps:
                widest = max(widest, s.seq.reserve(s.seq.length + len(s.tokens)))
                reserved.append(s.seq)
            B, T = bucket(len(steps)), bucket(T_real)
            NB = self._table_blocks(widest)
            st = self._buffers(B, T, NB)
            self._pack(st, steps, T, mode)
            out = self._read_back(st, self._run(st, (B, T, NB, mode), mode))
            self._last = st
            self.stats["steps"] += 1
            decisions = self._decisions(st, steps, out, T, NB)
        except BaseException:
            for seq in reserved:
                seq.trim()
            raise
        for s, d in zip(steps, decisions):
            s.seq.length += 1 + len(d.path)
            s.seq.trim(len(s.tokens))   # the blocks a next tree of this size needs stay, as spares
        return decisions

    WHOLE_ROWS = 256
    """Decision rows of up to this many values in all are read whole; from larger ones only the columns
    up to the longest accepted path (tolist costs ~10 ns a value: 10 us at B = 8, T = 64 here)."""

    def _decisions(self, st: _Static, steps: Sequence[TreeStep], out: np.ndarray, T: int, NB: int) -> list[Decision]:
        """Each tree's Decision from the step's output rows (next token, path length k, the path from
        the root, then the margins: tree_ops.accept), or decided on the host. Tokens and nodes are
        converted to ints by numpy in one call, not one int() each."""
        rows = out[:len(steps)]
        w = 1 + int(rows[:, 1].max()) if rows.size > self.WHOLE_ROWS else T   # the root and the longest path
        heads = rows[:, :2 + w].astype(np.int64).tolist()
        margins = rows[:, 2 + T:2 + T + w].tolist()
        decisions = []
        for b, (s, row, m) in enumerate(zip(steps, heads, margins)):   # row: token, k, root, path
            if s.host_rule is not None:
                decisions.append(self._decide_on_host(st, b, s, T, NB))
            else:
                decisions.append(Decision(row[3:3 + row[1]], row[0], m[:1 + row[1]]))
        return decisions

    @staticmethod
    def _read_back(st: _Static, out: torch.Tensor) -> np.ndarray:
        """The step's decisions on the host: on CUDA the step itself copied them into the bucket's pinned
        buffer (_step's last op), so this is a stream sync; valid until the bucket's next step."""
        if not out.is_cuda:
            return out.numpy()
        torch.cuda.current_stream(out.device).synchronize()
        return st.host_out.numpy()

    def _table_blocks(self, blocks: int) -> int:
        """The block-table width of a step whose longest sequence holds `blocks` blocks (its bucket)."""
        nb = bucket(blocks)
        return max(nb, self.MIN_TABLE_BLOCKS) if self.cuda_graphs else nb

    WARMUP_SAMPLING = (SamplingParams(), SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=40))
    """One request per device decision mode (GREEDY, SAMPLE, SAMPLE_TRUNCATED): a graph each."""

    @torch.no_grad()
    def warmup(self, batches: Sequence[int], trees: Sequence[int], sampled: bool = True) -> int:
        """One step of every bucket (B, T) for B in `batches` and T in `trees` (rounded up to
        buckets), greedy and (`sampled`) in both sampled modes, on throwaway sequences: with CUDA
        graphs each is captured now (and Triton compiles its kernels for the shape) instead of in the
        middle of serving, where a capture held the GPU for 0.1 s or more and the planner of the edge
        that hit it priced every node by it for the next 64 steps (H200 host, 2026-12-01: 19 ms of
        compute per step at 100 ms RTT, and target-only decoding for 38 steps). Contexts up to
        MIN_TABLE_BLOCKS blocks then need no new capture. Returns the number of (B, T) buckets
        stepped; the sequences' blocks go back to the pool."""
        modes = self.WARMUP_SAMPLING if sampled else self.WARMUP_SAMPLING[:1]
        done = 0
        for B in sorted({bucket(b) for b in batches}):
            for T in sorted({bucket(t) for t in trees}):
                for sampling in modes:
                    seqs = [self.new_sequence() for _ in range(B)]
                    try:
                        self.verify([TreeStep(seq, [0] * T, chain_parents(T), sampling) for seq in seqs])
                    finally:
                        for seq in seqs:
                            seq.close()
                done += 1
        return done

    def last_logits(self) -> torch.Tensor | None:
        """The float32 logits [B, T, vocab] of the most recent verify step, exactly as its decisions
        saw them (the step's static output: valid until the next step of the same bucket). For
        explaining a divergence with the verifier's own numbers."""
        return None if self._last is None else self._last.logits

    def _buffers(self, B: int, T: int, NB: int) -> _Static:
        key = (B, T, NB)
        st = self._static.get(key)
        if st is None:
            n_int, n_float = layout(B, T, NB)["_size"][0], float_layout(B, T)["_size"][0]
            pin = self.device.type == "cuda"
            st = _Static(ints=torch.zeros(n_int, dtype=torch.int64, device=self.device),
                         floats=torch.zeros(n_float, dtype=torch.float64, device=self.device),
                         host_ints=torch.zeros(n_int, dtype=torch.int64, pin_memory=pin),
                         host_floats=torch.zeros(n_float, dtype=torch.float64, pin_memory=pin))
            st.host = {k: v.numpy() for k, v in _views(st.host_ints, layout(B, T, NB)).items()}
            st.host.update({k: v.numpy() for k, v in _views(st.host_floats, float_layout(B, T)).items()})
            st.host["_ints"] = st.host_ints.numpy()
            st.host["parents"][:] = np.arange(T)   # padding nodes are their own parents
            st.host["greedy"].fill(1)
            st.defaults = st.host["_ints"].copy()   # the rest zero: size 0, null blocks, no compaction
            self._static[key] = st
        return st

    def _pack(self, st: _Static, steps: Sequence[TreeStep], T: int, mode: int) -> None:
        """Fill the host staging buffers (padding rows: size 0, null blocks).
        Only tokens, parents and tables per sequence: depths, ancestor masks, positions and slots
        are derived on the device (part of the graph), so the host work is a few array copies. (On the
        H200 host this Python ran 4-6x slower than on a 2-core CI box: 0.1 ms of a B = 8 step, 2026-12-02.)
        The copy to the device is the step's first op (_step): inside the captured graph, not a launch of
        its own."""
        a = st.host
        a["_ints"][:] = st.defaults            # every field as for padding rows, in one copy
        tokens, parents, tables = a["tokens"], a["parents"], a["tables"]
        NB = tables.shape[1]                  # covers every tree's blocks; spares past them may not fit
        sizes, ctx, compact, force = a["sizes"], a["ctx"], a["compact"], a["force"]
        for b, s in enumerate(steps):         # a row copy per array field (numpy arrays: memcpy), scalars set one by one
            n = len(s.tokens)
            tokens[b, :n] = s.tokens
            parents[b, 1:n] = s.parents[1:]   # the root's parent stays 0 (from the defaults)
            table = s.seq.table[:NB]
            tables[b, :table.size] = table
            sizes[b], ctx[b], force[b] = n, s.seq.length, s.prefill
            compact[b] = s.host_rule is None and not s.prefill
        sampled = [] if mode == GREEDY else [b for b, s in enumerate(steps)
                                             if s.host_rule is None and not s.sampling.greedy]
        if sampled:
            a["u"].fill(0.0)
            a["temperature"].fill(1.0)
            a["top_p"].fill(1.0)
            for b in sampled:
                p = steps[b].sampling
                a["greedy"][b], a["top_k"][b], a["temperature"][b], a["top_p"][b] = 0, p.top_k, p.temperature, p.top_p
            # every sampled node's uniform in one vectorised Philox pass (uniform() per node: ~25 us each)
            trees = [(steps[b].sampling.seed, steps[b].step, len(steps[b].tokens)) for b in sampled]
            u = np.zeros((len(sampled), T))
            u[np.arange(T) < a["sizes"][sampled, None]] = residual_uniforms(trees)   # row-major = tree order
            a["u"][sampled] = u

    def _run(self, st: _Static, key: tuple, mode: int) -> torch.Tensor:
        """The step function, eager or as a CUDA graph captured on the bucket's first use."""
        B, T, NB, _ = key
        gkey = ("graph", mode)
        if not self.cuda_graphs:
            st.out, st.logits = self._step(st, B, T, NB, mode)
            return st.out
        graphs = st.graph if isinstance(st.graph, dict) else {}
        st.graph = graphs
        entry = graphs.get(gkey)
        if entry is None:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up before capture; the step is idempotent (see _step)
                    self._step(st, B, T, NB, mode)
            torch.cuda.current_stream().wait_stream(stream)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, stream=self._capture_stream()):
                out, logits = self._step(st, B, T, NB, mode)
            entry = graphs[gkey] = (graph, out, logits)
            self.stats["captures"] += 1
        graph, out, logits = entry
        graph.replay()
        self.stats["replays"] += 1
        st.out, st.logits = out, logits
        return out

    def _capture_stream(self) -> torch.cuda.Stream | None:
        """The stream a step's graph is captured on (None: torch's own). With fused.WARM_BELOW_MAIN a high-priority
        one, which the graph's main-chain kernel nodes keep as their priority (torch instantiates with
        cudaGraphInstantiateFlagUseNodePriority) above the warming side stream's default one."""
        from edgespec.verifier.torch import fused
        if not (self.fused and fused.WARM_BELOW_MAIN):
            return None
        return torch.cuda.Stream(self.device, priority=-1)

    @torch.no_grad()   # here, not on verify: a replayed graph needs no autograd state (1.7-3.2 us a step, H100 host)
    def _step(self, st: _Static, B: int, T: int, NB: int, mode: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward, decisions and compaction for one bucket, on the static buffers; no host sync.

        Idempotent for the same inputs: every tree slot is rewritten by the forward before the
        compaction reads it, so warm-up runs before a capture leave the cache as one run does.

        It starts by copying the packed inputs from the bucket's (pinned) host buffers and, on CUDA, ends by
        copying the decisions into the pinned host_out: with CUDA graphs both copies are nodes of the graph
        (copies from and to pinned memory can be captured), so a step is one graph launch and a sync."""
        st.ints.copy_(st.host_ints, non_blocking=True)
        if mode != GREEDY:   # a greedy step reads no float inputs (_pack fills them for sampled rows only)
            st.floats.copy_(st.host_floats, non_blocking=True)
        iv = _views(st.ints, layout(B, T, NB))
        fv = _views(st.floats, float_layout(B, T))
        bs = self.cache.block_size
        tokens, parents, ctx, tables = iv["tokens"], iv["parents"], iv["ctx"], iv["tables"]
        prepare, accept = ((tree_ops.prepare, tree_ops.accept) if self.fused     # one Triton launch each
                           else (tree_ops.prepare_torch, tree_ops.accept_torch))  # the reference
        bits, depth, slots = prepare(parents, ctx, tables, bs)
        attend = self.attention_cls.packed(tables, ctx, bits, bs, self.model.config.group)
        logits = self.model(tokens, ctx[:, None] + depth, slots, self.cache.flat, attend)
        if self.fused:
            from edgespec.verifier.torch import fused
            argmax, margin = (v.view(B, T) for v in fused.argmax_top2(logits.view(B * T, -1)))
        else:
            from edgespec.verifier.torch.fused import argmax_top2_torch
            argmax, margin = argmax_top2_torch(logits)
        if mode == GREEDY:
            choice = argmax
        else:
            sampled = sample_choice(logits, fv["temperature"], iv["top_k"], fv["top_p"], fv["u"],
                                    mode == SAMPLE_TRUNCATED, self.sample_dtype)
            choice = torch.where(iv["greedy"].bool()[:, None], argmax, sampled)
        out, src, dst = accept(tokens, parents, choice, margin, bits, depth, iv["sizes"], iv["force"],
                               iv["compact"], ctx, tables, bs)
        if self.fused and tree_ops.MOVE_ROWS_KERNEL:
            tree_ops.move_rows(self.cache.flat, src, dst, T)
        else:
            tree_ops.move_rows_torch(self.cache.flat, src, dst)
        if out.is_cuda:
            if st.host_out is None:   # the eager runs before a capture make it; every mode's graph writes this one
                if torch.cuda.is_current_stream_capturing():
                    raise RuntimeError("the pinned decisions buffer must exist before a graph capture")
                st.host_out = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
            elif st.host_out.shape != out.shape:   # a new buffer would leave captured graphs writing the old one
                raise RuntimeError(f"decisions {tuple(out.shape)} do not fit the bucket's {tuple(st.host_out.shape)}")
            st.host_out.copy_(out, non_blocking=True)
        return out, logits

    @torch.no_grad()
    def _decide_on_host(self, st: _Static, b: int, s: TreeStep, T: int, NB: int) -> Decision:
        """A tree under a host rule: read its logits rows, decide with common/acceptance.py, compact."""
        self.stats["host_decided"] += 1
        n = len(s.tokens)
        logits = st.logits[b, :n].cpu().numpy()
        argmax = logits.argmax(-1)
        acc = s.host_rule(argmax, lambda i: logits[i])
        nodes = [0, *acc.path]
        path = torch.zeros(1, T, dtype=torch.int64, device=self.device)
        path[0, :len(nodes)] = torch.tensor(nodes)
        tables = torch.zeros(1, NB, dtype=torch.int64)
        table = torch.from_numpy(s.seq.table[:NB])
        tables[0, :table.numel()] = table
        tree_ops.move_rows_torch(self.cache.flat, *tree_ops.compaction_slots(
            tables.to(self.device), torch.tensor([s.seq.length], device=self.device), path,
            torch.tensor([[len(acc.path)]], device=self.device), torch.ones(1, dtype=torch.bool, device=self.device),
            self.cache.block_size))
        top2 = np.sort(logits[nodes], axis=1)[:, -2:]
        return Decision(list(acc.path), int(acc.next_token), [float(x) for x in top2[:, 1] - top2[:, 0]])

