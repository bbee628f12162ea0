"""Regenerate the committed Python stubs from protos/kvserve/v1/kvserve.proto (grpcio-tools).

    python protos/generate.py            # rewrite protos/kvserve_pb2*.py(i)
    python protos/generate.py --out DIR  # write elsewhere (the staleness test compares)
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTO_DIR = HERE / "kvserve" / "v1"
PROTO = PROTO_DIR / "kvserve.proto"
STUBS = ("kvserve_pb2.py", "kvserve_pb2.pyi", "kvserve_pb2_grpc.py")


def generate(out: Path) -> list[Path]:
    """Run protoc on the proto into `out`; return the stub paths."""
    import grpc_tools
    from grpc_tools import protoc

    out.mkdir(parents=True, exist_ok=True)
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    rc = protoc.main([
        "grpc_tools.protoc",
        f"-I{PROTO_DIR}",
        f"-I{well_known}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        str(PROTO),
    ])
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc}")
    # protoc writes a top-level module `kvserve_pb2`; the stubs live in the kvserve.protos package
    # ... and the messages' __module__ must be importable for pickling (Ray Serve pickles them).
    pb2_file = out / "kvserve_pb2.py"
    pb2_file.write_text(pb2_file.read_text().replace(
        "(DESCRIPTOR, 'kvserve_pb2', _globals)", "(DESCRIPTOR, 'kvserve.protos.kvserve_pb2', _globals)"
    ))
    grpc_file = out / "kvserve_pb2_grpc.py"
    text = grpc_file.read_text()
    text = re.sub(r"^import kvserve_pb2 as", "from kvserve.protos import kvserve_pb2 as", text,
                  flags=re.M)
    grpc_file.write_text(text)
    return [out / name for name in STUBS]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=HERE)
    a = ap.parse_args(argv)
    for p in generate(a.out):
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
