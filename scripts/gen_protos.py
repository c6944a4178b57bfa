"""Regenerate the committed gRPC stubs: python scripts/gen_protos.py [OUT_ROOT].

The proto path mirrors the package (deeprec_ext/proto/*.proto), so the generated
modules import each other as ``deeprec_ext.proto.x_pb2`` without patching.
tests/test_protos.py regenerates into a temp dir and fails on any difference.
"""
import pathlib
import sys

from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent


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


if __name__ == "__main__":
    generate(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
