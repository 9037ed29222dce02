"""`edgespec run "prompt"`: stream an answer to the terminal, then a one-line stats summary."""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from edgespec.cli import CliError
from edgespec.common.sampling import AcceptanceRule

if TYPE_CHECKING:
    from edgespec.common.constraints import Grammar


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("run", help="answer a prompt with speculative decoding",
                              description="Answer a prompt. With no options the default models are fetched if needed, "
                                          "a bundled verifier runs on loopback, and the answer streams to stdout.")
    p.add_argument("prompt", help='the prompt; "-" reads it from stdin')
    p.add_argument("--system", help="optional system message")
    p.add_argument("--draft", default="draft", help="draft model: manifest name or GGUF path (default: %(default)s)")
    p.add_argument("--target", default="target", help="target model: manifest name or GGUF path (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=256, help="longest answer in tokens (default %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy (default %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling: keep the smallest set of tokens with this much probability (default %(default)s = off)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the K most likely tokens (default %(default)s = off)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: a fresh one per run)")
    p.add_argument("--sampling-rule", choices=[r.value for r in AcceptanceRule], default=AcceptanceRule.TARGET_SAMPLE.value,
                   help="exact acceptance rule for sampled trees (default: %(default)s)")
    tree = p.add_argument_group("draft tree (default: sized every step by the cost model)")
    tree.add_argument("--budget", type=int, help="fixed tree: drafted nodes per step (0 = target only)")
    tree.add_argument("--depth", type=int, help="fixed tree: maximum depth (default 6)")
    tree.add_argument("--branch", type=int, help="fixed tree: children considered per node (default 4)")
    tree.add_argument("--width", type=int, help="fixed tree: nodes expanded per depth (default 4)")
    tree.add_argument("--chain", type=int, metavar="K", help="classic chain speculation with K drafts instead of a tree")
    tree.add_argument("--lookup", action="store_true",
                      help="draft pool: merge the draft model's tree with a lookup in the conversation so far")
    tree.add_argument("--router", nargs="?", const="default", metavar="STATE",
                      help="let the router choose per turn among the draft model, the lookup and both, and each "
                           "tree, learning across runs in the STATE file (default: $EDGESPEC_HOME/router/state.npz)")
    link = p.add_argument_group("verifier")
    where = link.add_mutually_exclusive_group()
    where.add_argument("--verifier", metavar="HOST:PORT",
                       help="remote verifier (default: a bundled one on loopback); a fleet routed by the edge: "
                            "H1:P,H2:P, fleet:NAME:PORT (every DNS record) or http://DIRECTORY (deploy/README.md)")
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
    p.add_argument("--n-ctx", type=int, default=4096,
                   help="context window in tokens, prompt and answer (default %(default)s); an answer that "
                        "fills it stops early and says so")
    hw = p.add_argument_group("hardware (default: sized per mode from this machine's CPUs; see README)")
    hw.add_argument("--draft-threads", type=int, metavar="N", help="llama.cpp threads of the draft model")
    hw.add_argument("--target-threads", type=int, metavar="N",
                    help="llama.cpp threads of this device's target (--local, the bundled verifier, the fallback)")
    hw.add_argument("--draft-gpu-layers", type=int, metavar="N",
                    help="draft layers on the GPU (-1: all; default: all on a GPU build of llama.cpp, else 0)")
    hw.add_argument("--target-gpu-layers", type=int, metavar="N", help="the same for this device's target")
    pii = p.add_argument_group("privacy (edgespec/edge/privacy)")
    pii.add_argument("--mask-pii", nargs="?", const="presidio", choices=["presidio", "patterns"], metavar="MODE",
                     help="mask personal data before anything leaves this device, restore it in the answer: "
                          "presidio (spaCy NER + patterns, the default MODE) or patterns (no spaCy model)")
    pii.add_argument("--pii-strict", action="store_true",
                     help="with --mask-pii: refuse to send anything when the PII analyzer fails")
    p.add_argument("--ban", action="append", default=[], metavar="PHRASE",
                   help="never write PHRASE (repeatable): masked in the draft and in the verifier alike")
    shape_of = p.add_mutually_exclusive_group()
    shape_of.add_argument("--json-schema", metavar="FILE", type=Path,
                          help="the answer is JSON valid against this JSON schema (masked in the draft and in the "
                               "verifier alike, so it is the target's own constrained answer)")
    shape_of.add_argument("--grammar", metavar="FILE", type=Path,
                          help="the answer matches this grammar (Lark, or llama.cpp's GBNF), masked the same way")
    p.add_argument("--json-stats", action="store_true", help="print the final stats as JSON on stderr")
    p.set_defaults(func=run)


def response_format_of(args: argparse.Namespace) -> Grammar | None:
    """--json-schema / --grammar compiled for chat()'s response_format, before any model loads (once:
    chat() takes the compiled Grammar as it is)."""
    from edgespec.common.constraints import Grammar
    from edgespec.common.errors import InvalidRequestError

    path = args.json_schema or args.grammar
    if path is None:
        return None
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"cannot read {path}: {exc}") from None
    if args.json_schema is not None:
        try:
            schema = json.loads(text)
        except ValueError as exc:
            raise CliError(f"{path} is not JSON: {exc}") from None
        response_format = {"type": "json_schema", "json_schema": {"name": path.stem, "schema": schema}}
    else:
        response_format = {"type": "grammar", "grammar": text}
    try:
        return Grammar.from_response_format(response_format)
    except InvalidRequestError as exc:
        raise CliError(f"{path}: {exc}") from None


def run(args: argparse.Namespace) -> int:
    with CtrlC() as ctrl_c:
        try:   # the imports load llama.cpp: Ctrl-C may land there already
            from edgespec.edge.session import EdgeSession  # noqa: F401
        except KeyboardInterrupt:
            ctrl_c.pressed = True
        if ctrl_c.pressed:
            print("[edgespec] interrupted while starting", file=sys.stderr)
            return 130
        return _run(args, ctrl_c)


def _run(args: argparse.Namespace, ctrl_c: "CtrlC") -> int:
    import os

    from edgespec.edge.drafting import TreeShape
    from edgespec.edge.session import EdgeSession

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt.strip():
        raise CliError("the prompt is empty")
    if args.max_tokens <= 0:
        raise CliError(f"--max-tokens must be > 0, got {args.max_tokens}")
    if args.n_ctx <= 0:
        raise CliError(f"--n-ctx must be > 0, got {args.n_ctx}")
    for flag, value, low in (("--draft-threads", args.draft_threads, 1), ("--target-threads", args.target_threads, 1),
                             ("--draft-gpu-layers", args.draft_gpu_layers, -1),
                             ("--target-gpu-layers", args.target_gpu_layers, -1)):
        if value is not None and value < low:
            raise CliError(f"{flag} must be >= {low}, got {value}")
    if args.pii_strict and not args.mask_pii:
        raise CliError("--pii-strict needs --mask-pii")
    response_format = response_format_of(args)
    try:
        shape = choose_shape(args, TreeShape)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    router = None if args.router is None else True if args.router == "default" else args.router
    if router is not None and shape is not None:
        raise CliError("--router chooses every tree itself; leave out --chain/--budget/--depth/--branch/--width")
    if isinstance(router, str) and (not router.strip() or os.path.isdir(router)):
        raise CliError(f"--router STATE must be a file path, got {router!r}")
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
    hardware = dict(draft_threads=args.draft_threads, target_threads=args.target_threads,
                    draft_gpu_layers=args.draft_gpu_layers, target_gpu_layers=args.target_gpu_layers)
    try:
        session = EdgeSession(args.draft, args.target, tree=shape, n_ctx=args.n_ctx, lookup=args.lookup, **link,
                              **hardware, privacy=args.mask_pii, strict=args.pii_strict, router=router)
    except KeyboardInterrupt:
        print("[edgespec] interrupted while starting", file=sys.stderr)
        return 130
    with session:
        ctrl_c.defer()   # from here on Ctrl-C stops after the current step (see CtrlC)
        if not ctrl_c.pressed:
            chunks = session.chat(messages, stream=True, max_tokens=args.max_tokens,
                                  temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                  seed=args.seed, sampling_rule=args.sampling_rule, banned_phrases=args.ban,
                                  response_format=response_format)
            try:
                for chunk in chunks:
                    sys.stdout.write(chunk)
                    sys.stdout.flush()
                    if ctrl_c.pressed:
                        break
            finally:
                chunks.close()
        sys.stdout.write("\n")
        sys.stdout.flush()
        if ctrl_c.pressed:   # what was printed stands; say so, with the figures so far
            print(f"[edgespec] interrupted: {session.stats.summary()}", file=sys.stderr)
            return 130
        if session.finish_reason == "context_full":
            print(f"[edgespec] stopped: the context window of {session.n_ctx} tokens is full (prompt and answer); "
                  "pass a larger --n-ctx for longer answers", file=sys.stderr)
        print(f"[edgespec] {session.stats.summary()}", file=sys.stderr)
        if session.router is not None:
            turn = session.stats.extra.get("planner", {}).get("router", {}).get("arm")
            print(f"[edgespec] router: chose {turn} for this turn; learns in {session.router.state_path}",
                  file=sys.stderr)
        if args.json_stats:
            s = session.stats
            print(json.dumps(finite_json({"tokens": s.tokens, "steps": s.steps, "tau": s.tau,
                              "acceptance_rate": s.acceptance_rate, "tokens_per_second": s.tokens_per_second,
                              "prepared_hits": s.prepared_hits, "shapes": s.shapes,
                              "finish_reason": session.finish_reason, "threads": session.threads,
                              "gpu_layers": session.gpu_layers,
                              "link": s.link.as_dict() if s.link is not None else None,
                              **s.extra}), default=str, allow_nan=False), file=sys.stderr)
    return 0


def finite_json(value: object) -> object:
    """JSON has no Infinity or NaN (json.dumps writes them, and strict parsers such as jq and
    JavaScript's JSON.parse reject the result): a figure not measured yet (the planner's uplink
    bandwidth before a transfer was timed is inf) becomes null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    return value


class CtrlC:
    """SIGINT handling of `edgespec run`: the answer so far stays, the summary is printed, exit 130.

    While starting (imports, model loading, the bundled verifier) Ctrl-C raises KeyboardInterrupt as
    usual: the constructors clean up after themselves. Once the answer runs, `defer()` switches to a
    flag checked after each step. A KeyboardInterrupt raised at an arbitrary bytecode in the decode
    loop could land between a native call and its bookkeeping, or just after a lock was taken inside
    a Python-level __enter__ (threading.Condition, ThreadPoolExecutor), which a later close() would
    then wait on forever. A second Ctrl-C exits at once (130): a step can take long (a long prompt's
    prefill, a slow link), and the user asked twice.
    """

    def __init__(self) -> None:
        self.pressed = False
        self._deferred = False
        self._previous: object = None
        self._unraisable = sys.unraisablehook

    def __enter__(self) -> "CtrlC":
        # Signals go to the main thread only. A process started with SIGINT ignored (a background job
        # of a shell script, nohup) keeps ignoring it, as it did while importing: POSIX's convention
        # that a terminal's Ctrl-C is not for background jobs.
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
            self._previous = signal.signal(signal.SIGINT, self._handle)
            self._unraisable = sys.unraisablehook
            sys.unraisablehook = self._drop_interrupts
        return self

    def _drop_interrupts(self, unraisable: "sys.UnraisableHookArgs") -> None:
        """A Ctrl-C that landed in a callback is not an error to print: `pressed` keeps it."""
        if unraisable.exc_type is not None and issubclass(unraisable.exc_type, KeyboardInterrupt):
            return
        self._unraisable(unraisable)

    def __exit__(self, *exc: object) -> None:
        if self._previous is None:
            return
        sys.unraisablehook = self._unraisable
        if self.pressed:
            # Ctrl-C was pressed and the session is closed: the process is on its way out (exit 130).
            # Ignore SIGINT from here on: a Python handler, ours or the restored default, is reset to
            # SIG_DFL while the interpreter finalizes, and a second Ctrl-C landing then killed the
            # process by SIGINT instead of exit 130 (seen in CI); SIG_IGN is left alone there.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        else:
            signal.signal(signal.SIGINT, self._previous)

    def defer(self) -> None:
        self._deferred = True

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if not self._deferred:
            # Remembered too: a KeyboardInterrupt raised inside an interpreter callback (an import's
            # module-lock weakref callback, a __del__) is dropped as "unraisable", and the run went on
            # loading and answered in full (seen in CI); the answer then does not start (run_main).
            self.pressed = True
            raise KeyboardInterrupt
        if self.pressed:
            os.write(2, b"\n[edgespec] interrupted twice: exiting now\n")
            os._exit(130)
        self.pressed = True
        os.write(2, b"\n[edgespec] stopping after the current step (Ctrl-C again to quit at once)\n")


def choose_shape(args: argparse.Namespace, tree_shape: type) -> object | None:
    """A fixed TreeShape when any tree option was given, else None (the planner sizes each tree)."""
    if args.chain:
        return tree_shape.chain(args.chain)
    given = {k: v for k, v in (("budget", args.budget), ("max_depth", args.depth), ("branching", args.branch),
                                 ("width", args.width)) if v is not None}
    return tree_shape(**given) if given else None
