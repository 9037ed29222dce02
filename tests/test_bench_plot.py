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
