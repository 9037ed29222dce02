#!/usr/bin/env python3
"""The planner against fixed shapes: the real draft model and decoder, a remote GPU verifier simulated (greedy only).

Why: the product's hard regime is a GPU verifier (~2 ms a step) behind 20-100 ms of link, where the edge's drafting
decides the speed. A GPU host is lent for minutes a session, and this box's CPU target takes ~1 s a tree, so that
regime cannot be run here with the real target in the loop. For greedy decoding it does not have to be: a greedy
step accepts the tree's longest path that follows the target's own greedy continuation and adds the target's next
token. So this tool computes each prompt's continuation once with the real target (llama.cpp, target-only greedy;
cached under the model cache) and answers every tree from it after a modelled delay: the RTT plus a verify time
(fixed + per node; defaults from the GPU host's fits). The drafter, the decoder (drafting ahead included) and the
planner are the product's own, in real time on this machine; the prompts and their order are bench_link's.

What it is not: a measure of the product's speed, nor of losslessness (the outputs equal the reference by
construction; llama.cpp's batch-shape numerics are not simulated). The draft runs on this box's cores, slower than a
GPU host's (there, thirtieth session, 8 cores: 14 ms a chain decode, 27 ms a 4-row level), so use an RTT scaled by
the ratio of decode costs (the adaptive planner's, in the output's `planners`) and compare modes within one run.

    python tools/bench_planner_sim.py --rtts 100,200 --modes ar,chain4,adaptive --rounds 2 --json out.json
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Sequence

REPO = Path(__file__).resolve().parents[1]
for p in (str(REPO), str(REPO / "tools"), str(REPO / "tests")):
    if p not in sys.path:
        sys.path.insert(0, p)

from bench_link import prompt_set, run_delta  # noqa: E402
from bench_wire import machine  # noqa: E402

# The thirtieth session's GPU e2e (H100 host, torch verifier): verify_ms_fixed ≈ 2.0, per node ≈ 0.011 ms.
VERIFY_FIXED_MS, VERIFY_NODE_MS = 2.0, 0.011


class ReferenceVerifier:
    """Answers greedy trees from each prompt's target-only greedy continuation, `rtt_s` + verify time later.

    The answer is what a greedy target verifier returns: the deepest path whose tokens follow the reference, then
    the reference's next token. A context that leaves the reference (it cannot, with greedy acceptance) is an error."""

    def __init__(self, references: dict[tuple[int, ...], list[int]], rtt_s: float,
                 fixed_s: float = VERIFY_FIXED_MS / 1e3, per_node_s: float = VERIFY_NODE_MS / 1e3,
                 n_tokens: int | None = None) -> None:
        """n_tokens: how long the references were asked to be; a shorter one ended with the target's end token."""
        self.references, self.rtt_s, self.fixed_s, self.per_node_s = references, rtt_s, fixed_s, per_node_s
        self.n_tokens = n_tokens

    def _continuation(self, context: Sequence[int]) -> tuple[list[int], bool]:
        """The reference tokens after `context` (prompt + committed tokens), and whether the reference ended at the
        target's end token (it is shorter than n_tokens)."""
        for prompt, reference in self.references.items():
            n = len(context) - len(prompt)
            if n >= 0 and tuple(context[:len(prompt)]) == prompt:
                if list(context[len(prompt):]) != reference[:n]:
                    raise ValueError(f"the context left the reference at token {n}: not greedy, or another target")
                return reference[n:], self.n_tokens is not None and len(reference) < self.n_tokens
        raise KeyError("no reference for this prompt")

    def sync(self, context: Sequence[int]) -> None:
        self._continuation(context)
        threading.Event().wait(self.rtt_s + self.fixed_s)

    def verify(self, context, tree, sampling, step):
        from edgespec.common.acceptance import VerifyResult, follow_target
        from edgespec.edge.planner import BYTES_PER_MESSAGE, BYTES_PER_NODE

        if sampling.temperature > 0:
            raise ValueError("the reference verifier answers greedy requests only")
        ahead, ended = self._continuation(context)

        def reference_token(node: int) -> int:   # the target's greedy token after `node`: the reference at its depth
            depth = len(tree.path_to(node))
            if depth < len(ahead):
                return ahead[depth]
            if ended and ahead:   # a path through the end token: what follows is never committed
                return ahead[-1]
            raise ValueError("the reference is too short for this tree: raise --reference-extra")

        acc = follow_target(tree, reference_token)
        compute_s = self.fixed_s + self.per_node_s * len(tree)
        threading.Event().wait(self.rtt_s + compute_s)
        tokens = [int(tree.tokens[i]) for i in acc.path] + [acc.next_token]
        return VerifyResult(path=acc.path, tokens=tokens, margins=[1.0] * len(tokens), compute_s=compute_s,
                            network_s=self.rtt_s, bytes_up=BYTES_PER_MESSAGE + BYTES_PER_NODE * (len(tree) - 1))

    def close(self) -> None:
        pass


