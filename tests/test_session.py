"""EdgeSession end to end on SmolLM2 (as its own draft: fast), local verification, and bad input."""
import signal
import subprocess
import sys

import pytest

from edgespec import EdgeSession, TreeShape
from edgespec.common.errors import InvalidRequestError, ModelError, TokenizerMismatchError
from lossless import assert_lossless, spec_tokens, target_only_greedy

PROMPTS = ["Write a Python function that adds two numbers.", "What is the capital of France? Answer briefly.",
           "List three fruits."]
SHAPES = {"chain4": TreeShape.chain(4), "tree16": TreeShape(budget=16), "tree32": TreeShape(budget=32, max_depth=8, width=6)}


@pytest.fixture(scope="module")
def sessions(smol_path):
    made = {name: EdgeSession(smol_path, smol_path, tree=shape, local=True, n_ctx=1024) for name, shape in SHAPES.items()}
    yield made
    for s in made.values():
        s.close()


@pytest.mark.parametrize("shape", SHAPES)
def test_greedy_equals_target_only(sessions, smol_model, shape):
    session = sessions[shape]
    for prompt in PROMPTS:
        tokens = session.draft_model.chat_tokens([{"role": "user", "content": prompt}])
        ref = target_only_greedy(smol_model, tokens, 40)
        assert_lossless(spec_tokens(session, tokens, 40), ref, f"{shape} / {prompt!r}")


def test_stream_concatenates_to_text(sessions):
    session = sessions["tree16"]
    text = session.chat(PROMPTS[0], max_tokens=30)
    chunks = list(session.chat(PROMPTS[0], max_tokens=30, stream=True))
    assert len(chunks) > 1 and "".join(chunks) == text
    assert session.stats.steps > 0 and session.stats.tau > 1.0


def test_seeded_sampling_is_reproducible(sessions):
    session = sessions["tree16"]
    a = session.chat(PROMPTS[2], max_tokens=40, temperature=0.9, seed=11)
    b = session.chat(PROMPTS[2], max_tokens=40, temperature=0.9, seed=11)
    others = {session.chat(PROMPTS[2], max_tokens=40, temperature=0.9, seed=s) for s in (1, 2, 3)}
    assert a == b
    assert len(others | {a}) > 1


def test_max_tokens_is_respected(sessions):
    session = sessions["chain4"]
    tokens = session.draft_model.chat_tokens([{"role": "user", "content": PROMPTS[0]}])
    from edgespec.common.sampling import SamplingParams
    out = [t for chunk in session.generate_tokens(tokens, 7, SamplingParams()) for t in chunk]
    assert len(out) == 7


def test_bad_requests(sessions):
    session = sessions["chain4"]
    with pytest.raises(InvalidRequestError, match="empty"):
        session.chat("   ")
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        session.chat("hi", max_tokens=0)
    with pytest.raises(InvalidRequestError, match="temperature"):
        session.chat("hi", temperature=-1)


def test_missing_model_file(tmp_path):
    with pytest.raises(ModelError, match="not found"):
        EdgeSession(tmp_path / "nope.gguf", tmp_path / "nope.gguf", local=True)


def test_mismatched_tokenizers_are_refused(smol_path, qwen_paths):
    with pytest.raises(TokenizerMismatchError, match="different token lists"):
        EdgeSession(smol_path, qwen_paths[1], local=True)


def cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "edgespec", *args], capture_output=True, text=True, timeout=timeout)


def test_cli_run_local(smol_path):
    r = cli("run", "Say hello.", "--local", "--draft", str(smol_path), "--target", str(smol_path), "--max-tokens", "12")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    assert "tokens in" in r.stderr and "tau" in r.stderr


def test_cli_run_ctrl_c_keeps_the_answer_and_exits_130(smol_path):
    proc = subprocess.Popen([sys.executable, "-m", "edgespec", "run", "Write a long story about a robot.", "--local",
                             "--draft", str(smol_path), "--target", str(smol_path), "--max-tokens", "4000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stdout.read(1)   # the answer has started
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert first and proc.returncode == 130, err
    assert "interrupted:" in err and "Traceback" not in err
    tokens = int(err.split("interrupted: ", 1)[1].split(" tokens", 1)[0])
    assert 0 < tokens < 4000 and (first + out).strip()


@pytest.mark.parametrize("args,message", [
    (["   "], "empty"),
    (["hi", "--max-tokens", "0"], "max-tokens"),
    (["hi", "--target", "/nonexistent/model.gguf"], "not found"),
])
def test_cli_bad_input_exit_codes(smol_path, args, message):
    r = cli("run", *args, "--local", "--draft", str(smol_path), *(["--target", str(smol_path)] if "--target" not in args else []))
    assert r.returncode == 2, r.stderr
    assert message in r.stderr


def test_cli_mismatched_tokenizers(smol_path, qwen_paths):
    r = cli("run", "hi", "--local", "--draft", str(smol_path), "--target", str(qwen_paths[1]))
    assert r.returncode == 2 and "token lists" in r.stderr


def test_cli_unreachable_verifier_fails_clearly_unless_local_first(smol_path):
    """A verifier never reached is a configuration error (more cases: tests/test_config_errors.py)."""
    common = ("run", "Say hi.", "--draft", str(smol_path), "--target", str(smol_path), "--max-tokens", "8",
              "--verifier", "127.0.0.1:1", "--deadline", "2")
    r = cli(*common, "--local-first")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() and "verifying local" in r.stderr
    for extra in ((), ("--no-fallback",)):
        r = cli(*common, *extra)
        assert r.returncode == 2 and "connection refused" in r.stderr and not r.stdout.strip(), r.stderr


def test_tree_shape_can_change_within_the_sessions_size(smol_path, smol_model, sessions):
    with pytest.raises(InvalidRequestError, match="tree nodes"):
        sessions["chain4"].tree_shape = TreeShape(budget=64, max_depth=10, top_k=6, width=8)
    assert sessions["chain4"].tree_shape == TreeShape.chain(4)   # unchanged after the refusal
    with EdgeSession(smol_path, smol_path, local=True, n_ctx=1024) as session:   # sized for the planner's ladder
        tokens = session.draft_model.chat_tokens([{"role": "user", "content": PROMPTS[0]}])
        ref = target_only_greedy(smol_model, tokens, 40)
        session.tree_shape = TreeShape(budget=64, max_depth=10, top_k=6, width=8)
        assert not session.decoder.drafts_ahead   # local + fixed shape: step by step, reproducible
        assert_lossless(spec_tokens(session, tokens, 40), ref, "tree64")
        assert session.stats.shapes == {"tree64": session.stats.steps}
        session.tree_shape = None   # back to the planner, which may pick any shape, target-only included
        assert session.tree_shape is None and session.decoder.planner is not None
        assert session.decoder.drafts_ahead       # the planner drafts ahead, here too
        session.reset_stats()
        assert_lossless(spec_tokens(session, tokens, 40), ref, "adaptive")
        assert sum(session.stats.shapes.values()) == session.stats.steps
