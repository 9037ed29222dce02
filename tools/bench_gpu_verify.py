#!/usr/bin/env python3
"""Time one verify step of the torch engine: tree attention over the paged KV cache + the whole
model forward, with RANDOM weights of the Qwen2.5-Coder-1.5B shape (28 layers, d 1536, 12/2 heads,
ffn 8960, vocab 151936), for B sessions x T tree nodes at a fixed context.

    python tools/bench_gpu_verify.py --device cuda --json out.json      # bf16 on a GPU
    python tools/bench_gpu_verify.py --device cpu --small                # smoke test (tiny model)

Several sessions' trees go through ONE forward (engine.decode pads trees to the largest and block
tables with the null block). Columns, each the median over --iters runs after --warmup:
- step:    what a verify of B trees costs end to end: build the inputs on the host (tree masks,
           positions, block tables) and copy them over, forward, greedy argmax per node to the host,
           commit an accepted path of up to 4 nodes per session into the paged cache, truncate back;
- forward: the forward alone, inputs prepared (eager PyTorch: kernel-launch bound at small T);
- graph:   the same forward captured once as a CUDA graph and replayed (no launch overhead).
CUDA timings use CUDA events; CPU timings use perf_counter. Weights are random, so the accepted
path is fixed (first children), not decided by the model. Also checks, in float32 on the same
device with a small random model, that tree logits equal chain (one token at a time) logits.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from edgespec.verifier.torch.engine import Engine  # noqa: E402
from edgespec.verifier.torch.model import Decoder, ModelConfig  # noqa: E402

# /work/shared/BASELINES.md: HF transformers Qwen2ForCausalLM (sdpa, DynamicCache), same shape,
# random bf16 weights, context 1024, H200, 2026-11-29. {batch: {tree tokens: ms}}
HF_BASELINE_MS = {1: {1: 37.5, 16: 27.7, 64: 38.5, 128: 46.2}, 8: {1: 38.8, 16: 41.4, 64: 37.5, 128: 43.1}}
HBM_BYTES_S = 4.3e12      # measured device-to-device copy on the H200 (BASELINES.md)
BF16_FLOP_S = 790e12      # measured bf16 GEMM ceiling on the H200 (BASELINES.md)


def random_tree(n: int, rng: np.random.Generator, vocab: int) -> tuple[list[int], list[int]]:
    """A random recursive tree of n nodes (each node's parent uniform among earlier nodes)."""
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
    return rng.integers(0, vocab, size=n).tolist(), parents


def first_child_path(parents: list[int], depth: int) -> list[int]:
    path, node = [0], 0
    for _ in range(depth):
        kids = [i for i, p in enumerate(parents) if p == node]
        if not kids:
            break
        node = kids[0]
        path.append(node)
    return path


class Timer:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self, fn, warmup: int, iters: int) -> float:
        """Median milliseconds of fn()."""
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(iters):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t) * 1000)
        return statistics.median(times)


def fill_context(engine: Engine, n_seqs: int, context: int, seed: int) -> list:
    """n_seqs sequences holding `context` positions of random K/V each."""
    c = engine.model.config
    g = torch.Generator(device=engine.cache.device).manual_seed(seed)
    seqs = []
    for _ in range(n_seqs):
        seq = engine.new_sequence()
        for start in range(0, context, 256):
            n = min(256, context - start)
            seq.append(torch.randn(c.n_layer, 2, n, c.n_head_kv, c.head_dim, generator=g,
                                   device=engine.cache.device, dtype=engine.model.dtype))
        seqs.append(seq)
    return seqs