def references(target_path: Path, prompts: list[list[int]], n_tokens: int, n_ctx: int, threads: int) -> list[list[int]]:
    """Each prompt's target-only greedy continuation (n_tokens, or up to its end token), cached by content."""
    from edgespec.common import modelstore
    from edgespec.common.sampling import SamplingParams
    from edgespec.edge.decoder import Decoder, SessionStats
    from edgespec.edge.drafting import Drafter, TreeShape
    from edgespec.runtime.llama import ContextConfig, LlamaModel
    from edgespec.runtime.tree_verifier import LocalVerifier

    stat = target_path.stat()
    key = hashlib.sha256(json.dumps([target_path.name, stat.st_size, prompts, n_tokens]).encode()).hexdigest()[:16]
    cache = modelstore.home_dir() / "sim_references" / f"{key}.json"
    if cache.exists():
        return json.loads(cache.read_text())
    model = LlamaModel(target_path)
    config = ContextConfig(n_ctx=n_ctx, max_tree_nodes=4, n_threads=threads)
    drafter, verifier = Drafter(model, config), LocalVerifier(model, config)
    decoder = Decoder(drafter, verifier, SessionStats(), TreeShape.target_only(), model.is_end_of_generation,
                      pipelined=False)
    out = []
    try:
        for prompt in prompts:
            for _ in decoder.run(prompt, n_tokens, SamplingParams()):
                pass
            out.append(decoder.committed[len(prompt):])
    finally:
        decoder.close()
        verifier.close()
        drafter.close()
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(out))
    return out


def one_request(decoder, prompt: list[int], max_tokens: int) -> dict:
    """One greedy answer: its counters' deltas, its step trace (less the observations) and why each shape was chosen."""
    from edgespec.common.sampling import SamplingParams

    with run_delta(decoder.stats) as delta:
        for _ in decoder.run(prompt, max_tokens, SamplingParams()):
            pass
    delta["why"] = dict(Counter(f"{s['shape']}:{s.get('why', '')}" for s in delta["trace"]))
    delta["trace"] = [{k: v for k, v in s.items() if k != "obs"} for s in delta["trace"]]
    return delta


