"""`edgespec verifier`: run the bundled verifier service, or ask one what it serves.

  edgespec verifier serve [--model NAME|PATH] [--host H] [--port P] [--token T] [--tls-cert C --tls-key K]
                          [--backend llama|torch] [--device cpu|cuda] [--dtype float32|bfloat16]
                          [--prefill-chunk N] [--compact-threshold F]     # torch backend
  edgespec verifier info ADDRESS [--token T] [--tls | --tls-ca FILE]
  edgespec verifier info H1:P,H2:P | fleet:NAME:PORT    # a fleet: every replica and totals

`serve` prints one machine-readable line to stdout once it accepts connections,

    edgespec-verifier listening on HOST:PORT

(the real port when --port 0 picked a free one), and shuts down cleanly on SIGTERM or SIGINT.
The bearer token comes from --token or the environment variable EDGESPEC_TOKEN (prefer the
environment: command lines are visible to other users); without one, no authentication is asked.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading

from edgespec.cli import CliError

READY_PREFIX = "edgespec-verifier listening on "
log = logging.getLogger("edgespec.verifier")


def cmd_serve(args: argparse.Namespace) -> int:
    from edgespec.common import modelstore
    from edgespec.verifier.factory import create_backend
    from edgespec.verifier.server import VerifierServer

    token = args.token or os.environ.get("EDGESPEC_TOKEN") or None
    if (args.tls_cert is None) != (args.tls_key is None):
        raise CliError("--tls-cert and --tls-key go together")
    model = "target" if args.model == "default" else args.model
    path = modelstore.resolve(model, fetch_missing=False, progress=False)
    if args.backend != "torch" and (args.device or args.dtype):
        raise CliError("--device and --dtype apply to --backend torch only (llama.cpp: --n-gpu-layers)")
    if args.backend != "torch" and (args.prefill_chunk is not None or args.compact_threshold is not None
                                    or args.no_warmup):
        raise CliError("--prefill-chunk, --compact-threshold and --no-warmup apply to --backend torch only")
    try:
        backend = create_backend(args.backend, path, n_ctx=args.n_ctx, max_nodes=args.max_nodes,
                                 max_depth=args.max_depth, threads=args.threads, n_gpu_layers=args.n_gpu_layers,
                                 device=args.device or "cpu", dtype=args.dtype, max_sessions=args.max_sessions,
                                 prefill_chunk=args.prefill_chunk, compact_threshold=args.compact_threshold,
                                 warmup=False if args.no_warmup else None)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    step_log = _step_log(args, backend, path) if args.log_dir else None
    try:
        server = VerifierServer(
            backend, host=args.host, port=args.port, token=token, tls_cert=args.tls_cert, tls_key=args.tls_key,
            max_sessions=args.max_sessions, max_streams=args.max_streams,
            kv_budget_bytes=int(args.kv_budget_mb * 2**20) if args.kv_budget_mb else None,
            idle_timeout_s=args.idle_timeout_s, prefix_cache=not args.no_prefix_cache,
            metrics=args.metrics_port is not None, keepalive_s=args.keepalive_s,
            max_streams_per_client=args.max_streams_per_client, client_rate=args.client_rate)
        metrics_at = None
        if args.metrics_port is not None:
            metrics_at = server.serve_metrics(args.metrics_host or args.host, args.metrics_port)
    except ImportError as exc:
        backend.close()
        raise CliError(f"--metrics-port needs prometheus-client (pip install 'edgespec[verifier]'): {exc}") from None
    except (OSError, ValueError) as exc:   # a busy port, unusable TLS files: fix the options (exit 2)
        backend.close()
        raise CliError(str(exc)) from None
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server.start()
    info = backend.info
    print(f"{READY_PREFIX}{server.address}", flush=True)
    print(f"edgespec verifier: serving {info.model_id} ({path}) on {info.backend}, n_ctx {info.n_ctx}, "
          f"{server.registry.max_live} KV slots, tls {'on' if server.tls else 'off'}, "
          f"auth {'on' if token else 'OFF'}"
          + (f", metrics on http://{metrics_at}/metrics" if metrics_at else "")
          + (f", {warm['buckets']} step graphs warmed up in {warm['seconds']} s" if (warm := info.extra.get("warmup"))
             else ""), file=sys.stderr, flush=True)
    from edgespec.serve.notify import Notifier

    notifier = Notifier.from_env()   # under systemd (Type=notify): READY now, watchdog pings while serving
    notifier.ready(f"serving {info.model_id} on {server.address}")
    notifier.start_watchdog(lambda: None)
    parent = os.getppid()
    while not stop.wait(0.5):
        if args.exit_with_parent and os.getppid() != parent:
            log.warning("parent process %d is gone: shutting down", parent)
            break
    notifier.stopping()
    notifier.close()
    server.stop(grace_s=2.0)
    if step_log is not None:
        step_log.close()
    backend.close()
    return 0


def _step_log(args: argparse.Namespace, backend, path):  # noqa: ANN001, ANN202
    """The opt-in step log (verifier/steplog.py), attached to a backend that can record steps."""
    from edgespec.verifier.steplog import StepLog

    if not hasattr(backend, "step_log"):
        backend.close()
        raise CliError(f"--log-dir: the {args.backend} backend does not record steps (use --backend llama)")
    info = backend.info
    try:
        backend.step_log = StepLog(args.log_dir, top_k=args.log_top_k, meta={
            "model_id": info.model_id, "tokenizer_hash": info.tokenizer_hash, "vocab_size": info.vocab_size,
            "model_file": os.path.basename(str(path))})
    except (OSError, ValueError) as exc:
        backend.close()
        raise CliError(f"--log-dir {args.log_dir}: {exc}") from None
    return backend.step_log


def cmd_info(args: argparse.Namespace) -> int:
    import grpc

    from edgespec.common import wire
    from edgespec.edge.link import make_channel
    from edgespec.v1 import edgespec_pb2 as pb
    from edgespec.v1 import edgespec_pb2_grpc as pb_grpc

    token = args.token or os.environ.get("EDGESPEC_TOKEN") or None
    tls = args.tls_ca or (True if args.tls else None)
    from edgespec.edge.fleet import Fleet, is_fleet_spec

    if is_fleet_spec(args.address):  # a fleet: every replica's Info and the totals (edge/fleet.py)
        print(json.dumps(Fleet(args.address, token=token, tls=tls).metrics(args.timeout_s), indent=2))
        return 0
    channel = make_channel(args.address, tls=tls)
    try:
        md = [(wire.AUTH_KEY, f"Bearer {token}")] if token else []
        reply = pb_grpc.VerifierStub(channel).Info(pb.InfoRequest(), metadata=md, timeout=args.timeout_s)
    except grpc.RpcError as exc:
        raise wire.error_from_status(exc.code(), exc.details()) from None
    finally:
        channel.close()
    print(json.dumps(info_dict(reply), indent=2))
    return 0


def info_dict(reply) -> dict:  # noqa: ANN001
    """InfoReply as JSON: every field, zero counters included, 64-bit counters as numbers (protobuf's
    JSON mapping drops zero values and writes 64-bit integers as strings)."""
    from google.protobuf import descriptor, json_format

    d = json_format.MessageToDict(reply, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    wide = (descriptor.FieldDescriptor.TYPE_INT64, descriptor.FieldDescriptor.TYPE_UINT64,
            descriptor.FieldDescriptor.TYPE_SINT64, descriptor.FieldDescriptor.TYPE_FIXED64,
            descriptor.FieldDescriptor.TYPE_SFIXED64)
    for field in reply.DESCRIPTOR.fields:
        if field.type in wide and field.name in d and not isinstance(d[field.name], list):
            d[field.name] = int(d[field.name])
    return d


def _prefill_chunk(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of tokens") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"a chunk holds at least 1 token, got {n}")
    return n


def _fraction(text: str) -> float:
    try:
        f = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= f <= 1.0:   # NaN fails too
        raise argparse.ArgumentTypeError(f"the fragmentation index F is in [0, 1], got {text}")
    return f


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("verifier", help="run or query the verifier service",
                                   description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="verifier_command", required=True)

    p = sub.add_parser("serve", help="serve the target model over gRPC")
    p.add_argument("--model", default="default",
                   help="manifest name, role alias or GGUF path; default: the manifest's target")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 for all)")
    p.add_argument("--port", type=int, default=50051, help="port (default 50051; 0 picks a free one and prints it)")
    p.add_argument("--token", default=None, help="bearer token clients must send (default: $EDGESPEC_TOKEN)")
    p.add_argument("--tls-cert", default=None, help="PEM certificate chain (enables TLS)")
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    p.add_argument("--max-sessions", type=int, default=4, help="KV slots: sessions held in memory at once (LRU)")
    p.add_argument("--max-streams", type=int, default=64, help="open conversations accepted at once")
    p.add_argument("--max-streams-per-client", type=int, default=0,
                   help="open conversations one client (address) may hold (default 0: no per-client limit)")
    p.add_argument("--client-rate", type=float, default=0.0,
                   help="Sync/Verify requests per second one client (address) may send (default 0: unlimited)")
    p.add_argument("--kv-budget-mb", type=float, default=None, help="cap the KV slots by estimated memory")
    p.add_argument("--n-ctx", type=int, default=4096, help="context window per session (default 4096)")
    p.add_argument("--max-nodes", type=int, default=128, help="largest tree accepted, root included")
    p.add_argument("--max-depth", type=int, default=32, help="deepest tree accepted")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics on http://HOST:PORT/metrics (0: a free port)")
    p.add_argument("--metrics-host", default=None, help="address for the metrics endpoint (default: --host)")
    p.add_argument("--keepalive-s", type=float, default=20.0,
                   help="ping clients this often; a stream whose client does not answer within as long "
                        "again is closed and its slots freed (0: never ping)")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="free the KV of a session when its stream ends instead of keeping it for the "
                        "next session with the same prefix (e.g. an edge re-attaching)")
    p.add_argument("--idle-timeout-s", type=float, default=600.0,
                   help="free the KV of sessions idle this long (0: never)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads of llama.cpp or torch (default 1)")
    p.add_argument("--n-gpu-layers", type=int, default=0,
                   help="llama.cpp layers offloaded to the GPU (-1: all; needs a GPU build of llama.cpp, see README)")
    p.add_argument("--backend", choices=("llama", "torch"), default="llama",
                   help="llama: llama.cpp (default); torch: the torch engine over a paged KV cache "
                        "(needs edgespec[torch]; float32 on the CPU is the exact reference)")
    p.add_argument("--device", default=None, help="torch backend: cpu (default), cuda or cuda:N")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="torch backend: weight and KV dtype (default float32 on cpu, bfloat16 on cuda)")
    p.add_argument("--prefill-chunk", type=_prefill_chunk, default=None, metavar="N",
                   help="torch backend: a Sync prefills N tokens at a time, letting other sessions' verify "
                        "batches run between chunks (default 256)")
    p.add_argument("--compact-threshold", type=_fraction, default=None, metavar="F",
                   help="torch backend: compact the KV cache between steps when its fragmentation index "
                        "F = 1 - largest free run / free blocks is above this (0..1; 1: never; default 0.5)")
    p.add_argument("--no-warmup", action="store_true",
                   help="torch backend on CUDA: do not capture the step graphs of every batch and tree size at "
                        "start (each is then captured when first needed, holding the GPU 0.1 s or more)")
    p.add_argument("--log-dir", default=None, metavar="DIR",
                   help="record every verified step (context, accepted path, the target's top-k at the deciding "
                        "positions) in DIR, for tools/distill.py (llama backend)")
    p.add_argument("--log-top-k", type=int, default=32, help="target tokens kept per deciding position (default 32)")
    p.add_argument("--exit-with-parent", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("info", help="print what a verifier serves (model, limits, counters)")
    p.add_argument("address", help="HOST:PORT")
    p.add_argument("--token", default=None, help="bearer token (default: $EDGESPEC_TOKEN)")
    p.add_argument("--tls", action="store_true", help="use TLS with the system's root certificates")
    p.add_argument("--tls-ca", default=None, help="use TLS, trusting this PEM CA file")
    p.add_argument("--timeout-s", type=float, default=10.0)
    p.set_defaults(func=cmd_info)
    return parser
