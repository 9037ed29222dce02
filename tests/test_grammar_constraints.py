"""Grammar constraints (common/constraints.py Grammar, compiled by llguidance): the answer must match
a JSON schema or a grammar, through the same token mask as banned phrases, in the draft and in the
verifier's acceptance. Speculative output is then the target's own constrained output: greedy equal
to constrained target-only greedy (table models and real llama.cpp models, the reference computed
with llguidance directly, token by token), sampled exactly the target's p renormalised over the
allowed tokens (chi-square through the real Drafter/Decoder pipeline, both acceptance rules)."""
from __future__ import annotations

import json

import grpc
import jsonschema
import llguidance
import numpy as np
import pytest

import logit_record
import lossless
from edgespec.common import wire
from edgespec.common.constraints import Grammar, GrammarVocab, TokenConstraint
from edgespec.common.errors import InvalidRequestError
from edgespec.common.sampling import AcceptanceRule, SamplingParams
from edgespec.common.tree import TokenTree
from edgespec.edge.drafting import TreeShape
from edgespec.runtime.llama import ContextConfig, LlamaModel, TreeContext
from edgespec.v1 import edgespec_pb2 as pb
from tests.test_constraints import SHAPES, make_decoder, masked_exact_distribution
from tests.test_sampling_pipeline import EMITTED, PROMPT, TARGET_TABLE, chi2_pvalue, logits_after

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "languages": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
    },
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
ASK = "Describe a software engineer named Alice as JSON with her name, age and programming languages."


# -- requests -----------------------------------------------------------------------------------
@pytest.mark.parametrize("response_format, words", [
    ({"type": "json_schema", "json_schema": {"schema": {"type": "nosuch"}}}, "invalid grammar: Invalid type: nosuch"),
    ({"type": "json_schema", "json_schema": {"schema": {"$ref": "#/definitions/missing"}}}, "does not exist"),
    ({"type": "json_schema", "json_schema": {"schema": "{not json"}}, "not valid JSON"),
    ({"type": "json_schema", "json_schema": {"schema": [1, 2]}}, "a JSON schema is an object"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "needs"),
    ({"type": "grammar", "grammar": "start: undefined_rule"}, "unknown name"),
    ({"type": "grammar", "grammar": "root ::= \"a\" missing"}, "Rule 'missing' not found"),
    ({"type": "regex", "regex": "(unclosed"}, "invalid grammar"),
    ({"type": "xml"}, "unsupported response_format"),
])
def test_a_bad_schema_or_grammar_is_a_clear_error(response_format, words) -> None:
    with pytest.raises(InvalidRequestError) as err:
        Grammar.from_response_format(response_format)
    assert words in str(err.value)


def test_response_formats() -> None:
    assert Grammar.from_response_format({"type": "text"}) is None
    assert Grammar.from_response_format(RESPONSE_FORMAT) == Grammar.json_schema(json.dumps(SCHEMA))
    gbnf = Grammar.from_response_format({"type": "grammar", "grammar": 'root ::= "yes" | "no"'})
    assert '"yes"' in gbnf.text and '"no"' in gbnf.text and "::=" not in gbnf.text
    with pytest.raises(InvalidRequestError, match="over"):
        Grammar.regex("a" * 70_000)


# -- the mask, on a vocabulary of six tokens ------------------------------------------------------
TABLE_TOKENS = [b"a", b"b", b"c", b"d", b"ab", b"\xff<|end|>"]
END = 5


def table_vocab() -> GrammarVocab:
    return GrammarVocab.from_token_bytes(TABLE_TOKENS, [END], lambda text: [TABLE_TOKENS.index(bytes([c])) for c in text
                                                                            if bytes([c]) in TABLE_TOKENS])


# Pairs "ab", "ac", "ba", "bd", "dd", repeated: which token may follow depends on the answer so far.
# (Every byte the grammar needs is a token, as in real byte-level vocabularies: llguidance's masks
# assume it.)
TABLE_GRAMMAR = Grammar.regex(r"(a[bc]|b[ad]|dd)+")
TABLE_CONSTRAINT = TokenConstraint(grammar=TABLE_GRAMMAR).placed(len(PROMPT)).bind(table_vocab())


