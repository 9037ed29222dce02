"""Kernel knobs by name ($EDGESPEC_KERNEL_KNOBS, knobs.override): set where the kernels read them,
put back after an override, and a bad name or value is a clear error (exit 2 from the CLI)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from edgespec.verifier.torch import fused, knobs, tree_ops  # noqa: E402


def test_parse_accepts_commas_and_colons_and_rejects_unknown_names_and_values():
    assert knobs.parse("") == {}
    assert knobs.parse("GEMV_ROPE=1, MOVE_ROWS_KERNEL=0:TREE_SPLIT=1") == {
        "GEMV_ROPE": 1, "MOVE_ROWS_KERNEL": 0, "TREE_SPLIT": 1}
    with pytest.raises(ValueError, match="no kernel knob 'GEMV_ROEP'"):
        knobs.parse("GEMV_ROEP=1")
    with pytest.raises(ValueError, match="needs an integer"):
        knobs.parse("GEMV_ROPE=yes")
    with pytest.raises(ValueError, match="NAME=VALUE"):
        knobs.parse("GEMV_ROPE")
    with pytest.raises(ValueError, match="no kernel knob"):
        knobs.parse("triton=1")   # not a constant's name


def test_home_names_where_a_knob_lives():
    """tools/pick_knobs.py judges a variant of the attention's knobs alone only where its launch changed."""
    assert knobs.home("TARGET_PROGRAMS") == "TritonPagedAttention"
    assert (knobs.home("PDL"), knobs.home("GEMV_ROPE"), knobs.home("MOVE_ROWS_KERNEL")) == ("pdl", "fused", "tree_ops")
    with pytest.raises(ValueError, match="no kernel knob"):
        knobs.home("NO_SUCH_KNOB")


def test_override_sets_the_kernels_constants_and_puts_them_back():
    before = (fused.GEMV_ROPE, tree_ops.MOVE_ROWS_KERNEL)
    with knobs.override({"GEMV_ROPE": 1 - before[0], "MOVE_ROWS_KERNEL": 1 - before[1]}):
        assert (fused.GEMV_ROPE, tree_ops.MOVE_ROWS_KERNEL) == (1 - before[0], 1 - before[1])
        assert knobs.current(["GEMV_ROPE"]) == {"GEMV_ROPE": 1 - before[0]}
        every = knobs.current()
        assert every["GEMV_ROPE"] == 1 - before[0] and {"MOVE_ROWS_KERNEL", "PDL", "TREE_SPLIT"} <= set(every)
    assert (fused.GEMV_ROPE, tree_ops.MOVE_ROWS_KERNEL) == before
    with pytest.raises(ValueError):   # nothing is set when one name is bad
        knobs.set_knobs({"GEMV_ROPE": 1, "NOPE": 1})
    assert fused.GEMV_ROPE == before[0]


def test_environment_variable_is_applied_when_the_engine_is_imported():
    code = ("from edgespec.verifier.torch import engine, fused, tree_ops, knobs; "
            "print(fused.GEMV_ROPE, tree_ops.MOVE_ROWS_KERNEL, sorted(knobs.FROM_ENV.items()))")
    env = {**os.environ, knobs.ENV: "GEMV_ROPE=1,MOVE_ROWS_KERNEL=1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[0] == "1 1 [('GEMV_ROPE', 1), ('MOVE_ROWS_KERNEL', 1)]"


def test_importing_the_engine_runs_cublas_without_a_workspace_unless_the_environment_says_otherwise():
    """engine.CUBLAS_WORKSPACE: no cuBLAS workspace, so no memset node before the many-row GEMMs of a step's graph;
    an operator's own CUBLAS_WORKSPACE_CONFIG wins (cuBLAS reads it once, so it is set before any GPU work)."""
    code = "import os; from edgespec.verifier.torch import engine; print(os.environ['CUBLAS_WORKSPACE_CONFIG'])"
    env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    run = lambda e: subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True,  # noqa: E731
                                   check=True).stdout.strip()
    assert run(env) == ":0:2"
    assert run({**env, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}) == ":4096:8"


def test_verifier_serve_exits_2_naming_a_bad_knob(smol_path):
    env = {**os.environ, knobs.ENV: "GEMV_ROPE=x"}
    r = subprocess.run([sys.executable, "-m", "edgespec", "verifier", "serve", "--backend", "torch", "--model",
                        str(smol_path), "--port", "0"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "kernel knob GEMV_ROPE needs an integer, got 'x'" in r.stderr
