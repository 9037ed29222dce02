"""The wheel: models/manifest.json, the one model manifest, travels in it and an installed wheel
reads its own copy; the wheel carries no data file that nobody asked for."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "models", "proto", "edgespec")


def test_the_wheel_ships_the_manifest_from_models(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:   # a clean copy: no build/, no generated stubs, no caches
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*_pb2*.py*"))
        else:
            shutil.copy2(path, src / name)
    assert not (src / "edgespec" / "manifest").exists()   # no second copy in the source tree
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(src),
                    "-w", str(tmp_path / "dist")], check=True, timeout=600, capture_output=True)
    wheel = next((tmp_path / "dist").glob("edgespec-*.whl"))
    manifest = json.loads((ROOT / "models" / "manifest.json").read_text(encoding="utf-8"))
    with zipfile.ZipFile(wheel) as z:
        assert json.loads(z.read("edgespec/manifest/models.json")) == manifest
        data = {n for n in z.namelist() if not n.endswith(".py") and ".dist-info/" not in n}
    assert data == {"edgespec/manifest/models.json", "edgespec/v1/edgespec_pb2.pyi"}

    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, timeout=300, capture_output=True)
    # -S: no site-packages, so the editable install of this checkout cannot answer instead
    r = subprocess.run([sys.executable, "-S", "-c", "from edgespec.common import modelstore as m; "
                        "print(m.default_manifest_path()); print(m.load_manifest().names())"],
                       cwd=tmp_path, env={"PYTHONPATH": str(site)}, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    where, names = r.stdout.splitlines()
    assert Path(where) == site / "edgespec" / "manifest" / "models.json"
    assert names == str([m["name"] for m in manifest["models"]])


def test_a_checkout_reads_models_manifest_json():
    from edgespec.common import modelstore

    assert Path(modelstore.default_manifest_path()) == ROOT / "models" / "manifest.json"