def allowed(constraint: TokenConstraint, context: list[int]) -> list[int]:
    return np.flatnonzero(constraint.allowed(context)).tolist()


def test_mask_follows_the_answer_only() -> None:
    c = TABLE_CONSTRAINT
    assert allowed(c, PROMPT) == [0, 1, 3, 4]               # the prompt is not part of the answer
    assert allowed(c, [*PROMPT, 0]) == [1, 2]               # "a" -> b or c
    assert allowed(c, [*PROMPT, 1]) == [0, 3, 4]            # "b" -> a, d, or "ab" ("bab...")
    assert allowed(c, [*PROMPT, 4]) == [0, 1, 3, 4, END]    # "ab" is a whole match: the end is allowed
    assert allowed(c, [*PROMPT, 1, 3, 3]) == [3]            # "bdd" -> d
    assert allowed(c, [*PROMPT, 0, 0]) == [END]             # broke the grammar (a guess drafted ahead): end only
    assert allowed(c, [*PROMPT, 4, END]) == [END]           # ended
    assert allowed(c, [*PROMPT, 0]) == [1, 2]               # any order: rollback and consume
    assert allowed(c, [9, 9, 4, 0]) == [1, 2]               # only positions from start on count
    logits = np.zeros(6, np.float32)
    masked = c.apply(logits, [*PROMPT, 0])
    assert np.isneginf(masked[[0, 3, 4, 5]]).all() and np.isfinite(masked[[1, 2]]).all()
    assert np.isfinite(logits).all()                        # the input is left alone
    both = TokenConstraint(((0, 2),), grammar=TABLE_GRAMMAR).placed(len(PROMPT)).bind(table_vocab())
    assert allowed(both, [*PROMPT, 0]) == [1, 2] and np.isneginf(both.apply(logits, [*PROMPT, 0])[[0, 2]]).all()
    with pytest.raises(InvalidRequestError, match="never bound"):
        TokenConstraint(grammar=TABLE_GRAMMAR).placed(2).apply(logits, PROMPT)
    with pytest.raises(InvalidRequestError, match="never placed"):
        TokenConstraint(grammar=TABLE_GRAMMAR).bind(table_vocab()).apply(logits, PROMPT)


def test_grammar_travels_on_the_wire() -> None:
    sampling = SamplingParams(temperature=0.7, seed=3, constraint=TABLE_CONSTRAINT)
    back = wire.sampling_from_proto(wire.sampling_to_proto(sampling))
    assert back == sampling and back.constraint.grammar == TABLE_GRAMMAR.__class__(TABLE_GRAMMAR.text, len(PROMPT))
    assert back.constraint.banned == () and not back.constraint.bound   # the receiver binds it to its vocab
    assert wire.sampling_from_proto(wire.sampling_to_proto(SamplingParams())).constraint is None
    with pytest.raises(InvalidRequestError, match="never placed"):
        wire.sampling_to_proto(SamplingParams(constraint=TokenConstraint(grammar=TABLE_GRAMMAR)))
    bad = wire.sampling_to_proto(sampling)
    bad.constraint.grammar = "start: nothing_here"
    with pytest.raises(InvalidRequestError, match="invalid grammar"):
        wire.sampling_from_proto(bad)


# -- table models through the real Drafter/Decoder pipeline ---------------------------------------
def table_target_greedy(n: int) -> list[int]:
    """Constrained target-only greedy, with llguidance driven directly (one token at a time)."""
    matcher = llguidance.LLMatcher(table_vocab().tokenizer, TABLE_GRAMMAR.text, log_level=0)
    ctx = list(PROMPT)
    for _ in range(n):
        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8), bitorder="little", count=6)
        token = int(np.argmax(np.where(bits.astype(bool), logits_after(TARGET_TABLE, ctx), -np.inf)))
        ctx.append(token)
        if token == END:   # the answer ended (the table "model" goes on: only the end token from here)
            return [*ctx[len(PROMPT):], *[END] * (n - len(ctx) + len(PROMPT))]
        assert matcher.consume_token(token)
    return ctx[len(PROMPT):]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.label)
