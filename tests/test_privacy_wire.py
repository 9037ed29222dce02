"""Proof on the wire (issue 11): with PII masking on, no personal value leaves the device.

A real verifier process on loopback, an EdgeSession with privacy="presidio" (strict) and PII-laden
prompts in English and Chinese. Two independent recorders of what the edge sends:
- a gRPC client interceptor on every channel the edge opens (serialised request messages), whose
  uplink token ids are decoded with the tokenizer: the committed context of each Sync, and every
  tree path appended to the context it grows from (the context follows the downlink answers);
- tcpdump on the loopback interface, filtered to the verifier's port: the raw TCP payload.
No raw value may appear in any of it: not as text after decoding, not as the UTF-8 bytes, not as the
int32 bytes of any of its tokenisations. And the restored answers hold the real values wherever the
model wrote a placeholder.
"""
from __future__ import annotations

import shutil
import signal
import struct
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from edgespec.common import wire
from edgespec.edge import health, link
from edgespec.edge.drafting import TreeShape
from edgespec.edge.session import EdgeSession
from edgespec.v1 import edgespec_pb2 as pb
from tests.grpc_helpers import ServerProcess

TOKEN = "wire-test-token"

# (prompt, the raw values in it). Each prompt asks the model to repeat, so that placeholders come back.
PROMPTS: list[tuple[str, list[str]]] = [
    ("Repeat exactly: Dear John Smith, call me at (415) 555-0132 or mail john.smith@example.com.",
     ["John Smith", "(415) 555-0132", "john.smith@example.com"]),
    ("Repeat exactly: ship the order to 221 Baker Street, card 4111 1111 1111 1111, IBAN DE89 3704 0044 0532 0130 00.",
     ["221 Baker Street", "4111 1111 1111 1111", "DE89 3704 0044 0532 0130 00"]),
    ("Repeat exactly: the server 192.168.10.24 uses key sk-proj-abcDEF1234567890ghijKLMN and AKIAIOSFODNN7EXAMPLE.",
     ["192.168.10.24", "sk-proj-abcDEF1234567890ghijKLMN", "AKIAIOSFODNN7EXAMPLE"]),
    ("请原样重复：我叫张伟，手机13912345678，邮箱zhang.wei@example.cn。",
     ["张伟", "13912345678", "zhang.wei@example.cn"]),
    ("请原样重复：身份证320106199003071234，住在上海市浦东新区世纪大道100号，联系李娜。",
     ["320106199003071234", "上海市浦东新区世纪大道100号", "李娜"]),
    ("Repeat exactly: SSN 123-45-6789, GitHub token ghp_abcdefghijklmnopqrstuvwxyz0123456789, v6 2001:db8::8a2e:370:7334.",
     ["123-45-6789", "ghp_abcdefghijklmnopqrstuvwxyz0123456789", "2001:db8::8a2e:370:7334"]),
]
ALL_VALUES = [v for _, values in PROMPTS for v in values]


@dataclass
class Recorder(grpc.UnaryUnaryClientInterceptor, grpc.StreamStreamClientInterceptor,
               grpc.UnaryStreamClientInterceptor, grpc.StreamUnaryClientInterceptor):
    """Every request message the edge sends (and every Session answer), in order."""

    sent: list = field(default_factory=list)       # (method, message)
    received: list = field(default_factory=list)   # VerifierMessage, Session streams only
    lock: threading.Lock = field(default_factory=threading.Lock)

    def _tap(self, method: str, requests):  # noqa: ANN001, ANN202
        for message in requests:
            with self.lock:
                self.sent.append((method, message))
            yield message

    def intercept_unary_unary(self, continuation, details, request):  # noqa: ANN001, ANN201
        with self.lock:
            self.sent.append((details.method, request))
        return continuation(details, request)

    def intercept_unary_stream(self, continuation, details, request):  # noqa: ANN001, ANN201
        with self.lock:
            self.sent.append((details.method, request))
        return continuation(details, request)

    def intercept_stream_unary(self, continuation, details, requests):  # noqa: ANN001, ANN201
        return continuation(details, self._tap(details.method, requests))

    def intercept_stream_stream(self, continuation, details, requests):  # noqa: ANN001, ANN201
        answers = continuation(details, self._tap(details.method, requests))
        return _TappedCall(answers, self)


