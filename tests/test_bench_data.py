"""The benchmarks run from a fresh clone: the Spec-Bench prompts ship in tools/data/ (with their
license and attribution), and every benchmark's default --spec-bench points there."""
from __future__ import annotations

import ast
import json
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tools" / "data"


def test_spec_bench_prompts_ship_with_license_and_attribution():
    rows = [json.loads(line) for line in (DATA / "spec_bench_questions.jsonl").read_text().splitlines()]
    assert len(rows) == 480 and len({r["question_id"] for r in rows}) == 480
    per_category = Counter(r["category"] for r in rows)
    assert len(per_category) == 13 and all(isinstance(t, str) and t for r in rows for t in r["turns"])
    assert "Apache License" in (DATA / "LICENSE-Apache-2.0.txt").read_text()
    readme = (DATA / "README.md").read_text()
    assert "hemingkx/Spec-Bench" in readme and "Apache License 2.0" in readme


def test_every_benchmark_defaults_to_the_shipped_copy():
    """The default of --spec-bench, read from each tool's argparse call (no tool reads ../shared)."""
    tools = sorted(p for p in (ROOT / "tools").glob("bench_*.py") if "--spec-bench" in p.read_text())
    assert {p.name for p in tools} >= {"bench_local.py", "bench_wire.py", "bench_link.py", "bench_pool.py"}
    for path in tools:
        text = path.read_text()
        assert "shared" not in text.split("--spec-bench", 1)[1].split("\n", 1)[0], path
        call = next(node for node in ast.walk(ast.parse(text)) if isinstance(node, ast.Call)
                    and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value == "--spec-bench")
        default = next(k.value for k in call.keywords if k.arg == "default")
        assert ast.unparse(default) == "REPO / 'tools' / 'data' / 'spec_bench_questions.jsonl'", (path, ast.unparse(default))