def test_greedy_grammar_speculation_equals_constrained_target_only(shape: TreeShape) -> None:
    n = 30
    expected = table_target_greedy(n)
    decoder = make_decoder(shape)
    try:
        out = [t for chunk in decoder.run(list(PROMPT), n, SamplingParams(constraint=TABLE_CONSTRAINT))
               for t in chunk][:n]
    finally:
        decoder.close()
    assert out == expected
    assert expected != table_free_greedy(n)   # the grammar bites
    assert decoder.stats.accepted > 0


def table_free_greedy(n: int) -> list[int]:
    ctx = list(PROMPT)
    for _ in range(n):
        ctx.append(int(np.argmax(logits_after(TARGET_TABLE, ctx))))
    return ctx[len(PROMPT):]


RUNS = 2500


@pytest.mark.parametrize("rule", list(AcceptanceRule), ids=lambda r: r.value)
@pytest.mark.parametrize("shape", SHAPES[1:], ids=lambda s: s.label)
def test_sampled_grammar_speculation_has_the_constrained_target_distribution(shape: TreeShape, rule) -> None:
    decoder = make_decoder(shape)
    counts: dict[tuple[int, ...], int] = {}
    try:
        for seed in range(RUNS):
            s = SamplingParams(temperature=1.0, seed=40_000 + seed, rule=rule, constraint=TABLE_CONSTRAINT)
            out = tuple([t for chunk in decoder.run(list(PROMPT), EMITTED, s) for t in chunk][:EMITTED])
            counts[out] = counts.get(out, 0) + 1
    finally:
        decoder.close()
    exact = masked_exact_distribution(SamplingParams(temperature=1.0, constraint=TABLE_CONSTRAINT))
    assert all(a in allowed(TABLE_CONSTRAINT, PROMPT) and b in allowed(TABLE_CONSTRAINT, [*PROMPT, a])
               for a, b in counts)                                             # every pair follows the grammar
    assert sum(p > 0 for p in exact.values()) >= 6                                 # and many pairs are possible
    assert chi2_pvalue(counts, exact) > 1e-4
    assert decoder.stats.accepted > 0


# -- real llama.cpp models -------------------------------------------------------------------------
def constrained_reference(model: LlamaModel, prompt: list[int], n: int, grammar: Grammar
                          ) -> tuple[list[int], list[logit_record.Row]]:
    """The target's own constrained greedy output, decoded token by token with llguidance driven
    directly; and the masked logits (top rows) before each token, for explaining a divergence."""
    matcher = llguidance.LLMatcher(model.grammar_vocab().tokenizer, grammar.text, log_level=0)
    ctx = TreeContext(model, ContextConfig(n_ctx=2048))
    tokens, rows = [], []
    try:
        logits = ctx.sync(prompt)
        for _ in range(n):
            bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8), bitorder="little",
                                 count=model.n_vocab).astype(bool)
            masked = np.where(bits, logits, -np.inf)
            rows.append(logit_record.Row.of(masked))
            token = int(np.argmax(masked))
            tokens.append(token)
            if model.is_end_of_generation(token):
                break
            assert matcher.consume_token(token)
            logits = ctx.ingest([token])
    finally:
        ctx.close()
    return tokens, rows


