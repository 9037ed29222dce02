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


def _tool():
    sys.path.insert(0, str(ROOT / "tools"))
    import explain_divergence

    return explain_divergence


def test_own_step_finds_the_tree_and_row_that_chose_a_token():
    """Token k of an output comes from the step whose committed span holds it: the root's row decides the step's
    first token, the row of the accepted node before it any later one (the path's nodes in depth order)."""
    tool = _tool()
    prompt, out = [100, 101], [1, 2, 3, 4, 5, 6, 7]
    trace = [  # step 1 commits 1, 2 (node 1 accepted, then the target's own token); step 2 commits 3..6
        {"accepted": 1, "obs": {"accepted": [0]}, "tree": {"tokens": [101, 1, 9], "parents": [-1, 0, 0]}},
        {"accepted": 3, "obs": {"accepted": [3, 0, 1]},
         "tree": {"tokens": [2, 3, 4, 8, 5], "parents": [-1, 0, 1, 0, 2]}},
    ]
    first = tool.own_step(trace, prompt, out, 0)
    assert first == tool.Tree([100], [101, 1, 9], [-1, 0, 0], 0)
    assert tool.own_step(trace, prompt, out, 1).row == 1          # decided by accepted node 1's row
    step2 = tool.own_step(trace, prompt, out, 2)
    assert step2.context == [100, 101, 1] and step2.tokens[0] == 2 and step2.row == 0
    assert [tool.own_step(trace, prompt, out, k).row for k in (3, 4, 5)] == [1, 2, 4]   # path nodes 1, 2, 4
    assert tool.own_step(trace, prompt, out, 6) is None           # past the trace
    assert tool.own_step([{k: v for k, v in trace[0].items() if k != "tree"}], prompt, out, 0) is None
    with pytest.raises(ValueError, match="not rooted"):
        tool.own_step(trace, [100, 555], out, 0)


def test_the_runs_own_tree_is_recomputed_where_the_run_kept_its_trees(tmp_path, qwen_paths):
    """With a step trace holding the trees (bench_link's runs since they are recorded), the deciding row of the tree
    that chose the mode's token is computed too (`own_step`). Here the trace is written for the committed run's
    chain4 output: its 4th step, a 5-row chain, chose token 13 in row 1, which is the (1, 5) chain shape again with
    the same tokens before it, so the two rows must agree."""
    res = json.loads(RESULT.read_text())
    [cell] = [c for c in res["cells"] if c["mode"] == "chain4"]
    out = cell["outputs"][1]
    trace = [{"accepted": 3, "obs": {"accepted": [0, 1, 2]},
              "tree": {"tokens": out[p - 1:p + 4] if p else [], "parents": [-1, 0, 1, 2, 3]}} for p in (0, 4, 8, 12)]
    for run in res["meta"]["runs"]:
        if (run["mode"], run["prompt"]) == ("chain4", "spec/writing/81"):
            run["trace"] = trace
    (tmp_path / "run.json").write_text(json.dumps(res))
    out_json = tmp_path / "explained.json"
    subprocess.run([sys.executable, str(ROOT / "tools" / "explain_divergence.py"), str(tmp_path / "run.json"),
                    "--all", "--json", str(out_json), "--target", str(qwen_paths[1])],
                   check=True, cwd=ROOT, timeout=600, capture_output=True)
    [d] = json.loads(out_json.read_text())
    own = [r for r in d["rows"] if r.get("own_step")]
    assert len(d["rows"]) == 9 and len(own) == 1 and (own[0]["row"], own[0]["rows"]) == (1, 5)
    [same] = [r for r in d["rows"] if (r["row"], r["rows"]) == (1, 5) and not r.get("own_step")]
    assert {k: own[0][k] for k in same} == same
