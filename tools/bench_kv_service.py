"""CPU measurements of the verifier's KV upkeep and scheduling (issue 9), with random weights.

1. compaction: a paged cache shaped like Qwen2.5-1.5B's KV (28 layers, 2 KV heads, d 128, blocks
   of 16, float32), filled by sessions of random lengths, every other one closed (holes); the time
   of one compaction vs blocks moved, and of the per-step fragmentation check on large pools.
2. prefill during steps: one session steps (greedy root-only verifies through the service's registry
   and batch worker) while another session syncs a long prompt; the stepping session's verify
   latency for the verifies that overlapped the sync, and the sync's own time, for several prefill
   chunk sizes (chunk = prompt: one piece, i.e. no turns), with the chunks taking turns with the
   verifies ("turns") or riding in the verify forwards ("mixed"; chunks of min(64, chunk) then).

    .venv/bin/python tools/bench_kv_service.py [--json docs/bench/kv_service.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import threading
import time

import numpy as np
import torch

from edgespec.common.sampling import SamplingParams
from edgespec.common.tree import TokenTree
from edgespec.verifier.sessions import SessionRegistry
from edgespec.verifier.torch.backend import TorchBackend
from edgespec.verifier.torch.block_pool import BlockPool
from edgespec.verifier.torch.kv_cache import PagedKVCache
from edgespec.verifier.torch.model import ModelConfig, TransformerLM


def bench_compaction(num_blocks: int, seed: int) -> dict:
    c = ModelConfig.qwen2_1_5b()
    cache = PagedKVCache(c.n_layer, c.n_head_kv, c.head_dim, num_blocks=num_blocks + 1, block_size=16)
    rng = np.random.default_rng(seed)
    seqs = []
    while cache.pool.num_free > 8:
        n = int(rng.integers(1, min(cache.pool.num_free, 40) + 1)) * 16 - int(rng.integers(0, 16))
        s = cache.new_sequence()
        s.reserve(n)
        s.length = n            # contents do not matter for timing
        seqs.append(s)
    for s in seqs[::2]:
        s.close()
    cache.kv.fill_(1.0)         # touch every page first: time copies, not first-touch page faults
    report = cache.report()
    done = cache.compact()
    one = cache.kv[:, :, 1:done.moved + 1]
    into = torch.ones_like(one)   # pages touched before timing
    started = time.perf_counter()
    into.copy_(one)               # the same bytes in one strided copy: this machine's copy speed
    memcpy_s = time.perf_counter() - started
    return {"blocks": num_blocks, "bytes_per_block": cache.bytes_per_block, "free": report.free_blocks,
            "F_before": round(done.fragmentation_before, 3), "moved": done.moved,
            "ms": round(done.seconds * 1e3, 2), "MB_moved": round(done.moved * cache.bytes_per_block / 2**20, 1),
            "one_copy_ms": round(memcpy_s * 1e3, 2),
            "reserve_MB": round(cache.reserve_bytes / 2**20, 1)}


def bench_fragmentation_check(num_blocks: int, seed: int) -> dict:
    pool = BlockPool(num_blocks + 1)
    taken = pool.allocate(num_blocks)
    rng = np.random.default_rng(seed)
    pool.release([b for b in taken if rng.random() < 0.3])
    runs = 50
    started = time.perf_counter()
    for _ in range(runs):
        pool.fragmentation()
    return {"blocks": num_blocks, "us": round((time.perf_counter() - started) / runs * 1e6, 1),
            "F": round(pool.fragmentation(), 3)}


def small_model() -> TransformerLM:
    config = ModelConfig(arch="qwen2", n_layer=4, d_model=256, n_head=8, n_head_kv=2, head_dim=32, d_ff=768,
                         vocab_size=2048, rope_theta=1e4, norm_eps=1e-6, qkv_bias=True, tied_embeddings=True)
    return TransformerLM.random(config, dtype=torch.float32, max_positions=4096, seed=1)


def bench_turns(model: TransformerLM, prompt_len: int, chunk: int, seed: int, mixed: bool) -> dict:
    backend = TorchBackend.from_model(model, n_ctx=4096, max_nodes=8, max_depth=4, max_sessions=3, block_size=16,
                                      prefill_chunk=chunk, attention="torch")
    backend.mixed_prefill = mixed
    registry = SessionRegistry(backend, max_sessions=3, max_batch=8)
    rng = np.random.default_rng(seed)
    stepper, syncer = registry.open_stream(), registry.open_stream()
    registry.sync(stepper, rng.integers(0, 2048, size=32).tolist(), time.monotonic())
    done: list[tuple[float, float]] = []     # (sent, finished)
    stop = threading.Event()

    def step() -> None:
        k = 0
        while not stop.is_set():
            sent = time.monotonic()
            tree = TokenTree(tokens=np.array([stepper.kv.committed[-1]]), parents=np.array([-1]))
            registry.verify_batched(stepper, sent, 0, tree, SamplingParams(), k, 0)
            done.append((sent, time.monotonic()))
            k += 1

    thread = threading.Thread(target=step)
    thread.start()
    time.sleep(0.5)              # steady stepping first
    quiet = [f - s for s, f in done]
    started = time.monotonic()
    queue_s, compute_s = registry.sync(syncer, rng.integers(0, 2048, size=prompt_len).tolist(), started)
    ended = time.monotonic()
    stop.set()
    thread.join()
    during = [f - s for s, f in done if s < ended and f > started]     # overlapped the sync
    registry.close()
    return {"prefill": "mixed" if mixed else "turns", "chunk": chunk, "prompt": prompt_len,
            "mixed_chunks": registry.stats.prefill_chunks_mixed, "sync_s": round(ended - started, 3),
            "sync_compute_s": round(compute_s, 3), "sync_queue_s": round(queue_s, 3),
            "turns": registry.stats.prefill_turns, "verifies_overlapping_sync": len(during),
            "verify_ms_quiet_p50": round(statistics.median(quiet) * 1e3, 2) if quiet else None,
            "verify_ms_during_p50": round(statistics.median(during) * 1e3, 1) if during else None,
            "verify_ms_during_max": round(max(during) * 1e3, 1) if during else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here too")
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--chunks", default="64,256,1024,2048")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prefill-modes", default="turns,mixed",
                    help="turns: the sync yields the compute worker between chunks; mixed: its chunks ride "
                         "in the verify forwards (the torch backend's default)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out = {"machine": f"{platform.machine()}, {torch.get_num_threads()} torch thread(s)", "date": time.strftime(
        "%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "compaction": [], "fragmentation_check": [], "turns": []}
    for n in (256, 1024, 2048):
        r = bench_compaction(n, seed=n)
        out["compaction"].append(r)
        print("compaction", r, flush=True)
    for n in (1_000, 10_000, 100_000):
        r = bench_fragmentation_check(n, seed=n)
        out["fragmentation_check"].append(r)
        print("F check", r, flush=True)
    model = small_model()
    for chunk in (int(c) for c in args.chunks.split(",")):
        for mode in args.prefill_modes.split(","):
            r = bench_turns(model, args.prompt, chunk, seed=0, mixed=mode == "mixed")
            out["turns"].append(r)
            print("prefill during steps", r, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
