"""Regenerate the committed gRPC stubs: python scripts/gen_protos.py [OUT_ROOT].

The proto path mirrors the package (deeprec_ext/proto/*.proto), so the generated
modules import each other as ``deeprec_ext.proto.x_pb2`` without patching.
tests/test_protos.py regenerates into a temp dir and fails on any difference.
"""
import pathlib
import re
import sys

from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent
# The *_grpc.py stubs refuse a grpcio runtime older than the grpcio-tools that wrote them.
# They are stamped with setup.py's lower bound instead, so the stubs never ask for more
# than the package allows, and a newer grpcio-tools writes the same files.
_VERSION_LINE = re.compile(r"^GRPC_GENERATED_VERSION = '[^']*'$", re.M)


def min_grpc_version() -> str:
    """The lower bound of ``grpcio`` in setup.py's install_requires."""
    found = re.search(r'"grpcio>=([0-9.]+)', (ROOT / "setup.py").read_text())
    if not found:
        raise SystemExit("setup.py: no grpcio>=X lower bound found")
    return found.group(1)


def generate(out_root: pathlib.Path) -> None:
    protos = sorted((ROOT / "deeprec_ext" / "proto").glob("*.proto"))
    include = pathlib.Path(protoc.__file__).parent / "_proto"
    for proto in protos:
        rel = proto.relative_to(ROOT)
        rc = protoc.main([
            "grpc_tools.protoc", f"-I{ROOT}", f"-I{include}",
            f"--python_out={out_root}", f"--grpc_python_out={out_root}", str(rel),
        ])
        if rc != 0:
            raise SystemExit(f"protoc failed on {rel}")
    stamp = f"GRPC_GENERATED_VERSION = '{min_grpc_version()}'"
    for stub in (out_root / "deeprec_ext" / "proto").glob("*_pb2_grpc.py"):
        text = stub.read_text()
        if not _VERSION_LINE.search(text):
            raise SystemExit(f"{stub}: no GRPC_GENERATED_VERSION line to stamp")
        stub.write_text(_VERSION_LINE.sub(stamp, text))


if __name__ == "__main__":
    generate(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
