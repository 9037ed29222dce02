"""`edgespec serve` through the official openai client against a real daemon process.

One daemon (SmolLM2 as draft and target, local verification, a fixed chain: greedy output is
deterministic) is shared by the module; a second one with an API key and no queue checks 401 and 429.
"""
from __future__ import annotations

import json
import threading

try:
    import httpx2 as httpx   # what the installed openai client uses
except ImportError:  # openai 1.x
    import httpx
import openai
import pytest

from serve_helpers import DaemonProcess

PROMPT = [{"role": "user", "content": "List three colours, one per line."}]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    # a fixed chain, not the planner: the same batch shapes every run, so greedy answers compare exactly
    d = DaemonProcess(config='[edge]\ndraft = "test"\ntarget = "test"\nlocal = true\nchain = 3\n'
                             '[serve]\nmodel_name = "edge-test"\n',
                      tmp=tmp_path_factory.mktemp("serve"), env={"EDGESPEC_SERVE_MAX_TOKENS": "12"})
    yield d
    assert d.stop() == 0, "".join(d.stderr)


@pytest.fixture(scope="module")
def client(daemon):
    return daemon.client()


@pytest.fixture(scope="module")
def greedy_text(client):
    r = client.chat.completions.create(model="edge-test", messages=PROMPT, max_tokens=16, temperature=0)
    return r.choices[0].message.content


def test_models_and_health(daemon, client):
    assert [m.id for m in client.models.list().data] == ["edge-test"]
    h = httpx.get(daemon.url + "/health", timeout=30)
    assert h.status_code == 200 and h.json()["status"] == "ok"


def test_completion_max_tokens_and_usage(client, greedy_text):
    r = client.chat.completions.create(model="edge-test", messages=PROMPT, max_tokens=16)
    assert r.choices[0].message.content == greedy_text and greedy_text
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.prompt_tokens > 5 and 0 < r.usage.completion_tokens <= 16
    short = client.chat.completions.create(model="edge-test", messages=PROMPT, max_tokens=3)
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 3
    assert greedy_text.startswith(short.choices[0].message.content)
    # no max_tokens: the configured default (EDGESPEC_SERVE_MAX_TOKENS=12 beats the file's default)
    default = client.chat.completions.create(model="edge-test", messages=PROMPT)
    assert default.usage.completion_tokens <= 12


def test_streaming_equals_non_streaming(client, greedy_text):
    stream = client.chat.completions.create(model="edge-test", messages=PROMPT, max_tokens=16, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    content = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content) > 1, "the answer must arrive in several chunks"
    assert "".join(content) == greedy_text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes in (["length"], ["stop"])
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


@pytest.mark.parametrize("stream", [False, True])
def test_stop_sequence(client, greedy_text, stream):
    stop = greedy_text.strip()[3:6]     # a few characters from inside the greedy answer
    assert stop and stop in greedy_text
    expected = greedy_text[:greedy_text.index(stop)]
    r = client.chat.completions.create(model="edge-test", messages=PROMPT, max_tokens=16, stop=[stop, "@@never@@"],
                                       stream=stream)
    if stream:
        chunks = list(r)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finish == ["stop"]
    else:
        text, finish = r.choices[0].message.content, r.choices[0].finish_reason
        assert finish == "stop"
    assert text == expected and stop not in text


@pytest.mark.parametrize("kwargs, error, param", [
    (dict(model="gpt-4"), openai.NotFoundError, "model"),
    (dict(messages=[]), openai.BadRequestError, "messages"),
    (dict(messages=[{"role": "wizard", "content": "hi"}]), openai.BadRequestError, "messages[0].role"),
    (dict(messages=[{"role": "user", "content": "   "}]), openai.BadRequestError, "messages"),
    (dict(temperature=5), openai.BadRequestError, "temperature"),
    (dict(max_tokens=0), openai.BadRequestError, "max_tokens"),
    (dict(max_tokens=10**6), openai.BadRequestError, "max_tokens"),
    (dict(n=3), openai.BadRequestError, "n"),
    (dict(temperature=0.7, top_p=0), openai.BadRequestError, "top_p"),
    (dict(seed="x"), openai.BadRequestError, "seed"),
    (dict(stop=["a", "b", "c", "d", "e"]), openai.BadRequestError, "stop"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]), openai.BadRequestError, "tools"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nosuch"}}}),
     openai.BadRequestError, "response_format"),
])
def test_bad_requests_get_openai_errors(client, kwargs, error, param):
    args = dict(model="edge-test", messages=PROMPT, max_tokens=4) | kwargs
    with pytest.raises(error) as info:
        client.chat.completions.create(**args)
    body = info.value.body
    assert body["param"] == param and body["message"] and body["type"]


