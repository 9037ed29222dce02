"""Host time of TorchBackend.verify_many by phase, on the CPU with a tiny random model.

The GPU step is replayed from a CUDA graph, so what a batch costs beyond it is host Python: tree
checks, block reservations, packing the step's inputs, reading the decisions back, committing.
Here the model is ModelConfig.tiny (the forward is small) and every phase is timed by wrapping the
function that does it; "host" is the whole verify_many minus the step function (Engine._run).

    .venv/bin/python tools/bench_verify_host.py --sessions 16 --tree 64 [--sampled] [--cprofile]

Each tree is first checked as verifier/server.py checks a Verify in its request thread (reported
apart: it is not on the batch thread). Times are CPU seconds of the calling thread
(time.thread_time: steadier than wall time on a shared box; torch runs on one thread here),
medians over --iters batches, in milliseconds.
Compare two versions of the code by running this once with each on PYTHONPATH (see
docs/BENCHMARKS.md); results_sha (accepted paths and tokens) and kv_sha (each session's committed
K/V, in position order) must agree.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

import edgespec
from edgespec.common.sampling import SamplingParams
from edgespec.verifier.torch import backend as bk
from edgespec.verifier.torch import engine as en
from edgespec.verifier.torch import kv_cache as kv
from edgespec.verifier.torch.model import ModelConfig, TransformerLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu_verify import random_tree  # noqa: E402 - the capacity clients' random trees

PHASES = [(bk, "check_tree", "check_tree"), (bk.TorchSession, "_tree_step", "tree_step (incl. check_tree)"),
          (kv.KVSequence, "reserve", "reserve"), (kv.KVSequence, "trim", "trim"), (en.Engine, "_pack", "pack"),
          (en.Engine, "_run", "step function"), (en.Engine, "verify", "engine.verify (incl. pack, step)"),
          (bk.TorchSession, "_commit", "commit"), (en.Engine, "between_steps", "between_steps")]


def timed(spent: dict, obj, name: str, label: str) -> None:  # noqa: ANN001
    """Replace obj.name by a wrapper that adds its thread CPU time to spent[label]."""
    f = getattr(obj, name)

    def wrapper(*args, **kwargs):  # noqa: ANN202
        t = time.thread_time()
        try:
            return f(*args, **kwargs)
        finally:
            spent[label] += time.thread_time() - t
    setattr(obj, name, wrapper)


def kv_digest(cache: kv.PagedKVCache, seqs: list) -> str:
    """The sequences' committed K/V in position order: not the raw cache, whose block placement (and
    the stale tree rows in blocks past a context) differs between versions that hand blocks out
    differently (spares kept between steps, say)."""
    h = hashlib.sha1()
    for seq in seqs:
        tables = cache.block_tables([seq])
        for layer in range(cache.n_layer):
            h.update(cache.gather(layer, tables)[:, 0, :len(seq)].contiguous().numpy().tobytes())
    return h.hexdigest()[:12]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--tree", type=int, default=64, help="nodes per tree, root included")
    ap.add_argument("--context", type=int, default=1024, help="tokens each session is synced to first")
    ap.add_argument("--iters", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--sampled", action="store_true", help="temperature 0.8 (target-sample rule) instead of greedy")
    ap.add_argument("--cprofile", action="store_true", help="also print the host functions' cProfile (step excluded)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    spent: dict[str, float] = defaultdict(float)
    prof = None
    if args.cprofile:
        import cProfile
        prof = cProfile.Profile()
        run = en.Engine._run

        def run_unprofiled(self, *a):  # noqa: ANN001, ANN202
            prof.disable()
            try:
                return run(self, *a)
            finally:
                prof.enable()
        en.Engine._run = run_unprofiled
    for obj, name, label in PHASES:
        timed(spent, obj, name, label)

    config = ModelConfig.tiny("qwen2")
    n_ctx = args.context + args.iters + args.warmup + 256
    model = TransformerLM.random(config, max_positions=n_ctx)
    backend = bk.TorchBackend.from_model(model, n_ctx=n_ctx, max_nodes=max(args.tree, 2), max_depth=64,
                                         max_sessions=args.sessions)
    rng = np.random.default_rng(0)
    sessions = []
    for _ in range(args.sessions):
        s = backend.open_session()
        s.sync(rng.integers(0, config.vocab_size, size=args.context).tolist())
        sessions.append(s)
    sampling = SamplingParams(temperature=0.8, seed=11) if args.sampled else SamplingParams()

    def batch(step: int) -> list:
        return [(s, random_tree(s.committed[-1], args.tree, config.vocab_size, rng), sampling, step)
                for s in sessions]

    def as_the_server_does(requests: list) -> float:
        """The checks verifier/server.py runs on each Verify in its request thread, before the batch
        (concurrently with other batches' GPU time there); CPU seconds, not part of verify_many."""
        t = time.thread_time()
        for _, tree, samp, _ in requests:
            tree.validate(config.vocab_size, max_nodes=backend.info.max_nodes, require_q=samp.needs_q)
            int(tree.depths.max())
        return time.thread_time() - t

    samples: dict[str, list[float]] = defaultdict(list)
    results = []
    for it in range(args.warmup + args.iters):
        requests = batch(it)
        arrival = as_the_server_does(requests)
        spent.clear()
        if prof is not None and it >= args.warmup:
            prof.enable()
        t = time.thread_time()
        answers = backend.verify_many(requests)
        total = time.thread_time() - t
        if prof is not None:
            prof.disable()
        results.append([(a.path, a.tokens) for a in answers])
        if it >= args.warmup:
            for k, v in spent.items():
                samples[k].append(v * 1e3)
            samples["verify_many"].append(total * 1e3)
            samples["request threads: server checks (not in verify_many)"].append(arrival * 1e3)
            samples["host (verify_many - step function)"].append((total - spent["step function"]) * 1e3)
    ms = {k: round(statistics.median(v), 3) for k, v in samples.items()}
    print(json.dumps({"code": edgespec.__file__, "sessions": args.sessions, "tree": args.tree,
                      "sampled": args.sampled, "iters": args.iters, "ms": ms,
                      "results_sha": hashlib.sha1(repr(results).encode()).hexdigest()[:12],
                      "kv_sha": kv_digest(backend.engine.cache, [s.seq for s in sessions])}))
    if prof is not None:
        import pstats
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