def run(args: argparse.Namespace) -> dict:
    from edgespec.common import modelstore
    from edgespec.edge.decoder import Decoder, SessionStats
    from edgespec.edge.drafting import Drafter, TreeShape
    from edgespec.edge.planner import Planner
    from edgespec.runtime.llama import ContextConfig, LlamaModel

    named = prompt_set(args.spec_bench, args.humaneval, args.spec)
    draft_path, target_path = modelstore.resolve(args.draft, progress=False), modelstore.resolve(args.target, progress=False)
    draft_model = LlamaModel(draft_path)
    prompts = [draft_model.chat_tokens([{"role": "user", "content": text}]) for _, text in named]
    t0 = time.monotonic()
    refs = references(target_path, prompts, args.max_tokens + args.reference_extra, args.n_ctx, args.threads)
    print(f"references ready in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    table = {tuple(p): r for p, r in zip(prompts, refs)}
    config = ContextConfig(n_ctx=args.n_ctx, max_tree_nodes=64, n_threads=args.threads)
    modes = args.modes.split(",")
    shapes = {m: TreeShape.target_only() if m == "ar" else None if m.startswith("adaptive") else TreeShape.from_label(m)
              for m in modes}
    if ("adaptive-ladder" in modes) != bool(args.ladder):
        raise SystemExit("--ladder and the adaptive-ladder mode go together")
    ladder = parse_ladder(args.ladder) if args.ladder else None
    meta = {"machine": machine(), "command": " ".join(["python", *sys.argv]), "draft": draft_path.name,
            "target": target_path.name, "prompts": [n for n, _ in named], "max_tokens": args.max_tokens,
            "verify_ms": [args.verify_fixed_ms, args.verify_node_ms], "threads": args.threads,
            "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    runs, planners = [], {}
    for rnd in range(args.rounds):
        for rtt_ms in (float(x) for x in args.rtts.split(",")):
            verifier = ReferenceVerifier(table, rtt_ms / 1e3, args.verify_fixed_ms / 1e3, args.verify_node_ms / 1e3,
                                         n_tokens=args.max_tokens + args.reference_extra)
            for mode in modes:   # as bench_link: one session per mode, one planner per link condition
                drafter = Drafter(draft_model, config)
                decoder = Decoder(drafter, verifier, SessionStats(), shapes[mode], draft_model.is_end_of_generation,
                                  pipelined=True)
                if mode == "adaptive":
                    decoder.planner = Planner()
                elif mode == "adaptive-ladder":   # the planner over --ladder's shapes, beside the default's
                    decoder.planner = Planner(ladder=ladder)
                try:
                    for (name, _), prompt in zip(named, prompts):
                        d = one_request(decoder, prompt, args.max_tokens)
                        runs.append({"round": rnd, "rtt_ms": rtt_ms, "mode": mode, "prompt": name, **d})
                        print(f"round {rnd} rtt {rtt_ms:g} {mode:9s} {name:18s} {d['tokens']} tok "
                              f"{d['seconds']:.2f} s  {d['tokens'] / d['seconds']:.2f} tok/s  {d['why']}",
                              file=sys.stderr, flush=True)
                    if decoder.planner is not None:
                        planners[f"{rnd}/{rtt_ms:g}"] = decoder.planner.snapshot()
                finally:
                    decoder.close()
                    drafter.close()
    return {"meta": meta, "planners": planners, "runs": runs}


def parse_ladder(spec: str) -> tuple:
    """'target-only,chain2,chain3,...,tree64' as TreeShapes: chainK any K, the tree labels the default LADDER's."""
    from edgespec.edge.drafting import TreeShape
    from edgespec.edge.planner import LADDER

    shapes = []
    for label in spec.split(","):
        try:
            shapes.append(TreeShape.from_label(label, LADDER))
        except ValueError as exc:
            raise SystemExit(f"--ladder: {exc}") from None
    return tuple(shapes)


def summary(res: dict) -> str:
    """Tokens/s per (RTT, mode) over all rounds and prompts, with ratios to AR and chain4 of the same RTT."""
    totals: dict[tuple[float, str], list[float]] = {}
    for r in res["runs"]:
        t = totals.setdefault((r["rtt_ms"], r["mode"]), [0, 0.0])
        t[0] += r["tokens"]
        t[1] += r["seconds"]
    lines = ["| RTT ms | mode | tok/s | × AR | × chain4 |", "|---|---|---|---|---|"]
    for (rtt, mode), (tokens, seconds) in sorted(totals.items()):
        rate = tokens / seconds

        def ratio(other: str) -> str:
            o = totals.get((rtt, other))
            return f"{rate / (o[0] / o[1]):.2f}" if o else "—"
        lines.append(f"| {rtt:g} | {mode} | {rate:.2f} | {ratio('ar')} | {ratio('chain4')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rtts", default="100,200", help="round-trip times in ms, comma-separated")
    ap.add_argument("--modes", default="ar,chain4,adaptive", help="ar, chainK, adaptive, adaptive-ladder (--ladder's)")
    ap.add_argument("--ladder", default="", help="shapes of the adaptive-ladder mode's planner, smallest first "
                                                  "(e.g. target-only,chain2,chain3,chain4,chain6,tree8,tree16,tree32,tree64)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--humaneval", type=int, default=2)
    ap.add_argument("--spec", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reference-extra", type=int, default=16, help="reference tokens past max-tokens (tree depth)")
    ap.add_argument("--verify-fixed-ms", type=float, default=VERIFY_FIXED_MS)
    ap.add_argument("--verify-node-ms", type=float, default=VERIFY_NODE_MS)
    ap.add_argument("--draft", default="draft")
    ap.add_argument("--target", default="target")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads of the draft (and the reference run)")
    ap.add_argument("--n-ctx", type=int, default=2048)
    ap.add_argument("--spec-bench", type=Path, default=REPO / "tools" / "data" / "spec_bench_questions.jsonl")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    res = run(args)
    print(summary(res))
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
