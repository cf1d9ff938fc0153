"""``make proto``: regenerate the Python stubs in wqclient/pb from proto/wq/v1/broker.proto.

The generated modules are flattened into ``wqclient.pb`` (``wqclient.pb.broker_pb2``, ...) and their
imports rewritten to absolute ``wqclient.pb`` imports, so they import cleanly without sys.path
tricks. Type stubs (.pyi) come from mypy-protobuf. The output is committed; CI regenerates it and
fails on any difference.
"""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
from pathlib import Path

import grpc_tools
from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
SOURCE = "wq/v1/broker.proto"
OUT = ROOT / "wqclient" / "pb"

INIT = '"""Generated protobuf and gRPC stubs for wq.v1 (``make proto``; do not edit)."""\n'


def main() -> int:
    plugin_dir = Path(sys.executable).parent
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_DIR}",
            f"-I{well_known}",
            f"--plugin=protoc-gen-mypy={plugin_dir / 'protoc-gen-mypy'}",
            f"--plugin=protoc-gen-mypy_grpc={plugin_dir / 'protoc-gen-mypy_grpc'}",
            f"--python_out={tmp}",
            f"--grpc_python_out={tmp}",
            f"--mypy_out={tmp}",
            f"--mypy_grpc_out={tmp}",
            SOURCE,
        ]
        if protoc.main(args) != 0:
            print("protoc failed", file=sys.stderr)
            return 1
        generated = Path(tmp) / "wq" / "v1"
        if OUT.exists():
            shutil.rmtree(OUT)
        OUT.mkdir(parents=True)
        (OUT / "__init__.py").write_text(INIT)
        (OUT / "py.typed").write_text("")
        for path in sorted(generated.iterdir()):
            if path.suffix not in (".py", ".pyi"):
                continue
            text = path.read_text()
            text = re.sub(r"^from wq\.v1 import ", "from wqclient.pb import ", text, flags=re.M)
            text = re.sub(r"^import wq\.v1\.", "import wqclient.pb.", text, flags=re.M)
            text = re.sub(r"\bwq\.v1\.broker_pb2\b", "wqclient.pb.broker_pb2", text)
            (OUT / path.name).write_text(text)
    print(f"generated {', '.join(sorted(p.name for p in OUT.iterdir()))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
