"""`edgespec run "prompt"`: stream an answer to the terminal, then a one-line stats summary."""
from __future__ import annotations

import argparse
import json
import logging
import sys

from edgespec.cli import CliError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("run", help="answer a prompt with speculative decoding",
                              description="Answer a prompt. With no options the default models are fetched if needed, "
                                          "a bundled verifier runs on loopback, and the answer streams to stdout.")
    p.add_argument("prompt", help='the prompt; "-" reads it from stdin')
    p.add_argument("--system", help="optional system message")
    p.add_argument("--draft", default="draft", help="draft model: manifest name or GGUF path (default: %(default)s)")
    p.add_argument("--target", default="target", help="target model: manifest name or GGUF path (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    tree = p.add_argument_group("draft tree (default: sized every step by the cost model)")
    tree.add_argument("--budget", type=int, help="fixed tree: drafted nodes per step (0 = target only)")
    tree.add_argument("--depth", type=int, help="fixed tree: maximum depth (default 6)")
    tree.add_argument("--branch", type=int, help="fixed tree: children considered per node (default 4)")
    tree.add_argument("--width", type=int, help="fixed tree: nodes expanded per depth (default 4)")
    tree.add_argument("--chain", type=int, metavar="K", help="classic chain speculation with K drafts instead of a tree")
    link = p.add_argument_group("verifier")
    where = link.add_mutually_exclusive_group()
    where.add_argument("--verifier", metavar="HOST:PORT", help="remote verifier (default: a bundled one on loopback)")
    where.add_argument("--local", action="store_true", help="verify in-process, no gRPC")
    link.add_argument("--token", help="bearer token for the verifier (or EDGESPEC_TOKEN)")
    link.add_argument("--tls-ca", metavar="PEM", help="CA certificate to verify the verifier's TLS certificate")
    link.add_argument("--deadline", type=float, metavar="SECONDS", help="per-step deadline before a step is verified locally")
    link.add_argument("--probe-interval", type=float, default=2.0, metavar="SECONDS",
                      help="how often to probe a failed verifier for re-attaching (default %(default)s)")
    link.add_argument("--no-fallback", action="store_true", help="fail instead of verifying locally when the link breaks")
    link.add_argument("--local-first", action="store_true",
                      help="start verifying locally if the verifier cannot be reached yet, and attach it once it can "
                           "(otherwise an unreachable verifier is an error)")
    p.add_argument("--n-ctx", type=int, default=4096)
    p.add_argument("--json-stats", action="store_true", help="print the final stats as JSON on stderr")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import os

    from edgespec.edge.drafting import TreeShape
    from edgespec.edge.session import EdgeSession

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt.strip():
        raise CliError("the prompt is empty")
    if args.max_tokens <= 0:
        raise CliError(f"--max-tokens must be > 0, got {args.max_tokens}")
    try:
        shape = choose_shape(args, TreeShape)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [{"role": "user", "content": prompt}]
    link = {}
    if args.local:
        link["local"] = True
    else:
        if not args.verbose:  # switches are reported below, in one line each
            logging.getLogger("edgespec.failover").setLevel(logging.ERROR)
        link.update(fallback=not args.no_fallback, local_first=args.local_first, deadline_s=args.deadline,
                    probe_interval_s=args.probe_interval,
                    on_switch=lambda e: print(f"\n[edgespec] verifying {e.to_mode} from step {e.step}: {e.reason}",
                                              file=sys.stderr, flush=True))
        if args.verifier:
            link.update(verifier=args.verifier, token=args.token or os.environ.get("EDGESPEC_TOKEN"), tls=args.tls_ca)
    with EdgeSession(args.draft, args.target, tree=shape, n_ctx=args.n_ctx, **link) as session:
        try:
            for chunk in session.chat(messages, stream=True, max_tokens=args.max_tokens,
                                      temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                      seed=args.seed):
                sys.stdout.write(chunk)
                sys.stdout.flush()
        except KeyboardInterrupt:  # what was printed stands; say so, with the figures so far
            sys.stdout.write("\n")
            print(f"[edgespec] interrupted: {session.stats.summary()}", file=sys.stderr)
            raise
        sys.stdout.write("\n")
        print(f"[edgespec] {session.stats.summary()}", file=sys.stderr)
        if args.json_stats:
            s = session.stats
            print(json.dumps({"tokens": s.tokens, "steps": s.steps, "tau": s.tau, "acceptance_rate": s.acceptance_rate,
                              "tokens_per_second": s.tokens_per_second, "prepared_hits": s.prepared_hits,
                              "shapes": s.shapes,
                              "link": s.link.as_dict() if s.link is not None else None, **s.extra},
                             default=str), file=sys.stderr)
    return 0


def choose_shape(args: argparse.Namespace, tree_shape: type) -> object | None:
    """A fixed TreeShape when any tree option was given, else None (the planner sizes each tree)."""
    if args.chain:
        return tree_shape.chain(args.chain)
    given = {k: v for k, v in (("budget", args.budget), ("max_depth", args.depth), ("top_k", args.branch),
                                 ("width", args.width)) if v is not None}
    return tree_shape(**given) if given else None
