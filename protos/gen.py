"""Regenerates the committed Python stubs from the .proto files.

Run `python -m pagoda.protos.gen` after editing a .proto; a test regenerates into a temporary
folder and compares, so stale stubs fail CI.
"""
import pathlib
import sys

import grpc_tools
from grpc_tools import protoc

import pagoda

# The folder that holds the `pagoda` package: .proto files are named from there
# (pagoda/protos/pagoda/v1/pagoda.proto), so the stubs import each other as pagoda.protos.*.
ROOT = pathlib.Path(pagoda.__file__).parent.parent
PROTOS = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "pagoda" / "protos").rglob("*.proto"))


def generate(out_dir: pathlib.Path) -> None:
    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    args = ["protoc", f"-I{ROOT}", f"-I{include}", f"--python_out={out_dir}",
            f"--grpc_python_out={out_dir}", f"--pyi_out={out_dir}", *PROTOS]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed: " + " ".join(args))


if __name__ == "__main__":
    generate(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