def check_tree_vs_chain(device: torch.device) -> float:
    """Max |tree logits - chain logits| over all nodes, float32, small random qwen2 model, this device."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = Decoder.random(ModelConfig.tiny("qwen2"), dtype=torch.float32, device=device, seed=1)
    engine = Engine(model, num_blocks=64, block_size=4)
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, 512, size=37).tolist()
    tokens, parents = random_tree(24, rng, 512)
    seq = engine.new_sequence()
    engine.prefill(seq, prefix)
    tree = engine.decode([seq], [(tokens, parents)]).logits[0]
    seq.close()
    worst = 0.0
    for node in range(len(tokens)):
        path, n = [], node
        while n >= 0:
            path.append(n)
            n = parents[n]
        seq = engine.new_sequence()
        engine.prefill(seq, prefix)
        for i in reversed(path):
            out = engine.decode([seq], [([tokens[i]], [-1])])
            engine.commit(seq, out, 0, [0])
        seq.close()
        worst = max(worst, float((out.logits[0, 0] - tree[node]).abs().max()))
    return worst


def bench(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[args.dtype]
    config = ModelConfig.tiny("qwen2") if args.small else ModelConfig.qwen2_1_5b()
    batches = [int(b) for b in args.batches.split(",")]
    trees = [int(t) for t in args.trees.split(",")]
    timer = Timer(device)
    started = time.perf_counter()
    model = Decoder.random(config, dtype=dtype, device=device, max_positions=args.context + max(trees) + 8)
    per_seq = -(-(args.context + max(trees)) // args.block_size)
    engine = Engine(model, num_blocks=max(batches) * per_seq + 1, block_size=args.block_size)
    meta = {"device": str(device), "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "cuda": torch.version.cuda, "dtype": args.dtype,
            "config": config.__dict__, "params": config.n_params, "context": args.context,
            "block_size": args.block_size, "warmup": args.warmup, "iters": args.iters,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "kv_cache_bytes": engine.cache.kv.numel() * engine.cache.kv.element_size()}
    meta["tree_vs_chain_max_abs_diff_fp32"] = check_tree_vs_chain(device)
    if device.type == "cuda":
        meta["sdpa_backends_accepting_tree_mask"] = sdpa_probe(config, dtype, device, args.context)
    print(f"[bench] {meta['device_name']}, torch {torch.__version__}, {config.n_params / 1e9:.3f} B params "
          f"({args.dtype}), context {args.context}; tree-vs-chain max |diff| (fp32 tiny model) "
          f"{meta['tree_vs_chain_max_abs_diff_fp32']:.2e}", flush=True)
    rng = np.random.default_rng(0)
    rows = []
    for B in batches:
        seqs = fill_context(engine, B, args.context, seed=B)
        for T in trees:
            batch_trees = [random_tree(T, rng, config.vocab_size) for _ in range(B)]
            accept = [first_child_path(p, 3) for _, p in batch_trees]

            def step() -> None:
                out = engine.decode(seqs, batch_trees)
                argmax = out.logits.argmax(dim=-1).cpu()  # greedy decision needs these on the host
                assert argmax.shape == (B, T)
                for b, seq in enumerate(seqs):
                    engine.commit(seq, out, b, accept[b])
                    seq.truncate(args.context)

            x = engine.inputs(seqs, batch_trees)

            def forward() -> None:
                with torch.no_grad():
                    engine.forward(x)

            row = {"batch": B, "tree": T, "tokens": B * T}
            row["step_ms"] = timer(step, args.warmup, args.iters)
            row["forward_ms"] = timer(forward, args.warmup, args.iters)
            if device.type == "cuda" and not args.no_graph:
                try:
                    row["graph_ms"] = time_graph(engine, x, timer, args)
                except Exception as exc:  # noqa: BLE001 - report, keep the eager numbers
                    row["graph_error"] = f"{type(exc).__name__}: {exc}"[:300]
            if device.type != "cuda" or args.small:  # the floor is the H200's, for the real shape only
                rows.append(row)
                print(f"[bench] B={B} T={T}: step {row['step_ms']:.3f} ms, forward {row['forward_ms']:.3f} ms", flush=True)
                continue
            weights = config.n_params * torch.finfo(dtype).bits // 8
            kv_read = B * args.context * config.kv_elements_per_token * torch.finfo(dtype).bits // 8
            row["floor_ms"] = 1000 * max(weights / HBM_BYTES_S, 2 * config.n_params * B * T / BF16_FLOP_S)
            row["floor_with_kv_ms"] = 1000 * max((weights + kv_read) / HBM_BYTES_S, 2 * config.n_params * B * T / BF16_FLOP_S)
            row["hf_ms"] = HF_BASELINE_MS.get(B, {}).get(T) if args.context == 1024 else None
            rows.append(row)
            print(f"[bench] B={B} T={T}: step {row['step_ms']:.3f} ms, forward {row['forward_ms']:.3f} ms, "
                  f"graph {row.get('graph_ms', float('nan')):.3f} ms {row.get('graph_error', '')}", flush=True)
        for seq in seqs:
            seq.close()
    if device.type == "cuda":
        meta["max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
    meta["wall_s"] = round(time.perf_counter() - started, 1)
    return {"meta": meta, "rows": rows}


def sdpa_probe(config: ModelConfig, dtype: torch.dtype, device: torch.device, context: int) -> dict:
    """Which SDPA kernels take this engine's call (packed GQA rows, boolean mask) at B=8, T=64."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    B, T, G = 8, 64, config.group
    q = torch.randn(B, config.n_head_kv, G * T, config.head_dim, dtype=dtype, device=device)
    k = torch.randn(B, config.n_head_kv, context + T, config.head_dim, dtype=dtype, device=device)
    mask = torch.rand(B, 1, G * T, context + T, device=device) > 0.5
    mask[..., 0] = True
    found = {}
    for name in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"):
        backend = getattr(SDPBackend, name, None)
        if backend is None:
            continue
        try:
            with sdpa_kernel([backend]):
                torch.nn.functional.scaled_dot_product_attention(q, k, k, attn_mask=mask)
            torch.cuda.synchronize()
            found[name] = True
        except RuntimeError as exc:
            found[name] = f"no: {str(exc).splitlines()[0][:120]}"
    return found