def assert_constrained_lossless(model: LlamaModel, prompt: list[int], out: list[int], ref: list[int],
                                rows: list[logit_record.Row], grammar: Grammar, label: str) -> bool:
    """out == ref, or their first divergence is a near-tie among the ALLOWED tokens that the logits
    measured in the verifier explain (tests/lossless.py's rule on masked rows). True if equal.
    `out` holds the answer without its end-of-generation token (the decoder does not emit it)."""
    if ref and model.is_end_of_generation(ref[-1]):
        assert len(out) == len(ref) - 1 or lossless.first_divergence(out, ref) is not None, (
            f"{label}: the target ended after {len(ref) - 1} tokens, the speculative answer has {len(out)}")
        ref, rows = ref[:-1], rows[:-1]
    i = lossless.first_divergence(out, ref)
    if i is None:
        assert len(out) == len(ref), f"{label}: {len(out)} tokens, target-only {len(ref)}"
        return True
    context = prompt + out[:i]
    found = logit_record.latest(context, lossless.model_name(model))
    assert found is not None, f"{label}: diverged at token {i} and no verifier logits were recorded for it"
    record, node = found
    batch = record.row(node)
    matcher = llguidance.LLMatcher(model.grammar_vocab().tokenizer, grammar.text, log_level=0)
    assert matcher.consume_tokens(out[:i])
    bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8), bitorder="little", count=model.n_vocab)
    allowed_ids = [int(t) for t in batch.ids if bits[int(t)]]
    assert allowed_ids and allowed_ids[0] == out[i], f"{label}: the verifier's masked argmax is not what it emitted"
    target = rows[i]
    margin = target.value(ref[i]) - target.value(out[i])
    common = {int(t) for t in target.ids if np.isfinite(target.value(int(t)))} & {int(t) for t in batch.ids}
    max_abs_diff = max(abs(batch.value(t) - target.value(t)) for t in common)
    assert max_abs_diff >= margin / 2 and max_abs_diff < lossless.NUMERIC_SANITY, (
        f"{label}: token {i}: margin {margin:.4f}, max |batch - target-only| {max_abs_diff:.4f}")
    print(f"{label}: divergence at token {i} explained: allowed near-tie, margin {margin:.4f}, "
          f"max |batch - target-only| {max_abs_diff:.4f}")
    return False


def grammar_tokens(session, prompt: list[int], n: int, sampling: SamplingParams) -> list[int]:
    """The speculative answer, without the end-of-generation token the decoder stopped on."""
    return [t for chunk in session.generate_tokens(prompt, n, sampling) for t in chunk]


def test_json_schema_through_a_real_verifier(smol_path, smol_model) -> None:
    """SmolLM2 behind a verifier process, the grammar carried by the proto: the answer parses and
    validates; greedy equals constrained target-only greedy and the same tree shape run locally;
    sampled answers validate too."""
    from tests.grpc_helpers import ServerProcess
    from edgespec.edge.session import EdgeSession

    grammar = Grammar.from_response_format(RESPONSE_FORMAT)
    prompt = smol_model.chat_tokens([{"role": "user", "content": ASK}])
    n = 96
    ref, rows = constrained_reference(smol_model, prompt, n, grammar)
    shape = TreeShape(budget=8, max_depth=4, branching=2, width=2)
    server = ServerProcess(smol_path, "--n-ctx", "1024", "--threads", "1", token="c")
    try:
        assert server.info().backend.startswith("llama") and server.info().grammar_constraints
        with EdgeSession(smol_path, smol_path, verifier=server.address, token="c", fallback=False, n_ctx=1024,
                         tree=shape, draft_threads=1) as remote, \
                EdgeSession(smol_path, smol_path, local=True, n_ctx=1024, tree=shape,
                            draft_threads=1, target_threads=1) as local:
            greedy = SamplingParams(constraint=TokenConstraint(grammar=grammar))
            got, here = grammar_tokens(remote, prompt, n, greedy), grammar_tokens(local, prompt, n, greedy)
            text = remote.chat(ASK, max_tokens=n, response_format=RESPONSE_FORMAT)
            finish = remote.finish_reason
            sampled = [remote.chat(ASK, max_tokens=n, temperature=1.0, seed=seed, response_format=RESPONSE_FORMAT)
                       for seed in range(3)]
            accepted = remote.stats.accepted
    finally:
        server.stop()
    assert got == here
    assert_constrained_lossless(smol_model, prompt, got, ref, rows, grammar, "smol via verifier")
    assert finish == "stop", text
    jsonschema.validate(json.loads(text), SCHEMA)
    for answer in sampled:
        jsonschema.validate(json.loads(answer), SCHEMA)
    assert len(set(sampled)) > 1 and accepted > 0