def test_json_schema_response_format(client):
    """OpenAI's structured outputs: the answer is JSON valid against the schema (common/constraints.py)."""
    import jsonschema

    schema = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 16},
                                               "rgb": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                                 "maximum": 255},
                                                       "minItems": 3, "maxItems": 3}},
              "required": ["colour", "rgb"], "additionalProperties": False}
    r = client.chat.completions.create(
        model="edge-test", max_tokens=64, messages=[{"role": "user", "content": "A colour and its RGB values, as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "colour", "schema": schema}})
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_sampled_answer(client):
    r = client.chat.completions.create(model="edge-test", messages=PROMPT, max_tokens=6, temperature=0.8,
                                       top_p=0.9, seed=7)
    assert r.choices[0].message.content and 0 < r.usage.completion_tokens <= 6


def test_malformed_bodies_and_paths(daemon, client):
    r = httpx.post(daemon.api + "/chat/completions", content=b"{not json", timeout=30)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(daemon.api + "/chat/completions", content=b"[1, 2]", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(daemon.api + "/completions", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    # a prompt longer than the context window: a clear 400, and the daemon keeps serving
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="edge-test", max_tokens=4,
                                       messages=[{"role": "user", "content": "word " * 5000}])
    assert info.value.body["code"] == "context_length_exceeded"
    assert client.chat.completions.create(model="edge-test", messages=PROMPT, max_tokens=2).choices[0].message.content


def test_concurrent_clients_get_their_own_answers(daemon):
    prompts = [[{"role": "user", "content": f"Say the number {i} in words."}] for i in range(4)]
    sequential = [daemon.client().chat.completions.create(model="edge-test", messages=p, max_tokens=8)
                  .choices[0].message.content for p in prompts]
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def ask(i: int) -> None:
        try:
            c = daemon.client()
            if i % 2:   # mix streaming and non-streaming clients
                s = c.chat.completions.create(model="edge-test", messages=prompts[i], max_tokens=8, stream=True)
                results[i] = "".join(ch.choices[0].delta.content or "" for ch in s if ch.choices)
            else:
                results[i] = c.chat.completions.create(model="edge-test", messages=prompts[i],
                                                       max_tokens=8).choices[0].message.content
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert [results[i] for i in range(4)] == sequential


def test_client_that_disconnects_mid_stream_does_not_block_others(daemon, client):
    with httpx.stream("POST", daemon.api + "/chat/completions", timeout=60,
                      json={"model": "edge-test", "messages": PROMPT, "max_tokens": 200, "stream": True}) as r:
        first = next(r.iter_lines())
        assert first.startswith("data: ") and json.loads(first[6:])["object"] == "chat.completion.chunk"
    # the abandoned stream stops after its current step, so this one is answered well before 200 tokens
    r = client.chat.completions.create(model="edge-test", messages=PROMPT, max_tokens=2)
    assert r.choices[0].message.content
    # and nothing leaks: nothing is counted as queued or running once both are over
    h = httpx.get(daemon.url + "/health", timeout=30).json()
    assert h["pending"] == 0, h
    metrics = httpx.get(daemon.url + "/metrics", timeout=30).text
    assert "edgespec_edge_requests_in_flight 0.0" in metrics and "edgespec_edge_queue_depth 0.0" in metrics


def test_metrics(daemon, client):
    client.chat.completions.create(model="edge-test", messages=PROMPT, max_tokens=4)
    text = httpx.get(daemon.url + "/metrics", timeout=30).text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    assert values["edgespec_edge_ready"] == 1
    assert values["edgespec_edge_completion_tokens_total"] >= 4
    assert values["edgespec_edge_target_steps_total"] >= 1
    assert values["edgespec_edge_tau"] >= 1
    assert values['edgespec_edge_requests_total{outcome="ok"}'] >= 1
    assert values['edgespec_edge_step_seconds_total{phase="verify"}'] > 0
    assert any(k.startswith("edgespec_edge_tree_shape_steps_total{") for k in values)


def test_api_key_and_full_queue(tmp_path):
    d = DaemonProcess("--draft", "test", "--target", "test", "--local", "--max-queue", "0",
                      env={"EDGESPEC_SERVE_API_KEY": "k3y"})
    try:
        with pytest.raises(openai.AuthenticationError):
            d.client(api_key="wrong").models.list()
        good = d.client(api_key="k3y")
        assert good.models.list().data[0].id == "edgespec"
        # one session, no queue: while a long answer runs, a second request is refused with 429
        with good.chat.completions.create(model="edgespec", messages=PROMPT, max_tokens=200, stream=True) as s:
            next(iter(s))
            with pytest.raises(openai.RateLimitError) as info:
                good.chat.completions.create(model="edgespec", messages=PROMPT, max_tokens=2)
            assert info.value.body["code"] == "queue_full"
    finally:
        assert d.stop() == 0, "".join(d.stderr)


def test_startup_errors_exit_2_without_traceback(tmp_path, daemon):
    import subprocess
    import sys

    def serve(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "edgespec", "serve", "--host", "127.0.0.1", *args],
                              capture_output=True, text=True, timeout=300)

    port = daemon.url.rsplit(":", 1)[1]
    busy = serve("--port", port, "--draft", "test", "--target", "test", "--local")
    assert busy.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in busy.stderr
    assert "port is in use" in busy.stderr and "Traceback" not in busy.stderr
    missing = serve("--port", "0", "--draft", str(tmp_path / "nope.gguf"), "--target", "test", "--local")
    assert missing.returncode == 2, missing.stderr
    assert "cannot load the models" in missing.stderr and "nope.gguf" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_pii_masking_counts_per_request_vault():
    """edge.privacy: entities are masked and counted (types only), and every request gets its own
    placeholder vault: two requests with different e-mail addresses count two, not 1 + 2."""
    d = DaemonProcess("--draft", "test", "--target", "test", "--local", "--privacy", "patterns")
    try:
        c = d.client()
        for address in ("ann.lee@example.com", "bob.stone@example.org"):
            r = c.chat.completions.create(model="edgespec", max_tokens=3,
                                          messages=[{"role": "user", "content": f"Write to {address} please."}])
            assert r.choices[0].message.content is not None
        text = httpx.get(d.url + "/metrics", timeout=30).text
        assert 'edgespec_edge_pii_entities_masked_total{entity="EMAIL"} 2.0' in text, \
            [line for line in text.splitlines() if "pii" in line]
        assert "example.com" not in text and "ann.lee" not in "".join(d.stderr)
    finally:
        assert d.stop() == 0, "".join(d.stderr)


def test_two_sessions_answer_in_parallel():
    """serve.sessions = 2: two model copies, each on its own thread, the same answers as one."""
    d = DaemonProcess("--draft", "test", "--target", "test", "--local", "--chain", "3", "--sessions", "2")
    try:
        assert httpx.get(d.url + "/health", timeout=30).json()["sessions"] == 2
        prompts = [[{"role": "user", "content": f"Name a fruit that is {c}."}] for c in ("red", "yellow")]
        expected = [d.client().chat.completions.create(model="edgespec", messages=p, max_tokens=6)
                    .choices[0].message.content for p in prompts]
        got: dict[int, str] = {}

        def ask(i: int) -> None:
            got[i] = d.client().chat.completions.create(model="edgespec", messages=prompts[i],
                                                        max_tokens=6).choices[0].message.content

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert [got.get(0), got.get(1)] == expected
    finally:
        assert d.stop() == 0, "".join(d.stderr)