class _TappedCall:
    """The stream-stream call object with its iteration recorded (the rest passes through)."""

    def __init__(self, call, recorder: Recorder) -> None:  # noqa: ANN001
        self._call, self._recorder = call, recorder

    def __iter__(self):  # noqa: ANN204
        return self

    def __next__(self):  # noqa: ANN204
        answer = next(self._call)
        if isinstance(answer, pb.VerifierMessage):
            with self._recorder.lock:
                self._recorder.received.append(answer)
        return answer

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self._call, name)


class Capture:
    """tcpdump on loopback for one TCP port, written to a pcap file (started and stopped by us)."""

    def __init__(self, port: int, path: Path) -> None:
        self.port, self.path = port, path
        self.proc = subprocess.Popen(["tcpdump", "-i", "lo", "-U", "-s", "0", "-n", "-w", str(path),
                                      f"tcp port {port}"], stderr=subprocess.PIPE, text=True)
        line = self.proc.stderr.readline()   # "listening on lo, ..." once the capture runs
        if "listening" not in line:
            raise RuntimeError(f"tcpdump did not start: {line}")

    def stop(self) -> None:
        time.sleep(0.5)   # let the last segments reach the file (-U flushes per packet)
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(timeout=10)

    def uplink_payload(self) -> bytes:
        """TCP payload of every captured segment sent *to* the port, in capture order."""
        data = self.path.read_bytes()
        magic = struct.unpack("<I", data[:4])[0]
        endian = "<" if magic in (0xA1B2C3D4, 0xA1B23C4D) else ">"
        linktype = struct.unpack(endian + "I", data[20:24])[0]
        offset, out = 24, []
        while offset + 16 <= len(data):
            incl = struct.unpack(endian + "I", data[offset + 8:offset + 12])[0]
            frame = data[offset + 16:offset + 16 + incl]
            offset += 16 + incl
            ip = frame[14:] if linktype == 1 else frame[16:] if linktype == 113 else frame[4:]
            if not ip:
                continue
            version = ip[0] >> 4
            if version == 4:
                ihl, proto, ip_payload = (ip[0] & 0x0F) * 4, ip[9], None
                ip_payload = ip[ihl:struct.unpack(">H", ip[2:4])[0]]
            elif version == 6:
                proto, ip_payload = ip[6], ip[40:40 + struct.unpack(">H", ip[4:6])[0]]
            else:
                continue
            if proto != 6 or len(ip_payload) < 20:
                continue
            dst_port = struct.unpack(">H", ip_payload[2:4])[0]
            tcp_header = (ip_payload[12] >> 4) * 4
            if dst_port == self.port:
                out.append(ip_payload[tcp_header:])
        return b"".join(out)


def tokenisations(model, value: str) -> list[list[int]]:  # noqa: ANN001
    """The value's token ids as it may appear in text: alone, after a space, after CJK/punctuation."""
    variants = [model.tokenize(prefix + value, add_special=False, parse_special=False) for prefix in ("", " ")]
    for prefix in ("：", "x"):
        head = model.tokenize(prefix, add_special=False, parse_special=False)
        both = model.tokenize(prefix + value, add_special=False, parse_special=False)
        if both[:len(head)] == head:
            variants.append(both[len(head):])
    return [v for v in variants if v]


def contains(seq: list[int], sub: list[int]) -> bool:
    n = len(sub)
    return any(seq[i:i + n] == sub for i in range(len(seq) - n + 1))


@pytest.fixture(scope="module")
def verifier(smol_path):
    server = ServerProcess(smol_path, "--n-ctx", "2048", "--threads", "1", token=TOKEN)
    yield server
    server.stop()


