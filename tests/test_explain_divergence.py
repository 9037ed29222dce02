"""tools/explain_divergence.py on a committed bench_link result (docs/bench/, this CPU box, 50 ms): the
divergence of chain4 from AR on spec/writing/81 at token 13, recomputed with the real Qwen target in
the llama.cpp verifier's context (where the two tokens' order flips with the batch shape: explained) and
in the float32 torch verifier's steps (the exact path: every shape gives the same row, nothing to flip)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "docs" / "bench" / "cpu_link50_2026-12-01f.json"


def explain(tmp_path: Path, *extra: str) -> list[dict]:
    out = tmp_path / "explained.json"
    subprocess.run([sys.executable, str(ROOT / "tools" / "explain_divergence.py"), str(RESULT), "--all",
                    "--json", str(out), *extra], check=True, cwd=ROOT, timeout=600, capture_output=True)
    return json.loads(out.read_text())


def test_llama_numerics_explain_the_divergence(tmp_path, qwen_paths):
    [d] = explain(tmp_path, "--target", str(qwen_paths[1]))
    assert (d["mode"], d["prompt"], d["position"], d["backend"]) == ("chain4", "spec/writing/81", 13, "llama")
    assert {r["argmax"] for r in d["rows"]} == {d["ar_token"], d["mode_token"]}   # each wins in some shape
    assert d["order_flips"] and d["top_two_everywhere"] and d["explained"]
    assert len(d["rows"]) == 8 and {(r["row"], r["rows"]) for r in d["rows"]} >= {(0, 1), (4, 5)}


def test_the_float32_torch_path_gives_one_row_for_every_shape(tmp_path, qwen_paths):
    pytest.importorskip("torch")
    [d] = explain(tmp_path, "--target", str(qwen_paths[1]), "--backend", "torch", "--device", "cpu",
                  "--mode", "chain4", "--prompt", "1")
    assert d["backend"] == "torch" and len(d["rows"]) == 8
    assert len({(r["logit_ar"], r["logit_mode"]) for r in d["rows"]}) == 1   # batch shape changes nothing
    assert d["logit_spread"] == 0.0 and not d["order_flips"]
