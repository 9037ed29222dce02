"""`edgespec bench plot` draws the three PNGs from the repository's own benchmark JSON."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_plots_from_the_repository_benchmarks(tmp_path):
    import matplotlib.image

    r = subprocess.run([sys.executable, "-m", "edgespec", "bench", "plot", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    for name in ("tau_by_category.png", "speedup_vs_rtt.png", "verify_time_vs_tree_size.png"):
        path = tmp_path / name
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        height, width = matplotlib.image.imread(path).shape[:2]
        assert width > 400 and height > 300, (name, width, height)
        assert f"wrote {path}" in r.stdout


def test_no_input_is_an_error(tmp_path):
    r = subprocess.run([sys.executable, "-m", "edgespec", "bench", "plot", "--local", str(tmp_path / "a.json"),
                        "--link", str(tmp_path / "b.json"), "--wire", str(tmp_path / "c.json"), "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "no input found" in r.stderr and "Traceback" not in r.stderr


def test_a_gzipped_result_reads_as_its_plain_json(tmp_path):
    """docs/bench keeps its large raw results gzipped: every reader (the plots, explain_divergence, replay_planner,
    bench_link --from-json) goes through read_results, which must give the same object for both forms."""
    import gzip
    import json

    from edgespec.cli.bench import read_results

    data = {"meta": {"runs": [{"mode": "adaptive", "trace": [{"tree": {"tokens": [1, 2], "parents": [-1, 0]}}]}]}}
    plain, packed = tmp_path / "r.json", tmp_path / "r.json.gz"
    plain.write_text(json.dumps(data))
    with gzip.open(packed, "wt") as f:
        json.dump(data, f)
    assert read_results(plain) == read_results(packed) == data
    committed = sorted((ROOT / "docs" / "bench").glob("gpu_e2e_*.json.gz"))
    assert committed and "meta" in read_results(committed[-1])