def test_bad_grammar_on_the_wire_is_invalid_argument(smol_path, smol_model) -> None:
    from tests.grpc_helpers import RawStream, ServerProcess, error_class

    prompt = smol_model.chat_tokens([{"role": "user", "content": "hi"}])
    server = ServerProcess(smol_path, "--n-ctx", "512", "--threads", "1", token="c")
    try:
        channel = server.channel("c")
        stream = RawStream(channel)
        try:
            opened = stream.ask(wire.open_message("", smol_model.tokenizer_fingerprint())).opened
            assert opened.grammar_constraints
            assert stream.ask(wire.sync_message(prompt)).synced.n_tokens == len(prompt)
            sampling = pb.SamplingParams(constraint=pb.TokenConstraint(grammar='start: "a" undefined',
                                                                       grammar_start=len(prompt)))
            msg = pb.EdgeMessage(verify=pb.Verify(step=0, sampling=sampling,
                                                  tree=wire.tree_to_proto(TokenTree.chain(prompt[-1], []))))
            err = stream.ask(msg)
            assert isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
            assert "invalid grammar" in err.details() and error_class(err) == "InvalidRequestError"
        finally:
            stream.close()
            channel.close()
        assert server.alive
    finally:
        server.stop()


def test_cli_json_schema(smol_path, tmp_path) -> None:
    import subprocess
    import sys

    good, bad = tmp_path / "person.json", tmp_path / "bad.json"
    good.write_text(json.dumps(SCHEMA))
    bad.write_text(json.dumps({"type": "object", "properties": {"a": {"type": "nosuch"}}}))
    base = [sys.executable, "-m", "edgespec", "run", ASK, "--draft", str(smol_path), "--target", str(smol_path),
            "--local", "--chain", "4", "--n-ctx", "1024", "--max-tokens", "96"]
    refused = subprocess.run([*base, "--json-schema", str(bad)], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "invalid grammar" in refused.stderr and "nosuch" in refused.stderr
    done = subprocess.run([*base, "--json-schema", str(good)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    jsonschema.validate(json.loads(done.stdout), SCHEMA)


@pytest.mark.qwen
def test_qwen_pair_greedy_json_equals_constrained_target_only(qwen_paths, qwen_models) -> None:
    """The real draft/target pair (0.5B drafts, 1.5B verifies, 16-node trees): the draft proposes
    only allowed tokens, the target decides among them, and the answer is the 1.5B model's own
    constrained answer. (One shape: a 1.5B reference costs minutes on a loaded 2-core CI box.)"""
    shape = TreeShape(budget=16)
    from edgespec.edge.session import EdgeSession

    _, target = qwen_models
    grammar = Grammar.from_response_format(RESPONSE_FORMAT)
    prompt = target.chat_tokens([{"role": "user", "content": ASK}])
    n = 64
    ref, rows = constrained_reference(target, prompt, n, grammar)
    with EdgeSession(*qwen_paths, tree=shape, local=True, n_ctx=2048) as session:
        out = grammar_tokens(session, prompt, n, SamplingParams(constraint=TokenConstraint(grammar=grammar)))
        tau = session.stats.tau
    exact = assert_constrained_lossless(target, prompt, out, ref, rows, grammar, f"qwen {shape.label}")
    if exact and len(out) < n:
        jsonschema.validate(json.loads(target.detokenize(out)), SCHEMA)
    assert tau > 1.5, f"the draft should propose accepted JSON tokens: tau {tau:.2f}"


def test_a_verifier_that_does_not_apply_grammars_is_never_sent_one(smol_path) -> None:
    """A verifier that does not announce Opened.grammar_constraints (an older version) would ignore
    the field and answer unconstrained: the edge refuses the request instead."""
    import dataclasses

    from edgespec.edge.session import EdgeSession
    from edgespec.verifier.llama_backend import LlamaCppBackend
    from edgespec.verifier.server import VerifierServer

    backend = LlamaCppBackend(smol_path, n_ctx=1024)
    backend.info = dataclasses.replace(backend.info, grammar_constraints=False)   # what an older verifier says
    server = VerifierServer(backend, port=0, keepalive_s=0).start()
    try:
        with EdgeSession(smol_path, smol_path, verifier=server.address, fallback=False, n_ctx=1024,
                         tree=TreeShape.chain(2), draft_threads=1) as session:
            assert session.chat("Say hi.", max_tokens=3)   # plain requests still work
            with pytest.raises(InvalidRequestError, match="does not apply grammar constraints"):
                session.chat(ASK, max_tokens=8, response_format=RESPONSE_FORMAT)
    finally:
        server.stop()
        backend.close()