@pytest.mark.skipif(shutil.which("tcpdump") is None, reason="tcpdump is installed by tools/setup.sh (needs root)")
def test_nothing_personal_on_the_wire(verifier, smol_path, smol_model, tmp_path, monkeypatch) -> None:
    recorder = Recorder()
    real_make_channel = link.make_channel

    def recorded_channel(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        return grpc.intercept_channel(real_make_channel(*args, **kwargs), recorder)

    monkeypatch.setattr(link, "make_channel", recorded_channel)
    monkeypatch.setattr(health, "make_channel", recorded_channel)
    capture = Capture(verifier.port, tmp_path / "uplink.pcap")
    answers, raw_answers = [], []
    try:
        with EdgeSession(smol_path, smol_path, verifier=verifier.address, token=TOKEN, privacy="presidio",
                         strict=True, fallback=False, tree=TreeShape(budget=6, max_depth=4, width=2),
                         n_ctx=2048, draft_threads=1) as session:
            for prompt, _ in PROMPTS:
                n_received, n_tokens = len(recorder.received), session.stats.tokens
                answers.append(session.chat(prompt, max_tokens=48))
                # The answer as the model wrote it (masked): the downlink's committed tokens, cut where
                # the decoder stopped (the last step may commit beyond max_tokens).
                committed = [t for m in recorder.received[n_received:] if m.HasField("verified")
                             for t in wire.tokens_from_bytes(m.verified.tokens)][:session.stats.tokens - n_tokens]
                raw_answers.append(smol_model.detokenize([t for t in committed if not smol_model.is_end_of_generation(t)]))
            vault = session.privacy.vault
    finally:
        capture.stop()

    # 1. The interceptor: decode every uplink token stream, in context.
    assert any(m.HasField("verify") for _, m in recorder.sent if isinstance(m, pb.EdgeMessage))
    context: list[int] = []
    answers_by_step = iter(m for m in recorder.received if m.HasField("verified"))
    uplink_texts, uplink_arrays = [], []
    for method, message in recorder.sent:
        raw = message.SerializeToString()
        for value in ALL_VALUES:
            assert value.encode() not in raw, (method, value)
        if not isinstance(message, pb.EdgeMessage):
            continue
        if message.HasField("sync"):
            context = wire.tokens_from_bytes(message.sync.tokens)
            uplink_arrays.append(context)
            uplink_texts.append(smol_model.detokenize(context))
        elif message.HasField("verify"):
            tree = wire.tree_from_proto(message.verify.tree)
            tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
            uplink_arrays.append(tokens)
            for leaf in set(range(len(tokens))) - set(parents):
                path, node = [], leaf
                while node > 0:
                    path.append(tokens[node])
                    node = parents[node]
                uplink_texts.append(smol_model.detokenize(context + path[::-1]))
            context = context + wire.tokens_from_bytes(next(answers_by_step).verified.tokens)
    assert uplink_texts and any("[PHONE_" in t for t in uplink_texts) and any("[PERSON_" in t for t in uplink_texts)
    for value in ALL_VALUES:
        squeezed = value.replace(" ", "").replace("-", "")
        for text in uplink_texts:
            assert value not in text and squeezed not in text.replace(" ", "").replace("-", ""), value
        for variant in tokenisations(smol_model, value):
            assert not any(contains(arr, variant) for arr in uplink_arrays), value

    # 2. The packet capture, independently: what really crossed the loopback port.
    payload = capture.uplink_payload()
    first_sync = next(m.sync.tokens for _, m in recorder.sent if isinstance(m, pb.EdgeMessage) and m.HasField("sync"))
    assert first_sync[:64] in payload      # the capture did see the edge's messages
    for value in ALL_VALUES:
        assert value.encode() not in payload, value
        for variant in tokenisations(smol_model, value):
            assert wire.tokens_to_bytes(variant) not in payload, value

    # 3. Restoration: every placeholder the model wrote comes back as its value, locally.
    used = 0
    for raw, answer in zip(raw_answers, answers):
        assert answer == vault.restore(raw)
        for placeholder in set(placeholders_in(raw)):
            value = vault.value(placeholder)
            if value is not None:
                used += 1
                assert placeholder not in answer and value in answer
    assert used >= 3, f"the model echoed too few placeholders to check restoration: {raw_answers}"


def placeholders_in(text: str) -> list[str]:
    from edgespec.edge.privacy.vault import PLACEHOLDER
    return [m.group(0) for m in PLACEHOLDER.finditer(text)]
