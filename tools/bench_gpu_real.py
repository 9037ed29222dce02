#!/usr/bin/env python3
"""Real weights through the torch verifier on a GPU: greedy speculative output vs the same
backend's target-only greedy output, and step times with the real model.

    python tools/bench_gpu_real.py --model target.gguf --prompts prompts.json --out real.json

prompts.json: a list of token-id lists (chat-templated prompts, tokenized where llama.cpp runs;
the GPU host has no tokenizer). For each prompt:
1. target-only: root-only trees, one token per `verify` (the backend's own AR decoding), recording
   each step's top-2 logit margin;
2. speculative: trees whose nodes follow the target-only continuation for up to `--depth` levels,
   each level with a wrong sibling and, at random, a wrong token that ends the path early (so paths
   of every length get accepted and rejected); the output must equal target-only token for token.
   A divergence is reported with the target-only margin where it happened (a near-tie explained by
   bf16 numerics shows a small margin there).
Step times: median `verify` wall time of the target-only and the speculative steps.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from edgespec.common.sampling import SamplingParams  # noqa: E402
from edgespec.common.tree import TokenTree  # noqa: E402
from edgespec.verifier.torch.backend import TorchBackend  # noqa: E402

GREEDY = SamplingParams()


def target_only(backend: TorchBackend, prompt: list[int], n: int) -> tuple[list[int], list[float], list[float]]:
    s = backend.open_session()
    s.sync(prompt)
    out, margins, times = [], [], []
    while len(out) < n:
        tree = TokenTree(tokens=np.array([s.committed[-1]]), parents=np.array([-1]))
        t = time.perf_counter()
        r = s.verify(tree, GREEDY, len(out))
        times.append(time.perf_counter() - t)
        out += r.tokens
        margins += r.margins
    s.close()
    return out[:n], margins[:n], times


def speculative(backend: TorchBackend, prompt: list[int], ref: list[int], depth: int,
                rng: np.random.Generator) -> tuple[list[int], list[float], int, int]:
    s = backend.open_session()
    s.sync(prompt)
    out, times, steps, accepted = [], [], 0, 0
    vocab = backend.info.vocab_size
    while len(out) < len(ref):
        tokens, parents, node = [s.committed[-1]], [-1], 0
        for d, t in enumerate(ref[len(out):len(out) + depth]):
            wrong = (t + 1 + d) % vocab
            right = t if rng.random() > 0.15 else (t + 7) % vocab   # sometimes the draft is wrong here
            tokens += [wrong, right] if d % 2 else [right, wrong]
            parents += [node, node]
            node = len(tokens) - (1 if d % 2 else 2)
            if right != t:
                break
        tree = TokenTree(tokens=np.array(tokens), parents=np.array(parents))
        t0 = time.perf_counter()
        r = s.verify(tree, GREEDY, steps)
        times.append(time.perf_counter() - t0)
        out += r.tokens
        steps += 1
        accepted += len(r.path)
        if out[:len(ref)] != ref[:len(out)]:
            break  # diverged: stop here, report where
    s.close()
    return out[:len(ref)], times, steps, accepted


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    started = time.perf_counter()
    backend = TorchBackend(args.model, device=args.device, n_ctx=2048, max_nodes=64, max_sessions=4)
    load_s = time.perf_counter() - started
    prompts = json.loads(Path(args.prompts).read_text())
    rng = np.random.default_rng(0)
    rows = []
    for i, prompt in enumerate(prompts):
        ref, margins, t_ar = target_only(backend, prompt, args.tokens)
        got, t_spec, steps, accepted = speculative(backend, prompt, ref, args.depth, rng)
        first = next((j for j, (a, b) in enumerate(zip(got, ref)) if a != b), None)
        row = {"prompt": i, "prompt_tokens": len(prompt), "tokens": len(ref), "equal": got == ref,
               "first_divergence": first, "margin_there": None if first is None else margins[first],
               "smallest_margin": min(margins), "spec_steps": steps, "accepted": accepted,
               "tau": len(got) / max(1, steps),
               "ar_step_ms": 1000 * statistics.median(t_ar[1:]), "spec_step_ms": 1000 * statistics.median(t_spec[1:]),
               "ref_head": ref[:12]}
        rows.append(row)
        print("[real]", json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    result = {"model": str(args.model), "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
              "torch": torch.__version__, "backend": backend.info.backend, "extra": backend.info.extra,
              "load_s": round(load_s, 1), "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    print(f"load {load_s:.1f} s; equal on {sum(r['equal'] for r in rows)}/{len(rows)} prompts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
