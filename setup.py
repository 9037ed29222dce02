"""Build hook: generate the gRPC stubs from proto/ and ship the model manifest.

The stubs are build outputs (never committed). They land in edgespec/v1/, so the same
`from edgespec.v1 import edgespec_pb2` works for editable installs, wheels and tests.

The model manifest has one source, models/manifest.json; the build copies it into the package as
edgespec/manifest/models.json (read by edgespec.common.modelstore). A source checkout or editable
install reads models/manifest.json itself, so no copy ever lives in the source tree.
"""
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).parent


def generate_stubs() -> None:
    from grpc_tools import protoc  # build requirement (pyproject [build-system])
    import grpc_tools

    protos = sorted(str(p.relative_to(ROOT / "proto")) for p in (ROOT / "proto").rglob("*.proto"))
    if not protos:
        return
    include = str(Path(grpc_tools.__file__).parent / "_proto")
    args = ["protoc", f"-I{ROOT / 'proto'}", f"-I{include}", f"--python_out={ROOT}",
            f"--pyi_out={ROOT}", f"--grpc_python_out={ROOT}", *protos]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")


MANIFEST_SOURCE = ROOT / "models" / "manifest.json"
MANIFEST_IN_PACKAGE = Path("edgespec") / "manifest" / "models.json"


class BuildWithStubs(build_py):
    def run(self) -> None:
        generate_stubs()
        super().run()
        if not self.editable_mode:  # an editable install reads models/manifest.json in place
            target = Path(self.build_lib) / MANIFEST_IN_PACKAGE
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(MANIFEST_SOURCE, target)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = super().get_outputs(include_bytecode)
        return outputs if self.editable_mode else [*outputs, str(Path(self.build_lib) / MANIFEST_IN_PACKAGE)]


setup(cmdclass={"build_py": BuildWithStubs})
