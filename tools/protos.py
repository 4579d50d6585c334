"""Compile the KServe v2 gRPC messages (``service/grpc/inference.proto``) into the module the server
imports (``service/grpc/inference_pb2.py``) with protobuf's own compiler, the protoc that grpcio-tools
ships (the test extra installs it; serving needs only ``protobuf``).

From the repository root:

    python tools/protos.py           # regenerate inference_pb2.py
    python tools/protos.py --check   # exit 1 if inference_pb2.py is not what the .proto compiles to

The .proto is compiled as ``fusedserve/inference.proto``: the name protobuf's descriptor pool holds,
one no other package uses.
"""

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO = ROOT / "service" / "grpc" / "inference.proto"
GENERATED = ROOT / "service" / "grpc" / "inference_pb2.py"


def compile_proto() -> str:
    """The Python module protoc writes for ``PROTO``."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "fusedserve" / PROTO.name
        source.parent.mkdir()
        shutil.copy(PROTO, source)
        code = protoc.main(["protoc", f"-I{tmp}", f"--python_out={tmp}", str(source.relative_to(tmp))])
        if code != 0:
            raise RuntimeError(f"protoc failed on {PROTO} (exit {code}); its message is above")
        return source.with_name(PROTO.stem + "_pb2.py").read_text()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if the generated module is stale")
    args = parser.parse_args(argv)
    fresh = compile_proto()
    if args.check:
        if GENERATED.read_text() != fresh:
            print(f"{GENERATED.relative_to(ROOT)} is stale: run python tools/protos.py", file=sys.stderr)
            return 1
        return 0
    GENERATED.write_text(fresh)
    print(f"wrote {GENERATED.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
