"""``make proto``: regenerate the Python stubs in wqwire/pb from proto/wqwire/pb/broker.proto.

The .proto sits at the path of the Python package it generates (as grpc_health's does), so protoc,
run with ``-I proto`` and writing into the repository root, puts ``wqwire/pb/broker_pb2.py`` (and
``broker_pb2_grpc.py``) where they belong and writes their imports as ``wqwire.pb`` imports
itself: nothing is rewritten. Its protobuf package stays ``wq.v1`` (the wire names,
``wq.v1.Broker``). Type stubs (.pyi) come from mypy-protobuf. The .proto itself is copied beside
the stubs, so an installed wheel carries the contract a client in another language is generated
from. The output is committed; CI regenerates it and fails on any difference.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import grpc_tools
from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
SOURCE = "wqwire/pb/broker.proto"
OUT = ROOT / "wqwire" / "pb"

INIT = '"""Generated protobuf and gRPC stubs for wq.v1 (``make proto``; do not edit)."""\n'


def main() -> int:
    plugin_dir = Path(sys.executable).parent
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    if OUT.exists():
        shutil.rmtree(OUT)  # nothing stale survives a regeneration
    OUT.mkdir(parents=True)
    (OUT / "__init__.py").write_text(INIT)
    (OUT / "py.typed").write_text("")
    shutil.copyfile(PROTO_DIR / SOURCE, OUT / Path(SOURCE).name)
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_DIR}",
        f"-I{well_known}",
        f"--plugin=protoc-gen-mypy={plugin_dir / 'protoc-gen-mypy'}",
        f"--plugin=protoc-gen-mypy_grpc={plugin_dir / 'protoc-gen-mypy_grpc'}",
        f"--python_out={ROOT}",
        f"--grpc_python_out={ROOT}",
        f"--mypy_out={ROOT}",
        f"--mypy_grpc_out={ROOT}",
        SOURCE,
    ]
    if protoc.main(args) != 0:
        print("protoc failed", file=sys.stderr)
        return 1
    print(f"generated {', '.join(sorted(p.name for p in OUT.iterdir()))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
