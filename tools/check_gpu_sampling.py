#!/usr/bin/env python3
"""χ² check of sampled verification as the GPU engine runs it: CUDA graphs, the Triton tree attention,
the fused kernels and the target-sample rule decided on the device (engine.py's SAMPLE modes).

A tiny random float32 model. One fixed context; a tree whose root has the target's top-3 tokens as
children, each with its own top-2 (the drafter's deterministic top-k children under this rule). Many
sequences verify this tree, each with its own seed; the first two committed tokens (the second is an
accepted grandchild or the bonus token) are compared with exact target sampling, computed from
the same model's eager float32 logits: p(t1), and p(t1) · p(t2 | t1) where t1 is a drafted child.
Cells expected under 5 are pooled. On the CPU the same code runs eagerly (a slow smoke test);
tests/test_sampling_pipeline.py covers the whole edge pipeline on the CPU.

  python tools/check_gpu_sampling.py --trials 65536 --out gpu_sampling.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from edgespec.common.sampling import SamplingParams, probabilities
from edgespec.verifier.torch.engine import Engine, TreeStep
from edgespec.verifier.torch.model import ModelConfig, TransformerLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chi2 import chi2_gof  # noqa: E402  (tools/chi2.py: scipy where installed, else torch)

CONFIGS = {"T0.3": SamplingParams(temperature=0.3), "T0.6": SamplingParams(temperature=0.6), "T1.0": SamplingParams(temperature=1.0),
           "T0.5-topk20-topp0.9": SamplingParams(temperature=0.5, top_k=20, top_p=0.9)}


def chi2_pvalue(counts: Counter, exact: dict[tuple[int, ...], float], n: int) -> tuple[float, int, int]:
    """(p-value, degrees of freedom, outcomes the target rules out that were seen)."""
    impossible = sum(c for k, c in counts.items() if k not in exact)
    p, df = chi2_gof([counts.get(k, 0) for k in exact], [p * n for p in exact.values()])
    return p, df, impossible


def run(engine: Engine, prefix: list[int], sampling: SamplingParams, trials: int, batch: int, seed0: int) -> dict:
    ref = engine.new_sequence()
    engine.prefill(ref, prefix[:-1])
    root = prefix[-1]
    p_root = probabilities(engine.logits(ref, [root], [-1])[0].cpu().numpy(), sampling)
    children = [int(t) for t in np.argsort(-p_root, kind="stable")[:3]]
    tokens, parents, p_child = [root], [-1], {}
    for c in children:
        tokens.append(c)
        parents.append(0)
    for i, c in enumerate(children, start=1):
        p_child[c] = probabilities(engine.logits(ref, [root, c], [-1, 0])[1].cpu().numpy(), sampling)
        for g in np.argsort(-p_child[c], kind="stable")[:2]:
            tokens.append(int(g))
            parents.append(i)
    ref.close()
    exact: dict[tuple[int, ...], float] = {}
    for t1 in np.flatnonzero(p_root > 0):
        if int(t1) in p_child:
            for t2 in np.flatnonzero(p_child[int(t1)] > 0):
                exact[(int(t1), int(t2))] = float(p_root[t1] * p_child[int(t1)][t2])
        else:
            exact[(int(t1),)] = float(p_root[t1])
    seqs = [engine.new_sequence() for _ in range(batch)]
    for s in seqs:
        engine.prefill(s, prefix[:-1])
    counts: Counter = Counter()
    started = time.perf_counter()
    for start in range(0, trials, batch):
        steps = [TreeStep(s, tokens, parents, SamplingParams(temperature=sampling.temperature, top_k=sampling.top_k,
                                                             top_p=sampling.top_p, seed=seed0 + start + b), step=1)
                 for b, s in enumerate(seqs)]
        for d in engine.verify(steps):
            committed = [tokens[i] for i in d.path] + [d.next_token]
            counts[tuple(committed[:2]) if committed[0] in p_child else (committed[0],)] += 1
        for s in seqs:
            s.truncate(len(prefix) - 1)
    seconds = time.perf_counter() - started
    for s in seqs:
        s.close()
    n = sum(counts.values())
    p, df, impossible = chi2_pvalue(counts, exact, n)
    first: Counter = Counter()
    for k, c in counts.items():
        first[(k[0],)] += c
    p1, df1, _ = chi2_pvalue(first, {(int(t),): float(p_root[t]) for t in np.flatnonzero(p_root > 0)}, n)
    return {"trials": n, "joint_p": p, "joint_df": df, "first_p": p1, "first_df": df1, "impossible_seen": impossible,
            "tree_nodes": len(tokens), "mass_on_children": float(p_root[children].sum()), "seconds": seconds,
            "steps": engine.stats["steps"], "replays": engine.stats["replays"], "captures": engine.stats["captures"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--trials", type=int, default=65536)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    model = TransformerLM.random(ModelConfig.tiny("qwen2"), dtype=torch.float32, device=args.device, seed=3)
    engine = Engine(model, num_blocks=4 * args.batch + 64, block_size=16)
    prefix = np.random.default_rng(7).integers(0, model.config.vocab_size, size=40).tolist()
    report = {"device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
              "torch": torch.__version__, "attention": engine.attention, "cuda_graphs": engine.cuda_graphs,
              "fused": engine.fused, "results": {}}
    worst = 1.0
    for i, name in enumerate(args.configs.split(",")):
        r = run(engine, prefix, CONFIGS[name], args.trials, args.batch, seed0=1_000_000 * (i + 1))
        report["results"][name] = r
        worst = min(worst, r["joint_p"], r["first_p"])
        print(name, json.dumps(r), flush=True)
    tests = 2 * len(report["results"])
    report["bonferroni_alpha"] = 0.01 / tests
    report["passed"] = worst > 0.01 / tests and all(r["impossible_seen"] == 0 for r in report["results"].values())
    print(json.dumps({k: v for k, v in report.items() if k != "results"}), flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