def time_graph(engine: Engine, x, timer: Timer, args: argparse.Namespace) -> float:
    """Capture engine.forward(x) as a CUDA graph (static inputs) and time its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        for _ in range(2):  # warm up on a side stream before capture, as torch.cuda.graphs advises
            engine.forward(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        engine.forward(x)
    ms = timer(graph.replay, args.warmup, args.iters)
    del graph
    return ms


def table(result: dict) -> str:
    m = result["meta"]
    lines = ["| batch | tree tokens T | tokens per forward | step (ms) | forward eager (ms) | forward CUDA graph (ms) "
             "| HF step (ms) | floor (ms) | step / floor | graph / floor |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    def ms(v: float | None, fmt: str = ".2f") -> str:
        return "—" if v is None else format(v, fmt)

    def ratio(v: float | None, floor: float | None) -> str:
        return "—" if v is None or not floor else format(v / floor, ".1f") + "x"

    for r in result["rows"]:
        graph, floor = r.get("graph_ms"), r.get("floor_ms")
        lines.append(f"| {r['batch']} | {r['tree']} | {r['tokens']} | {ms(r['step_ms'])} | {ms(r['forward_ms'])} | "
                     f"{ms(graph)} | {ms(r.get('hf_ms'), '.1f')} | {ms(floor)} | {ratio(r['step_ms'], floor)} | "
                     f"{ratio(graph, floor)} |")
    head = (f"{m['device_name']}, torch {m['torch']} (CUDA {m['cuda']}), {m['dtype']}, "
            f"{m['params'] / 1e9:.3f} B params (random), context {m['context']}, block size {m['block_size']}, "
            f"median of {m['iters']} after {m['warmup']} warm-up, {m['date']}")
    return head + "\n\n" + "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default=None, help="default bfloat16 on cuda, float32 on cpu")
    p.add_argument("--small", action="store_true", help="tiny model, context 64, T 1/4/8, B 1/2 (smoke test)")
    p.add_argument("--context", type=int, default=None)
    p.add_argument("--batches", default=None, help="comma-separated (default 1,8)")
    p.add_argument("--trees", default=None, help="comma-separated (default 1,16,64,128)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph replay column")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    args.context = args.context or (64 if args.small else 1024)
    args.batches = args.batches or ("1,2" if args.small else "1,8")
    args.trees = args.trees or ("1,4,8" if args.small else "1,16,64,128")
    args.warmup = 2 if args.small and args.warmup is None else (args.warmup or 10)
    args.iters = 5 if args.small and args.iters is None else (args.iters or 50)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device visible to torch", file=sys.stderr)
        return 2
    result = bench(args)
    print()
    print(table(result))
    print()
    print(json.dumps(result, default=str))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
