#!/usr/bin/env python3
"""What one verify step costs beyond the verifier's compute: a RemoteVerifier against a real verifier
process on loopback, next to a bare gRPC bidi-stream echo on the same machine in the same run.

    .venv/bin/python tools/bench_roundtrip.py [--model test] [--steps 400] [--verifier-args="--backend torch"]

Per step (1-node trees, greedy; medians after 30 warm-up steps), in ms:
- echo: a bare grpcio stream-stream echo of a 40-byte message (the transport's floor here), and the
  same echo whose handler first sleeps as long as the verifier's median compute (a stream that
  idles between messages wakes up slower: that part is gRPC's and the machine's, not edgespec's);
- tcp echo: both again over a plain loopback socket, which splits that idle cost into the
  machine's (waking a sleeping thread) and gRPC's (its poller and callback threads wake in turn);
- link: RemoteVerifier.verify wall time minus the server's reported compute and queue time, split into
  the client's own Python (wall minus its round trip) and the rest (transport, the server's request
  thread: parsing, checks, the compute lock, metrics, the reply);
- batch worker: what the service's batch worker (verifier/torch/batching.py, the torch backend's
  path) adds to a lone session's request beyond its compute, with a compute of `--worker-compute-ms`
  (default 1.5: a GPU step) spent busy, in this process.
"""
from __future__ import annotations

import argparse
import json
import queue
import shlex
import socket
import statistics
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import grpc  # noqa: E402
import numpy as np  # noqa: E402

from bench_batch_worker import batch_worker_ms  # noqa: E402 - the batch worker's own cost, beside the link's
from edgespec.common import modelstore  # noqa: E402
from edgespec.common.sampling import SamplingParams  # noqa: E402
from edgespec.common.tree import TokenTree  # noqa: E402
from edgespec.edge import link as edge_link  # noqa: E402
from edgespec.runtime.llama import LlamaModel  # noqa: E402
from grpc_helpers import ServerProcess  # noqa: E402 - the tests' verifier process runner


def echo_ms(steps: int, pause_s: float = 0.0) -> float:
    """Median round trip of one message on a bare grpcio bidi stream (loopback, same process), less
    `pause_s`: the handler sleeps that long before it answers, as a verifier computes."""
    def handler(requests, context):  # noqa: ANN001, ANN202
        for request in requests:
            if pause_s:
                time.sleep(pause_s)
            yield request
    server = grpc.server(futures.ThreadPoolExecutor(4))
    rpc = grpc.stream_stream_rpc_method_handler(handler, request_deserializer=bytes, response_serializer=bytes)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("echo.Echo", {"Stream": rpc}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    requests: queue.Queue = queue.Queue()

    def feed():  # noqa: ANN202
        while (item := requests.get()) is not None:
            yield item
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.stream_stream("/echo.Echo/Stream", request_serializer=bytes, response_deserializer=bytes)(feed())
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            requests.put(b"x" * 40)
            next(call)
            times.append(time.perf_counter() - t - pause_s)
        requests.put(None)
    server.stop(0)
    return 1000 * statistics.median(times[30:])


def tcp_echo_ms(steps: int, pause_s: float = 0.0) -> float:
    """The same echo over a plain loopback TCP socket (TCP_NODELAY, a server thread that sleeps
    `pause_s` before it answers): what waking an idle thread costs on this machine without gRPC."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while data := conn.recv(64):
            if pause_s:
                time.sleep(pause_s)
            conn.sendall(data)
        conn.close()
    server = threading.Thread(target=serve, daemon=True)
    server.start()
    client = socket.create_connection(listener.getsockname())
    client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        client.sendall(b"x" * 40)
        client.recv(64)
        times.append(time.perf_counter() - t - pause_s)
    client.close()
    server.join(5)
    listener.close()
    return 1000 * statistics.median(times[30:])


def link_ms(model: str, steps: int, verifier_args: list[str]) -> dict:
    round_trips: list[tuple[float, object]] = []
    plain = edge_link.Link._roundtrip

    def timed(self, message, deadline, *expected):  # noqa: ANN001, ANN202
        t = time.perf_counter()
        reply = plain(self, message, deadline, *expected)
        round_trips.append((time.perf_counter() - t, reply))
        return reply
    edge_link.Link._roundtrip = timed
    vocab = LlamaModel(modelstore.resolve(model, progress=False), vocab_only=True)
    prompt = vocab.chat_tokens([{"role": "user", "content": "Say something about rivers."}])
    server = ServerProcess(model, *verifier_args)
    rows = []
    try:
        verifier = edge_link.RemoteVerifier(server.address, tokenizer_hash=server.info().tokenizer_hash)
        verifier.sync(prompt)
        for step in range(steps):
            tree = TokenTree(tokens=np.array([verifier.committed[-1]]), parents=np.array([-1]))
            round_trips.clear()
            t = time.perf_counter()
            verifier.verify(tree, SamplingParams(), step)
            wall = time.perf_counter() - t
            rt, reply = round_trips[-1]
            v = reply.verified
            rows.append((wall - rt, rt - (v.compute_ms + v.queue_ms) / 1000, v.compute_ms / 1000))
            if len(verifier.committed) > 400:
                verifier.sync(prompt)
        verifier.close()
    finally:
        edge_link.Link._roundtrip = plain
        server.stop()
        vocab.close()
    rows = rows[30:]
    med = [1000 * statistics.median(r[i] for r in rows) for i in range(3)]
    return {"client_python_ms": med[0], "transport_and_server_ms": med[1], "link_overhead_ms": med[0] + med[1],
            "server_compute_ms": med[2]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="test", help="the verifier's target (default: SmolLM2, fast steps)")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--verifier-args", default="", help="more `edgespec verifier serve` arguments, e.g. "
                    "'--backend torch' (its batch worker's path)")
    ap.add_argument("--worker-compute-ms", type=float, default=1.5)
    args = ap.parse_args()
    worker = batch_worker_ms(args.steps, args.worker_compute_ms / 1000)
    link = link_ms(args.model, args.steps, shlex.split(args.verifier_args))
    pause = link["server_compute_ms"] / 1000
    out = {"echo_ms": echo_ms(args.steps), **link,
           "echo_after_compute_pause_ms": echo_ms(min(args.steps, 300), pause),
           "tcp_echo_ms": tcp_echo_ms(args.steps), "tcp_echo_after_compute_pause_ms": tcp_echo_ms(min(args.steps, 300), pause),
           "batch_worker_ms": worker}
    print(json.dumps({k: round(v, 3) for k, v in out.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
